"""A session's client role: the loads this engine fetches from its peer (vLLM ``session/client.py``).

Per kv_request_id the client numbers its fetch rounds 0, 1, 2, … (each ``request_blocks`` sends a
``fetch`` closing the current round and opens the next); a round's load ends with the peer's
``transfer_done`` (its success), or ``abort_ack`` (failed). A load not done within
:data:`LOAD_TIMEOUT_S` is aborted (``abort_fetch``); an abort not acknowledged within
:data:`ABORT_ACK_TIMEOUT_S` fails the load anyway. Finishing a request aborts its loads still in
flight. A request's entry is dropped once nothing is in flight, so its rounds restart at 0.
Acks for rounds the client no longer tracks (duplicates, races with a local timeout) are ignored.

Symmetric-P2P probing (``lookup``/``lookup_resp``) is not modelled (docs/differences.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from . import messages as m

LOAD_TIMEOUT_S = 30.0
ABORT_ACK_TIMEOUT_S = 10.0


@dataclass
class Load:
    job_id: int
    submitted_at: float
    aborted_at: float | None = None


@dataclass
class ClientRequest:
    round_seq: int = 0
    loads: dict[int, Load] = field(default_factory=dict)


class ClientRole:
    def __init__(self, send: Callable[[dict], None]) -> None:
        self._send = send
        self.requests: dict[str, ClientRequest] = {}
        # ids with a load in flight; a set like vLLM's, so timeouts are walked in the same order
        self.active: set[str] = set()
        self._completed: list[tuple[int, str, bool]] = []

    def _prune(self, kv: str) -> None:
        st = self.requests.get(kv)
        if st is not None and not st.loads:
            del self.requests[kv]
            self.active.discard(kv)

    def request_blocks(self, job_id: int, kv: str, keys: list[bytes], block_ids: list[int], now: float) -> None:
        st = self.requests.setdefault(kv, ClientRequest())
        rnd = st.round_seq
        st.round_seq += 1
        st.loads[rnd] = Load(job_id, now)
        self.active.add(kv)
        self._send(m.fetch(kv, keys, [int(i) for i in block_ids], rnd))

    def finish(self, kv: str, now: float) -> None:
        st = self.requests.get(kv)
        if st is None:
            return
        for rnd, load in st.loads.items():
            if load.aborted_at is None:
                self._send(m.abort_fetch(kv, rnd))
                load.aborted_at = now
        self._prune(kv)

    def _end(self, kv: str, rnd: int, success: bool) -> None:
        st = self.requests.get(kv)
        load = st.loads.pop(rnd, None) if st is not None else None
        if load is None:
            return
        self._completed.append((load.job_id, kv, success))
        self._prune(kv)

    def on_transfer_done(self, kv: str, success: bool, rnd: int) -> None:
        self._end(kv, rnd, success)

    def on_abort_ack(self, kv: str, rnd: int) -> None:
        self._end(kv, rnd, False)

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
            self.requests[kv].loads.pop(rnd)
            self._prune(kv)
        out, self._completed = self._completed, []
        return out

    def close(self) -> tuple[list[int], list[str]]:
        """``(failed load jobs, failed kv_request_ids)``: everything in flight toward a gone peer."""
        jobs = [ld.job_id for st in self.requests.values() for ld in st.loads.values()]
        kvs = [kv for kv, st in self.requests.items() if st.loads]
        self.requests.clear()
        self.active.clear()
        self._completed.clear()
        return jobs, kvs

    def check_invariants(self) -> None:
        assert self.active == {kv for kv, st in self.requests.items() if st.loads}, \
            f"P1: active {self.active} is not the requests with loads {self.requests}"
        for st in self.requests.values():
            assert st.loads, "P1: an idle request entry is pruned"
            assert all(0 <= r < st.round_seq for r in st.loads), f"P1: a load round that was never issued: {st}"
