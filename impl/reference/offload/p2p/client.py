"""A session's client role: the loads this engine fetches from its peer (vLLM ``session/client.py``).

Per kv_request_id the client numbers its fetch rounds 0, 1, 2, … (each ``request_blocks`` sends a
``fetch`` closing the current round and opens the next); a round's load ends with the peer's
``transfer_done`` (its success), or ``abort_ack`` (failed). A load not done within
:data:`LOAD_TIMEOUT_S` is aborted (``abort_fetch``); an abort not acknowledged within
:data:`ABORT_ACK_TIMEOUT_S` fails the load anyway. Finishing a request aborts its loads still in
flight. A request's entry is dropped once nothing is in flight, so its rounds restart at 0.
Acks for rounds the client no longer tracks (duplicates, races with a local timeout) are ignored.

**Symmetric P2P probing** (a ``remote_kv_source`` consumer): ``register_lookup`` records a probe
of a key (None until answered) and answers it from the cache once resolved; the engine's
``on_schedule_end`` flushes one ``lookup`` per id with unsent keys, tagged with the id's current
round, which opens the peer's lookup state (a ``fetch`` closes it, a finish owes the terminal empty
``fetch``) and starts a :data:`LOOKUP_TIMEOUT_S` deadline that each newly answered probe renews;
a ``lookup_resp`` resolves probes; a fetch closes the round and forgets every probe. The session
disconnects when a deadline passes (vLLM ``get_expired_lookup``). A request entry lives while it
has loads, probes or unsent keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from . import messages as m

LOAD_TIMEOUT_S = 30.0
ABORT_ACK_TIMEOUT_S = 10.0
LOOKUP_TIMEOUT_S = 30.0


@dataclass
class Load:
    job_id: int
    submitted_at: float
    aborted_at: float | None = None


@dataclass
class ClientRequest:
    round_seq: int = 0
    loads: dict[int, Load] = field(default_factory=dict)
    probes: dict[bytes, bool | None] = field(default_factory=dict)  # key -> hit (None: unanswered)
    unsent: list[bytes] = field(default_factory=list)
    probed: bool = False
    peer_lookup_open: bool = False


class ClientRole:
    def __init__(self, send: Callable[[dict], None]) -> None:
        self._send = send
        self.requests: dict[str, ClientRequest] = {}
        # ids with a load in flight; a set like vLLM's, so timeouts are walked in the same order
        self.active: set[str] = set()
        self._completed: list[tuple[int, str, bool]] = []
        self._flush_pending: set[str] = set()
        self.lookup_deadlines: dict[str, float] = {}

    def _prune(self, kv: str) -> None:
        st = self.requests.get(kv)
        if st is not None and not st.loads and not st.probes and not st.unsent:
            del self.requests[kv]

    def _load_terminal(self, kv: str, st: ClientRequest) -> None:
        if st.loads:
            return
        self.active.discard(kv)
        self._prune(kv)

    def request_blocks(self, job_id: int, kv: str, keys: list[bytes], block_ids: list[int], now: float) -> None:
        st = self.requests.setdefault(kv, ClientRequest())
        rnd = st.round_seq
        st.round_seq += 1
        st.loads[rnd] = Load(job_id, now)
        self.active.add(kv)
        st.peer_lookup_open = False
        self._send(m.fetch(kv, keys, [int(i) for i in block_ids], rnd))
        # vLLM asserts a probed id fetches only confirmed keys; the caller (the scheduler) keeps that
        st.probes.clear()
        self.lookup_deadlines.pop(kv, None)

    def finish(self, kv: str, now: float) -> None:
        st = self.requests.get(kv)
        if st is None:
            return
        for rnd, load in st.loads.items():
            if load.aborted_at is None:
                self._send(m.abort_fetch(kv, rnd))
                load.aborted_at = now
        if st.peer_lookup_open:
            st.peer_lookup_open = False
            self._send(m.fetch(kv, [], [], st.round_seq))
        st.probes.clear()
        st.unsent.clear()
        self.lookup_deadlines.pop(kv, None)
        self._flush_pending.discard(kv)
        self._prune(kv)

    def _end(self, kv: str, rnd: int, success: bool) -> None:
        st = self.requests.get(kv)
        load = st.loads.pop(rnd, None) if st is not None else None
        if load is None:
            return
        self._completed.append((load.job_id, kv, success))
        self._load_terminal(kv, st)

    def on_transfer_done(self, kv: str, success: bool, rnd: int) -> None:
        self._end(kv, rnd, success)

    def on_abort_ack(self, kv: str, rnd: int) -> None:
        self._end(kv, rnd, False)

    # -- symmetric probing --------------------------------------------------------------------------

    def register_lookup(self, kv: str, key: bytes) -> bool | None:
        """The probe's answer (True HIT / False MISS), or None while it is unanswered (RETRY)."""
        st = self.requests.setdefault(kv, ClientRequest())
        st.probed = True
        if key in st.probes:
            return st.probes[key]
        st.probes[key] = None
        st.unsent.append(key)
        self._flush_pending.add(kv)
        return None

    def flush_pending_lookups(self, send_ready: bool, now: float) -> None:
        if not send_ready:
            return
        for kv in list(self._flush_pending):  # a set, walked in the order vLLM walks its own
            st = self.requests.get(kv)
            if st is None or not st.unsent:
                continue
            st.peer_lookup_open = True
            self.lookup_deadlines.setdefault(kv, now + LOOKUP_TIMEOUT_S)
            self._send(m.lookup(kv, st.unsent, st.round_seq))
            st.unsent = []
        self._flush_pending.clear()

    def on_lookup_resp(self, kv: str, keys: list[bytes], hits: list[bool], now: float) -> None:
        st = self.requests.get(kv)
        if st is None:
            return
        progressed = False
        for key, hit in zip(keys, hits):
            if key in st.probes:
                progressed |= st.probes[key] is None
                st.probes[key] = hit
        if all(h is not None for h in st.probes.values()):
            self.lookup_deadlines.pop(kv, None)
        elif progressed:
            self.lookup_deadlines[kv] = now + LOOKUP_TIMEOUT_S

    def expired_lookup(self, now: float) -> str | None:
        return next((kv for kv, deadline in self.lookup_deadlines.items() if now >= deadline), None)

    # -- the poll -----------------------------------------------------------------------------------

    def collect_results(self, now: float) -> list[tuple[int, str, bool]]:
        """Apply the load and abort-ack timeouts, then hand over the finished loads."""
        expired: list[tuple[str, int]] = []
        for kv in self.active:
            for rnd, load in self.requests[kv].loads.items():
                if load.aborted_at is None:
                    if now - load.submitted_at >= LOAD_TIMEOUT_S:
                        load.aborted_at = now
                        self._send(m.abort_fetch(kv, rnd))
                elif now - load.aborted_at >= ABORT_ACK_TIMEOUT_S:
                    expired.append((kv, rnd))
                    self._completed.append((load.job_id, kv, False))
        for kv, rnd in expired:
            st = self.requests[kv]
            st.loads.pop(rnd)
            self._load_terminal(kv, st)
        out, self._completed = self._completed, []
        return out

    def close(self) -> tuple[list[int], list[str]]:
        """``(failed load jobs, failed kv_request_ids)``: everything in flight toward a gone peer,
        and every id still waiting for a probe's answer."""
        jobs = [ld.job_id for st in self.requests.values() for ld in st.loads.values()]
        kvs = [kv for kv, st in self.requests.items() if st.loads or any(h is None for h in st.probes.values())]
        self.requests.clear()
        self.active.clear()
        self._completed.clear()
        self._flush_pending.clear()
        self.lookup_deadlines.clear()
        return jobs, kvs

    def check_invariants(self) -> None:
        assert self.active == {kv for kv, st in self.requests.items() if st.loads}, \
            f"P1: active {self.active} is not the requests with loads {self.requests}"
        for st in self.requests.values():
            assert st.loads or st.probes or st.unsent, "P1: an idle request entry is pruned"
            assert all(0 <= r < st.round_seq for r in st.loads), f"P1: a load round that was never issued: {st}"
        assert set(self.lookup_deadlines) <= set(self.requests), "P1: a lookup deadline of a forgotten id"
