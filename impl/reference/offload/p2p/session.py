"""One session per peer: the handshake, send gating and dispatch (vLLM ``session/session.py``).

A session owns one control connection and both roles toward its peer (:mod:`.client`,
:mod:`.server`). On creation it sends its own ``connect``; the peer's ``connect`` is checked
(block length, config fingerprint, hash seed — a mismatch kills the connection) and registers
the peer on the data plane, and only then is ``connect_ack`` sent. Until the peer's
``connect_ack`` arrives everything the roles send is queued (vLLM: the ack is the peer's promise
that it registered us), then flushed in order. A second ``connect``, a malformed message or a
duplicate fetch is a protocol error: ``disconnect`` is sent and the connection marked dead. A
session not ready within :data:`HANDSHAKE_TIMEOUT_S` of connecting is marked dead. A data-plane
fault disconnects once pending writes drain, or after :data:`PEER_FAULT_DRAIN_S`. The manager
reaps dead sessions, and idle ones (:attr:`Session.last_activity_at`: the last poll that received
a message, or the last send through the send gate; vLLM ``P2PSession.last_activity_at``).
"""

from __future__ import annotations

from . import messages as m
from .client import ClientRole
from .control import Conn
from .server import ServerRole
from .transport import DataPlane

HANDSHAKE_TIMEOUT_S = 30  # VLLM_P2P_HANDSHAKE_TIMEOUT_S's default
PEER_FAULT_DRAIN_S = 10.0
MAX_CONSECUTIVE_DISPATCH_ERRORS = 5


class Session:
    def __init__(self, peer_id: str, local_id: str, plane: DataPlane, hello: dict, conn: Conn,
                 resolve_peer, now: float, clock=None) -> None:
        self.peer_id = peer_id
        self.local_id = local_id
        self.plane = plane
        self._hello = hello  # our connect message
        self._resolve_peer = resolve_peer  # agent metadata -> the peer's plane (the handshake's payload)
        self.conn: Conn | None = conn
        self.send_ready = False
        self.queued: list[dict] = []
        self.registered: bool | None = None  # a peer registration awaiting its ack: None (none), True/False
        self.rejected = False  # the peer's handshake was refused: incompatible, or its registration failed
        self.peer_fault_at: float | None = None
        self.connected_at = now
        self.last_activity_at = now
        self.now = now
        self._clock = clock  # the engine's current time (a send between polls stamps activity with it)
        self.new_fetch_ids: list[str] = []
        self.client = ClientRole(self._send)
        self.server = ServerRole(peer_id, plane, self._send)
        self._raw_send(dict(hello))

    @property
    def alive(self) -> bool:
        return self.conn is None or self.conn.alive

    @property
    def has_pending_work(self) -> bool:
        return self.registered is not None or bool(self.client.active) or self.server.has_inflight

    # -- sending ----------------------------------------------------------------------------------

    def _raw_send(self, msg: dict) -> None:
        if self.conn is not None:
            self.conn.send(msg)

    def _send(self, msg: dict) -> None:
        if self.conn is None or not self.send_ready:
            self.queued.append(msg)
        else:
            self._do_send(msg)

    def _do_send(self, msg: dict) -> None:
        if self.conn is None:
            return
        try:
            self.conn.send(msg)
            self.last_activity_at = self._clock() if self._clock is not None else self.now
        except RuntimeError:
            self.conn.mark_dead()

    def _disconnect(self) -> None:
        if self.conn is not None:
            try:
                self.conn.send(m.disconnect())
            except RuntimeError:
                pass
            self.conn.mark_dead()

    # -- receiving --------------------------------------------------------------------------------

    def _dispatch(self, msg: dict) -> None:
        if self.conn is not None and not self.conn.alive:
            return  # buffered before the connection died
        kind = msg.get(m.TYPE_KEY)
        if kind == m.CONNECT:
            self._on_connect(msg)
            return
        m.validate(msg)  # ValueError: a protocol violation (the caller disconnects)
        if kind == m.CONNECT_ACK:
            self.send_ready = True
            for q in self.queued:
                self._do_send(q)
            self.queued.clear()
        elif kind == m.FETCH:
            self.server.on_fetch(msg["kv_request_id"], list(msg["keys"]), list(msg["block_indexes"]),
                                 msg["round_seq"])
            self.new_fetch_ids.append(msg["kv_request_id"])
        elif kind == m.ABORT_FETCH:
            self.server.on_abort_fetch(msg["kv_request_id"], msg["round_seq"], self.now)
        elif kind == m.TRANSFER_DONE:
            self.client.on_transfer_done(msg["kv_request_id"], msg["success"], msg["round_seq"])
        elif kind == m.ABORT_ACK:
            self.client.on_abort_ack(msg["kv_request_id"], msg["round_seq"])
        elif kind == m.LOOKUP:
            self.server.on_lookup(msg["kv_request_id"], [bytes(k) for k in msg["keys"]], msg["round_seq"], self.now)
        elif kind == m.LOOKUP_RESP:
            self.client.on_lookup_resp(msg["kv_request_id"], [bytes(k) for k in msg["keys"]], list(msg["hits"]),
                                       self.now)
        elif kind == m.DISCONNECT:
            if self.conn is not None:
                self.conn.mark_dead()

    def _on_connect(self, msg: dict) -> None:
        if self.send_ready or self.registered is not None:
            self._disconnect()  # a second connect is a protocol violation
            return
        mine = self._hello
        fp_theirs, fp_mine = msg.get("config_fingerprint", ""), mine["config_fingerprint"]
        if not isinstance(msg.get("peer_id"), str) or not isinstance(msg.get("num_blocks"), int) \
                or not isinstance(msg.get("block_len"), int) or not isinstance(msg.get("hash_seed"), str) \
                or msg["num_blocks"] <= 0 or msg["block_len"] <= 0 \
                or msg["block_len"] != mine["block_len"] or (fp_mine and fp_theirs and fp_theirs != fp_mine) \
                or msg["hash_seed"] != mine["hash_seed"]:
            self.conn.mark_dead()  # an incompatible peer: rejected, no ack
            self.rejected = True
            return
        try:
            self.plane.add_remote_peer(self.peer_id, self._resolve_peer(msg))
            self.registered = True
        except RuntimeError:
            self.registered = False

    def poll(self, now: float) -> tuple[list, list, list[str]]:
        """One tick: dispatch what arrived, ack a registration, timeouts, transfers, aborts."""
        self.now = now
        if self.conn is None:
            return [], [], []
        msgs = self.conn.recv()
        if msgs:
            self.last_activity_at = now
        for msg in msgs:
            try:
                self._dispatch(msg)
            except ValueError:
                self._disconnect()
        if self.registered is not None:
            ok, self.registered = self.registered, None
            if not ok:
                self.conn.mark_dead()
                self.rejected = True
            elif self.conn.alive:
                self._do_send(m.connect_ack(self.local_id))
        if not self.send_ready and self.conn.alive and now - self.connected_at > HANDSHAKE_TIMEOUT_S:
            self.conn.mark_dead()
        loads = self.client.collect_results(now)
        stores = self.server.collect_results(now)
        self.server.drain_pending_aborts(now)
        self._escalate_peer_fault(now)
        if self.client.expired_lookup(now) is not None:  # a peer that stopped answering probes
            self._disconnect()
        fetched, self.new_fetch_ids = self.new_fetch_ids, []
        return loads, stores, fetched

    def _escalate_peer_fault(self, now: float) -> None:
        if self.server.peer_fault is None or self.conn is None or not self.conn.alive:
            return
        if self.peer_fault_at is None:
            self.peer_fault_at = now
        if self.server.has_inflight and now - self.peer_fault_at < PEER_FAULT_DRAIN_S:
            return
        self._disconnect()

    # -- the manager's calls ----------------------------------------------------------------------

    def request_blocks(self, job: int, kv: str, keys: list[bytes], block_ids: list[int], now: float) -> None:
        self.client.request_blocks(job, kv, keys, block_ids, now)

    def add_stored_blocks(self, kv: str, keys: list[bytes], block_ids: list[int], job: int, now: float) -> None:
        self.server.add_stored_blocks(kv, keys, block_ids, job, now)

    def register_lookup(self, kv: str, key: bytes) -> bool | None:
        return self.client.register_lookup(kv, key)

    def flush_pending_lookups(self, now: float) -> None:
        self.client.flush_pending_lookups(self.send_ready, now)

    def serve_external_requests(self, parent, now: float) -> None:
        self.server.serve_external_requests(parent, now)

    def finish_request(self, kv: str, now: float) -> None:
        self.client.finish(kv, now)
        self.server.finish(kv)

    def close(self) -> tuple[list[int], list[str], list[int], list[str]]:
        """``(failed load jobs, failed kv ids, failed store jobs, synthetic lookup requests owing
        on_request_finished)``; sends ``disconnect``."""
        self.registered = None
        jobs, kvs = self.client.close()
        stores, serves = self.server.close()
        if self.conn is not None:
            try:
                self.conn.send(m.disconnect())
            except RuntimeError:
                pass
            self.conn.close()
            self.conn = None
        return jobs, kvs, stores, serves

    def check_invariants(self) -> None:
        assert not (self.send_ready and self.queued), "P3: a ready session sends directly"
        self.client.check_invariants()
        self.server.check_invariants()
