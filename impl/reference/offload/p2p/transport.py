"""The data plane (vLLM ``tiering/p2p/data/base.py``'s contract as ``data/nixl.py``'s NixlTransport keeps it).

One per engine, over its primary buffer. A peer must be registered (its layout learned in the
handshake) before blocks are written to it; ``write_blocks`` returns a transfer id or None
(unregistered peer); a transfer is pending until it completes or fails, and ``poll(peer)``
reports, once, the ids that finished since the last poll for that peer (``poll()`` without a
peer drains every peer: the shutdown drain). ``cancel`` in ``"wait"`` mode keeps every transfer
that may still be writing (NIXL cannot stop a WRITE in flight: vLLM's abort drain waits for them)
and returns their ids, while a transfer that already finished is released there and never
reported by a later poll; ``"immediate"`` releases every named transfer, pending or finished.

**Peer faults** (NIXL's failure model, ``data/base.py`` "Failure model"): each failed transfer a
poll reports is a *strike* against its peer; a poll that reports a success for the peer clears
its strikes first; :data:`MAX_CONSECUTIVE_TRANSFER_FAILURES` strikes in a row fault the peer, and
a faulted peer is reported in ``poll(peer).peer_fault`` (its first cause only) until it is
removed. Removing a peer forgets its strikes and its fault.

**Broken transfers** (a state check that raises): the first check of one faults its peer with
NIXL's status (``NIXL_ERR_REMOTE_DISCONNECT`` / ``NIXL_ERR_NOT_FOUND``), never a strike; a remote
disconnect is terminal (the poll reports it failed, a wait-mode cancel releases it), while a
not-found one stays in flight (the WRITE may still be landing, vLLM #59790) until an immediate
cancel; a wait-mode cancel re-checks it (faulting the peer again if it was removed meanwhile).

**Refused submissions and registrations** (vLLM ``write_blocks``'s and ``_build_peer_handles``'
except paths): NIXL may refuse a WRITE when it is posted (:data:`SUBMIT_ERRORS`); the write gets
no transfer id and vLLM classifies the error at once (``_record_failure``): NIXL's peer-scope
errors, matched by exception name or by status text (:func:`peer_fault_status`), fault the peer;
anything else is one strike (``"<exception>: <text>"``), three in a row a fault. A refused peer
registration (building the peer's descriptor list raises) fails the handshake.

Here transfers complete when the trace says (:meth:`DataPlane.complete`), as the vLLM world holds
NIXL's WRITEs until then; a completed write copies the blocks into the peer's buffer, and a
write whose peer was removed or has shut down fails (its endpoint is gone).
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_CONSECUTIVE_TRANSFER_FAILURES = 3  # vLLM data/nixl.py _MAX_CONSECUTIVE_TRANSFER_FAILURES
#: what a broken transfer's state check raises -> the peer-fault status NIXL reports for it
BREAK_STATUS = {"remote_disconnect": "NIXL_ERR_REMOTE_DISCONNECT", "not_found": "NIXL_ERR_NOT_FOUND"}
#: NIXL's peer-scope errors by exception name -> status (vLLM data/nixl.py ``_PEER_FAULT_ERRORS``)
PEER_FAULT_ERRORS = {"nixlRemoteDisconnectError": "NIXL_ERR_REMOTE_DISCONNECT",
                     "nixlNotFoundError": "NIXL_ERR_NOT_FOUND"}
#: how a WRITE's submission is refused, by the name the world is given: (the NIXL agent call that
#: fails, the exception vLLM sees, its text). ``post_err`` is ``transfer()`` returning ``"ERR"``,
#: which vLLM turns into its own RuntimeError.
SUBMIT_ERRORS = {
    "post_err": ("transfer", "RuntimeError", "transfer() posted with status ERR"),
    "prep_error": ("make_prepped_xfer", "RuntimeError", "NIXL_ERR_BACKEND: make_prepped_xfer refused (injected)"),
    "remote_disconnect": ("transfer", "nixlRemoteDisconnectError", "remote endpoint gone (injected)"),
    "not_found": ("make_prepped_xfer", "RuntimeError", "NIXL_ERR_NOT_FOUND: remote agent unknown (injected)"),
}


def peer_fault_status(exc_name: str, text: str) -> str | None:
    """NIXL's status for a peer-scope error (by exception name, else by status text), or None."""
    status = PEER_FAULT_ERRORS.get(exc_name)
    if status is not None:
        return status
    return next((s for s in PEER_FAULT_ERRORS.values() if s in text), None)


@dataclass
class Transfer:
    transfer_id: int
    peer_id: str
    local_idxs: list[int]
    remote_idxs: list[int]
    error: str | None = None  # broken: what its state check raises (BREAK_STATUS)
    struck: bool = False  # its failed check already faulted the peer (a poll charges it once)


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
    strikes: dict[str, int] = field(default_factory=dict)
    broken: list[Transfer] = field(default_factory=list)
    next_id: int = 0
    closed: bool = False
    #: armed refusals: the next submissions fail this way (:data:`SUBMIT_ERRORS`; None: goes through)
    submit_failures: list[str | None] = field(default_factory=list)
    #: armed refusals: this many next peer registrations fail (the peer's descriptors cannot be built)
    registration_failures: int = 0
    #: the refusals met so far, by kind ("registration" for a peer registration): generator coverage
    refused: dict[str, int] = field(default_factory=dict)
    #: armed failures of the next releases of a peer's handles (vLLM ``_release_remote_handles``):
    #: ``dlist`` (its descriptor list: logged, the agent is still removed) or ``agent`` (its remote
    #: agent: logged, the agent stays loaded); the peers whose agent stayed loaded
    release_failures: dict[str, int] = field(default_factory=lambda: {"dlist": 0, "agent": 0})
    leaked: set[str] = field(default_factory=set)

    def add_remote_peer(self, peer_id: str, remote: "DataPlane | None") -> None:
        """Register ``peer_id`` (its plane learned from the handshake); raises if it is gone."""
        if remote is None or remote.closed:
            raise RuntimeError(f"no live data plane for {peer_id}")
        if self.registration_failures:
            self.registration_failures -= 1
            self.refused["registration"] = self.refused.get("registration", 0) + 1
            self._remove_agent(peer_id)  # its agent was loaded before the descriptors failed
            raise RuntimeError(f"the descriptors of {peer_id} could not be prepared")
        self.peers[peer_id] = remote
        self.leaked.discard(peer_id)  # loaded again under its name

    def _remove_agent(self, peer_id: str) -> None:
        if self.release_failures["agent"]:
            self.release_failures["agent"] -= 1
            self.refused["release"] = self.refused.get("release", 0) + 1
            self.leaked.add(peer_id)
        else:
            self.leaked.discard(peer_id)

    def remove_remote_peer(self, peer_id: str) -> None:
        if peer_id in self.peers:  # its handles are released: a failure of one never skips the other
            if self.release_failures["dlist"]:
                self.release_failures["dlist"] -= 1
                self.refused["release"] = self.refused.get("release", 0) + 1
            self._remove_agent(peer_id)
        self.peers.pop(peer_id, None)
        self.faults.pop(peer_id, None)
        self.strikes.pop(peer_id, None)

    def set_peer_fault(self, peer_id: str, cause: str) -> None:
        """Judge ``peer_id`` unusable; the first cause stays until the peer is removed."""
        self.faults.setdefault(peer_id, cause)

    def write_blocks(self, peer_id: str, local_idxs: list[int], remote_idxs: list[int]) -> int | None:
        if peer_id not in self.peers or self.closed:
            return None
        kind = self.submit_failures.pop(0) if self.submit_failures else None
        if kind is not None:  # refused when posted: no transfer id, classified at once
            self.refused[kind] = self.refused.get(kind, 0) + 1
            _, exc_name, text = SUBMIT_ERRORS[kind]
            status = peer_fault_status(exc_name, text)
            if status is not None:
                self.set_peer_fault(peer_id, status)
            else:
                self._strike(peer_id, f"{exc_name}: {text}")
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
            landed = ok and target is not None and not target.closed
            if landed:
                for src, dst in zip(t.local_idxs, t.remote_idxs):
                    target.buffer[dst * n:(dst + 1) * n] = self.buffer[src * n:(src + 1) * n]
            self.finished.setdefault(t.peer_id, ([], []))[0 if landed else 1].append(t.transfer_id)
        return len(done)

    def break_transfers(self, count: int, error: str) -> int:
        """The oldest ``count`` pending transfers break (their state check raises ``error``)."""
        done, self.pending = self.pending[:count], self.pending[count:]
        for t in done:
            t.error = error
        self.broken += done
        return len(done)

    def poll(self, peer_id: str | None = None) -> tuple[list[int], list[int], str | None]:
        """``(done, failed, peer_fault)`` since the last poll (of ``peer_id``, or of every peer)."""
        done: list[int] = []
        failed: list[int] = []
        for t in sorted(self.broken, key=lambda t: t.transfer_id):
            if peer_id is not None and t.peer_id != peer_id:
                continue
            if not t.struck:
                self.set_peer_fault(t.peer_id, BREAK_STATUS[t.error])
                t.struck = True
            if t.error == "remote_disconnect":  # terminal: reported failed, no strike
                self.broken.remove(t)
                failed.append(t.transfer_id)
        struck: list[str] = []
        for p in [peer_id] if peer_id is not None else list(self.finished):
            d, f = self.finished.pop(p, ([], []))
            if d:
                self.strikes.pop(p, None)  # a success between failures (NIXL applies it first)
            done += d
            failed += f
            struck += [p] * len(f)
        for p in struck:
            self._strike(p, "state ERR")
        return sorted(done), sorted(failed), self.faults.get(peer_id) if peer_id is not None else None

    def _strike(self, peer_id: str, cause: str) -> None:
        """One more consecutive failure for ``peer_id``; the third in a row faults it."""
        self.strikes[peer_id] = self.strikes.get(peer_id, 0) + 1
        if self.strikes[peer_id] >= MAX_CONSECUTIVE_TRANSFER_FAILURES:
            self.set_peer_fault(peer_id, f"{self.strikes[peer_id]} consecutive transfer failures (last: {cause})")

    def fail_submissions(self, count: int, kind: str, after: int = 0) -> None:
        """After ``after`` more submissions go through, the next ``count`` are refused as ``kind``
        (:data:`SUBMIT_ERRORS`)."""
        self.submit_failures += [None] * after + [kind] * count

    def cancel(self, transfer_ids: list[int], mode: str = "immediate") -> list[int]:
        ids = set(transfer_ids)
        pending = {t.transfer_id for t in self.pending}
        broken = {t.transfer_id: t for t in self.broken}
        if mode == "immediate":
            still = []
        else:
            still = []
            for tid in transfer_ids:
                t = broken.get(tid)
                if t is not None:  # its state check raises again: the peer is faulted
                    self.set_peer_fault(t.peer_id, BREAK_STATUS[t.error])
                    if t.error != "remote_disconnect":
                        still.append(tid)
                elif tid in pending:
                    still.append(tid)
        self.broken = [t for t in self.broken if t.transfer_id not in ids or t.transfer_id in still]
        released = ids - set(still)  # a finished transfer is released here: no later poll reports it
        self.pending = [t for t in self.pending if t.transfer_id not in released]
        for p, (d, f) in list(self.finished.items()):
            self.finished[p] = ([t for t in d if t not in released], [t for t in f if t not in released])
        return still

    def close(self) -> None:
        self.closed = True
        self.pending.clear()
        self.broken.clear()
        self.finished.clear()
        self.peers.clear()
        self.faults.clear()
        self.strikes.clear()

    def check_invariants(self) -> None:
        ids = [t.transfer_id for t in self.pending]
        assert len(ids) == len(set(ids)) and all(0 <= i < self.next_id for i in ids), \
            f"P4: pending transfer ids {ids} repeat or were never issued"
        assert all(len(t.local_idxs) == len(t.remote_idxs) for t in self.pending), \
            "P4: a transfer's local and remote indices differ in length"
        assert not self.closed or (not self.pending and not self.peers), "P4: a closed transport keeps transfers"
