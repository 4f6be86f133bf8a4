"""The data plane's contract (vLLM ``tiering/p2p/data/base.py``): block writes to a peer.

One per engine, over its primary buffer. A peer must be registered (its layout learned in the
handshake) before blocks are written to it; ``write_blocks`` returns a transfer id or None
(unregistered peer); a transfer is pending until it completes or fails, and ``poll(peer)``
reports, once, the ids that finished since the last poll for that peer. ``cancel`` in ``"wait"``
mode keeps every transfer that may still be writing (NIXL cannot stop a WRITE in flight: vLLM's
abort drain waits for them) and returns their ids; ``"immediate"`` drops them. A peer the plane
judges unusable is reported in ``poll(peer).peer_fault`` until the peer is removed.

Here transfers complete when the trace says (:meth:`DataPlane.complete`), like the in-memory
transport the vLLM world uses; a completed write copies the blocks into the peer's buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Transfer:
    transfer_id: int
    peer_id: str
    local_idxs: list[int]
    remote_idxs: list[int]


@dataclass
class DataPlane:
    """One engine's block transport: registered peers, pending and finished transfers."""

    name: str
    buffer: bytearray
    block_len: int
    peers: dict[str, "DataPlane"] = field(default_factory=dict)
    pending: list[Transfer] = field(default_factory=list)
    finished: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)
    faults: dict[str, str] = field(default_factory=dict)
    next_id: int = 0
    closed: bool = False

    def add_remote_peer(self, peer_id: str, remote: "DataPlane | None") -> None:
        """Register ``peer_id`` (its plane learned from the handshake); raises if it is gone."""
        if remote is None or remote.closed:
            raise RuntimeError(f"no live data plane for {peer_id}")
        self.peers[peer_id] = remote

    def remove_remote_peer(self, peer_id: str) -> None:
        self.peers.pop(peer_id, None)
        self.faults.pop(peer_id, None)

    def write_blocks(self, peer_id: str, local_idxs: list[int], remote_idxs: list[int]) -> int | None:
        if peer_id not in self.peers or self.closed:
            return None
        tid = self.next_id
        self.next_id += 1
        self.pending.append(Transfer(tid, peer_id, list(local_idxs), list(remote_idxs)))
        return tid

    def complete(self, count: int, ok: bool) -> int:
        """The oldest ``count`` pending transfers finish (``ok``: written, else failed)."""
        done, self.pending = self.pending[:count], self.pending[count:]
        n = self.block_len
        for t in done:
            target = self.peers.get(t.peer_id)
            if ok and target is not None and not target.closed:
                for src, dst in zip(t.local_idxs, t.remote_idxs):
                    target.buffer[dst * n:(dst + 1) * n] = self.buffer[src * n:(src + 1) * n]
            self.finished.setdefault(t.peer_id, ([], []))[0 if ok and target is not None else 1].append(t.transfer_id)
        return len(done)

    def poll(self, peer_id: str | None = None) -> tuple[list[int], list[int], str | None]:
        """``(done, failed, peer_fault)`` since the last poll (of ``peer_id``, or of every peer)."""
        done: list[int] = []
        failed: list[int] = []
        for p in [peer_id] if peer_id is not None else list(self.finished):
            d, f = self.finished.pop(p, ([], []))
            done += d
            failed += f
        return done, failed, self.faults.get(peer_id) if peer_id is not None else None

    def cancel(self, transfer_ids: list[int], mode: str = "immediate") -> list[int]:
        ids = set(transfer_ids)
        if mode == "immediate":
            self.pending = [t for t in self.pending if t.transfer_id not in ids]
            return []
        return [t.transfer_id for t in self.pending if t.transfer_id in ids]

    def close(self) -> None:
        self.closed = True
        self.pending.clear()
        self.peers.clear()

    def check_invariants(self) -> None:
        ids = [t.transfer_id for t in self.pending]
        assert len(ids) == len(set(ids)) and all(0 <= i < self.next_id for i in ids), \
            f"P4: pending transfer ids {ids} repeat or were never issued"
        assert all(len(t.local_idxs) == len(t.remote_idxs) for t in self.pending), \
            "P4: a transfer's local and remote indices differ in length"
        assert not self.closed or (not self.pending and not self.peers), "P4: a closed transport keeps transfers"
