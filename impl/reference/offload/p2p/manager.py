"""The P2P secondary tier of one engine (vLLM ``tiering/p2p/manager.py``, ``P2PSecondaryTierManager``).

What the tier keeps per kv_request_id (the id both engines share for one request):

* **consumer side** (``remote_prefiller`` in the request's kv_transfer_params): a new request
  opens a session toward the producer; ``lookup`` answers HIT for every key (the producer has
  them all) unless the id has *failed* (a failed load, a dead peer: then MISS, so the request
  prefills locally); ``submit_load`` sends a fetch round; ``on_request_finished`` aborts what is
  in flight and forgets the failure.
* **producer side** (``remote_decoder``): stores are *parked* per id until some peer fetches the
  id; the first fetch *binds* the id to that peer's session and replays the parked batches into
  it. A batch parked longer than :data:`UNBOUND_STORE_TIMEOUT_S` is *reaped*: its jobs fail, and
  for :data:`REAPED_ID_RETENTION_S` a later fetch of the id is answered at once with failure and
  a later store fails without parking. A store of a request with no ``remote_decoder`` succeeds
  at once (nothing to serve).
* **sessions**: one per peer; a dead one is reaped: its loads and stores fail, its ids fail, the
  peer is unregistered from the data plane; after a data-plane fault, reconnecting to the peer
  waits (1 s, doubling up to 60 s while faults repeat). When free peer slots are scarce
  (``max_peers - sessions <= min(IDLE_REAP_HEADROOM, max_peers - 1)``), a session with no pending
  work and no activity for ``idle_timeout_s`` is evicted the same way, without a backoff
  (vLLM ``_reap_idle_sessions``; ``VLLM_P2P_MAX_PEERS``, ``VLLM_P2P_IDLE_TIMEOUT_S``, 0 disables).

Every public call runs one step of the tier; ``get_finished_jobs`` runs the poll sweep (control
plane, every session, binding, reaping) and hands over the finished jobs.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvref.spec.errors import InvalidFieldError, check_int

from . import messages as m
from .control import ControlPlane
from .session import Session
from .transport import DataPlane

UNBOUND_STORE_TIMEOUT_S = 60.0
REAPED_ID_RETENTION_S = 60.0
SHUTDOWN_DRAIN_TIMEOUT_S = 3.0
DRAIN_SLEEP_S = 0.001
RECONNECT_MIN_BACKOFF_S = 1.0
RECONNECT_MAX_BACKOFF_S = 60.0
MAX_PEERS = 128  # VLLM_P2P_MAX_PEERS's default
IDLE_TIMEOUT_S = 300  # VLLM_P2P_IDLE_TIMEOUT_S's default
IDLE_REAP_HEADROOM = 8

ROLES = ("remote_prefiller", "remote_decoder", "remote_kv_source")


def unbound_store_timeout(value: object, backpressure: bool = False) -> float:
    """The parked-store timeout a P2P tier takes from its ``unbound_store_timeout_s`` option (vLLM
    ``P2PSecondaryTierManager.__init__``): anything ``float()`` converts to a positive number (a
    numeric str, ``True``, ``inf``), else refused; a back-pressure detector is refused first (the
    generic store-latency detector cannot fail fast in PD mode, so vLLM rejects it for this tier)."""
    if not isinstance(backpressure, bool):
        raise InvalidFieldError("backpressure", backpressure, "a bool (whether the tier was given a detector)")
    if backpressure:
        raise InvalidFieldError("backpressure", backpressure, "no back-pressure detector for the P2P tier")
    try:
        timeout_s = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        timeout_s = float("nan")
    if not timeout_s > 0:
        raise InvalidFieldError("unbound_store_timeout_s", value, "a positive number, or anything float() makes one")
    return timeout_s


@dataclass
class P2PRequest:
    """A request's parsed kv_transfer_params: the consumer's source peer or the producer's id."""

    kv_request_id: str | None
    peer_id: str | None  # set on the consumer side
    do_probe: bool = False  # a symmetric consumer (``remote_kv_source``): lookups probe the peer


def parse_request(params: object) -> P2PRequest | None:
    """The P2P role of a request's ``kv_transfer_params`` (None: not a P2P request)."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise InvalidFieldError("kv_transfer_params", params, "a dict or None")
    for role in ROLES:
        sub = params.get(role)
        if sub is not None and not isinstance(sub, dict):
            raise InvalidFieldError(f"kv_transfer_params[{role!r}]", sub, "a dict or None")
    src, probe = params.get("remote_prefiller"), False
    if src is None:  # a PD source wins; only without one is a symmetric source read
        src, probe = params.get("remote_kv_source"), True
    if src:
        host, port, kv = src.get("remote_host"), src.get("remote_port"), src.get("kv_request_id")
        if host and port and kv:
            return P2PRequest(kv, f"{host}:{port}", probe)
    if params.get("remote_decoder") is not None:
        return P2PRequest((params["remote_decoder"] or {}).get("kv_request_id") or None, None)
    return None


class P2PTierManager:
    def __init__(self, local_id: str, plane: DataPlane, control: ControlPlane, hello: dict, resolve_peer,
                 max_peers: int = MAX_PEERS, idle_timeout_s: int = IDLE_TIMEOUT_S,
                 unbound_store_timeout_s: float = UNBOUND_STORE_TIMEOUT_S) -> None:
        self.local_id = local_id
        self.unbound_store_timeout_s = unbound_store_timeout(unbound_store_timeout_s)
        self.max_peers = max_peers
        self.idle_timeout_s = idle_timeout_s
        self.idle_reaped = 0  # sessions evicted as idle (a count for the generators' coverage)
        self.rejected_peers = 0  # sessions reaped after their handshake was refused (the same)
        self.refused_at_limit = 0  # connections refused, and dials not made, for want of a peer slot (the same)
        self.plane = plane
        self.control = control
        self._hello = hello
        self._resolve_peer = resolve_peer
        self.sessions: dict[str, Session] = {}
        self.kv_to_session: dict[str, Session] = {}
        self.unbound: dict[str, list[tuple[int, list[bytes], list[int], float]]] = {}
        self.reaped: dict[str, float] = {}
        self.finished: list[tuple[int, bool]] = []
        self.failed: set[str] = set()
        self.backoff: dict[str, tuple[float, float]] = {}  # peer -> (wait, retry at)
        self.faults: dict[str, int] = {}
        self.requests: dict[str, P2PRequest | None] = {}
        self.failed_serves: list[str] = []  # reaped sessions' lookup requests, finished at the next serve
        self.now = 0.0

    # -- requests ---------------------------------------------------------------------------------

    def on_new_request(self, req_id: str, params: object, now: float) -> str:
        """Returns the offload policy the request asks for (REQUEST_LEVEL for a producer)."""
        self.now = now
        info = parse_request(params)
        self.requests[req_id] = info
        if info is not None and info.peer_id is not None:
            if self._get_or_create_session(info.peer_id) is None:
                self.failed.add(info.kv_request_id)
        if info is not None and info.peer_id is None and info.kv_request_id:
            return "REQUEST_LEVEL"
        return "CHUNK_LEVEL"

    def lookup(self, req_id: str, key: bytes) -> str:
        """PD consumer: HIT (the producer has every block). Symmetric consumer: the probe's answer,
        RETRY until the peer answered (MISS without a session)."""
        info = self.requests[req_id]
        if info is None or info.peer_id is None or info.kv_request_id in self.failed:
            return "MISS"
        if info.do_probe:
            s = self.sessions.get(info.peer_id)
            if s is None:
                return "MISS"
            hit = s.register_lookup(info.kv_request_id, key)
            return "RETRY" if hit is None else "HIT" if hit else "MISS"
        return "HIT"

    def on_schedule_end(self, now: float) -> None:
        """The end of a scheduler step: every session flushes the lookups registered in it."""
        self.now = now
        for s in self.sessions.values():
            s.flush_pending_lookups(now)

    def serve_external_requests(self, parent, now: float) -> None:
        """Finish the synthetic lookup requests of reaped sessions, then let every session serve
        its peers' lookups against ``parent`` (the engine's tiering manager)."""
        self.now = now
        for ctx in self.failed_serves:
            parent.on_request_finished(ctx)
        self.failed_serves = []
        for s in self.sessions.values():
            s.serve_external_requests(parent, now)

    def on_request_finished(self, req_id: str, now: float) -> None:
        self.now = now
        info = self.requests.pop(req_id)
        if info is None or not info.kv_request_id:
            return
        kv = info.kv_request_id
        self.failed.discard(kv)
        if info.peer_id is not None:
            s = self.sessions.get(info.peer_id)
            if s is not None:
                s.finish_request(kv, now)
            return
        s = self.kv_to_session.pop(kv, None)
        if s is not None:
            s.finish_request(kv, now)

    def submit_store(self, req_id: str, job: int, keys: list[bytes], chunk_ids: list[int], now: float) -> None:
        self.now = now
        info = self.requests[req_id]
        if info is None or info.peer_id is not None:
            self.finished.append((job, True))
            return
        kv = info.kv_request_id
        if not kv or kv in self.reaped:
            self.finished.append((job, False))
            return
        s = self.kv_to_session.get(kv)
        if s is not None:
            s.add_stored_blocks(kv, keys, chunk_ids, job, now)
            return
        self.unbound.setdefault(kv, []).append((job, list(keys), list(chunk_ids), now))

    def submit_load(self, req_id: str, job: int, keys: list[bytes], chunk_ids: list[int], now: float) -> None:
        self.now = now
        info = self.requests[req_id]
        if info is None or info.peer_id is None:
            self.finished.append((job, False))
            return
        if not keys:
            self.finished.append((job, True))
            return
        s = self.sessions.get(info.peer_id)
        if s is None:
            self.finished.append((job, False))
            self.failed.add(info.kv_request_id)
            return
        s.request_blocks(job, info.kv_request_id, keys, chunk_ids, now)

    # -- sessions ---------------------------------------------------------------------------------

    def _new_session(self, peer_id: str, conn) -> Session:
        return Session(peer_id, self.local_id, self.plane, self._hello, conn, self._resolve_peer, self.now,
                       clock=lambda: self.now)

    def _reconnect_wait(self, peer_id: str) -> float:
        entry = self.backoff.get(peer_id)
        return 0.0 if entry is None else entry[1] - self.now

    def _get_or_create_session(self, peer_id: str) -> Session | None:
        s = self.sessions.get(peer_id)
        if s is not None:
            return s
        if self._reconnect_wait(peer_id) > 0:
            return None
        if len(self.sessions) >= self.max_peers:  # every peer slot taken: no dial (vLLM logs it)
            self.refused_at_limit += 1
            return None
        s = self.sessions[peer_id] = self._new_session(peer_id, self.control.connect(peer_id))
        return s

    def _accept(self, conns) -> None:
        for conn in conns:
            if len(self.sessions) >= self.max_peers:
                self.refused_at_limit += 1
                conn.close()
            elif self._reconnect_wait(conn.peer_id) > 0:
                try:
                    conn.send(m.disconnect())
                except RuntimeError:
                    pass
                conn.close()
            elif conn.peer_id in self.sessions:
                conn.close()  # a duplicate connection is refused
            else:
                self.sessions[conn.peer_id] = self._new_session(conn.peer_id, conn)

    def _schedule_backoff(self, peer_id: str) -> None:
        for pid, (_, retry_at) in list(self.backoff.items()):
            if self.now - retry_at > RECONNECT_MAX_BACKOFF_S:
                del self.backoff[pid]
        prev = self.backoff.get(peer_id)
        wait = 0.0 if prev is None else min(max(2 * prev[0], RECONNECT_MIN_BACKOFF_S), RECONNECT_MAX_BACKOFF_S)
        self.backoff[peer_id] = (wait, self.now + wait)

    def _reap_dead(self) -> None:
        for pid in [p for p, s in self.sessions.items() if s.conn is not None and not s.alive]:
            s = self._close_session(pid)
            self.rejected_peers += s.rejected
            if s.server.peer_fault is not None:
                self.faults[pid] = self.faults.get(pid, 0) + 1
                self._schedule_backoff(pid)

    def _reap_unbound(self) -> None:
        for kv in [k for k, t in self.reaped.items() if t <= self.now - REAPED_ID_RETENTION_S]:
            del self.reaped[kv]
        for kv in [k for k, b in self.unbound.items() if b and b[0][3] <= self.now - self.unbound_store_timeout_s]:
            self.reaped[kv] = self.now
            self.finished += [(job, False) for job, *_ in self.unbound.pop(kv)]

    def _close_session(self, pid: str) -> Session:
        """Tear a session down: its loads and stores fail, its ids fail, the peer is unregistered."""
        s = self.sessions.pop(pid)
        for kv in [k for k, b in self.kv_to_session.items() if b is s]:
            del self.kv_to_session[kv]
        jobs, kvs, stores, serves = s.close()
        self.finished += [(j, False) for j in jobs] + [(j, False) for j in stores]
        self.failed.update(kvs)
        self.failed_serves += serves
        self.plane.remove_remote_peer(pid)
        return s

    def _reap_idle(self) -> None:
        if self.idle_timeout_s <= 0:
            return
        headroom = min(IDLE_REAP_HEADROOM, max(0, self.max_peers - 1))
        if len(self.sessions) < self.max_peers - headroom:
            return
        deadline = self.now - self.idle_timeout_s
        for pid in [p for p, s in self.sessions.items() if not s.has_pending_work and s.last_activity_at <= deadline]:
            self._close_session(pid)
            self.idle_reaped += 1

    def get_finished_jobs(self, now: float) -> list[tuple[int, bool]]:
        """The poll sweep, then the jobs finished since the last call."""
        self._poll_once(now)
        out, self.finished = self.finished, []
        return out

    def drain_jobs(self, now: float, max_polls: int) -> tuple[float, bool]:
        """vLLM's ``drain_jobs`` (before a reset): poll sweeps, :data:`DRAIN_SLEEP_S` apart, until no
        session has a load or a write outstanding; nothing is cancelled and the results wait for the
        next ``get_finished_jobs``. vLLM waits as long as that takes; a caller's patience is
        ``max_polls`` sweeps. Returns (the clock after, whether it drained)."""
        check_int("max_polls", max_polls, minimum=1)
        for i in range(max_polls):
            self._poll_once(now)
            if not any(s.has_pending_work for s in self.sessions.values()):
                return now, True
            if i < max_polls - 1:
                now += DRAIN_SLEEP_S
        return now, False

    def _poll_once(self, now: float) -> None:
        """vLLM's ``_poll_once``: accept peers, poll every session, bind fetched ids, reap."""
        self.now = now
        self._accept(self.control.poll())
        for s in list(self.sessions.values()):
            loads, stores, fetched = s.poll(now)
            for job, kv, ok in loads:
                self.finished.append((job, ok))
                if not ok:
                    self.failed.add(kv)
            self.finished += stores
            for kv in fetched:
                if kv in self.reaped:  # nothing can serve it: fail the round now
                    s.finish_request(kv, now)
                    self.finished += [(job, False) for job, *_ in self.unbound.pop(kv, ())]
                    continue
                self.kv_to_session[kv] = s
                for job, keys, ids, _ in self.unbound.pop(kv, ()):
                    s.add_stored_blocks(kv, keys, ids, job, now)
        self._reap_dead()
        self._reap_unbound()
        self._reap_idle()

    def shutdown(self, now: float) -> float:
        """Drain pending writes (up to :data:`SHUTDOWN_DRAIN_TIMEOUT_S`), close every session (their
        jobs are dropped, not reported), fail the parked stores. Returns the clock after the drain."""
        self.now = now
        ids = [t for s in self.sessions.values() for t in s.server.inflight]
        if ids:
            deadline = now + SHUTDOWN_DRAIN_TIMEOUT_S
            still = ids
            while still and now < deadline:
                still = self.plane.cancel(still, mode="wait")
                if not still:
                    break
                self.plane.poll()
                now += DRAIN_SLEEP_S
            if still:
                self.plane.cancel(still, mode="immediate")
        for s in self.sessions.values():
            s.close()
        self.sessions.clear()
        self.kv_to_session.clear()
        self.finished += [(job, False) for batches in self.unbound.values() for job, *_ in batches]
        self.unbound.clear()
        self.reaped.clear()
        self.control.close()
        self.plane.close()
        return now

    def check_invariants(self) -> None:
        assert all(s in self.sessions.values() for s in self.kv_to_session.values()), "P3: a bound id's session is live"
        assert not (self.unbound.keys() & self.reaped.keys()), "P3: a reaped id parks nothing"
        assert all(self.unbound.values()), "P3: an id parks at least one batch"
        for s in self.sessions.values():
            s.check_invariants()
        self.plane.check_invariants()
        self.control.check_invariants()
