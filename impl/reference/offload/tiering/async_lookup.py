"""Non-blocking existence checks of a secondary tier (vLLM ``tiering/async_lookup.py``).

A tier that cannot answer ``lookup`` at once (a file system: one ``stat`` per chunk) keeps a
*probe* per key. The first lookup of a key creates it (PENDING) and answers None ("retry");
``flush`` (the tier's end of step) sends the step's new probes to a worker as one batch
(IN_FLIGHT); the worker's answers are applied on the next lookup or flush (RESOLVED) and from then
on the cached verdict is the answer. Each probe has a *generation*: a probe dropped by
``cleanup`` and created again never receives the old probe's answer. A probe with no request left
is dropped, except while in flight (a new request may still share it; its late answer drops it).
A failed load forces the cached verdict of its keys to False (``mark_miss``), so the scheduler
does not promote a chunk that cannot be read over and over (vLLM #49176); a newer probe still
pending keeps its own answer.

The worker is explicit here: ``run_worker`` answers the oldest batch with ``exists`` (what the
tier holds *when the worker runs*), so a trace decides whether answers land before or after the
next lookup.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

from ..keys import OffloadKey


class LookupPhase(enum.Enum):
    PENDING = "pending"
    IN_FLIGHT = "in_flight"
    RESOLVED = "resolved"


@dataclass
class LookupState:
    generation: int
    phase: LookupPhase = LookupPhase.PENDING
    result: bool | None = None
    request_ids: set[str] = field(default_factory=set)


class AsyncLookupManager:
    """Per-tier probe cache; ``exists(key)`` is the tier's answer when its worker runs."""

    def __init__(self, exists: Callable[[OffloadKey], bool]) -> None:
        self._exists = exists
        self.state: dict[OffloadKey, LookupState] = {}
        self.req_keys: dict[str, set[OffloadKey]] = {}
        self.next_generation = 0
        self.batch: list[tuple[OffloadKey, str, int]] = []
        self.to_worker: deque[list[tuple[OffloadKey, str, int]]] = deque()
        self.from_worker: deque[list[tuple[OffloadKey, int, bool]]] = deque()
        self.need_to_drain = False

    def lookup(self, key: OffloadKey, req_id: str) -> bool | None:
        if self.need_to_drain:
            self.drain_results()
            self.need_to_drain = False
        st = self.state.get(key)
        if st is None:
            st = self.state[key] = LookupState(self.next_generation)
            self.next_generation += 1
            self.batch.append((key, req_id, st.generation))
        st.request_ids.add(req_id)
        self.req_keys.setdefault(req_id, set()).add(key)
        return st.result

    def flush(self) -> None:
        self.drain_results()
        self.need_to_drain = True
        batch, self.batch = self.batch, []
        sent = []
        for key, req_id, gen in batch:
            st = self.state.get(key)
            if st is None or st.generation != gen:
                continue  # cleaned up (and maybe re-created) before it was sent
            st.phase = LookupPhase.IN_FLIGHT
            sent.append((key, req_id, gen))
        if sent:
            self.to_worker.append(sent)

    def run_worker(self) -> bool:
        """The worker answers the oldest batch sent to it; False when there is none. Keys are
        answered grouped by request, in first-appearance order of the request."""
        if not self.to_worker:
            return False
        batch = self.to_worker.popleft()
        by_req: dict[str, list[tuple[OffloadKey, int]]] = {}
        for key, req_id, gen in batch:
            by_req.setdefault(req_id, []).append((key, gen))
        self.from_worker.append([(k, g, bool(self._exists(k))) for entries in by_req.values() for k, g in entries])
        return True

    def drain_results(self) -> None:
        while self.from_worker:
            for key, gen, found in self.from_worker.popleft():
                st = self.state.get(key)
                if st is None or st.generation != gen:
                    continue
                if not st.request_ids:
                    del self.state[key]
                    continue
                st.result, st.phase = found, LookupPhase.RESOLVED

    def mark_miss(self, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            st = self.state.get(key)
            if st is not None and st.phase is LookupPhase.RESOLVED:
                st.result = False

    def cleanup(self, req_id: str) -> None:
        for key in self.req_keys.pop(req_id, ()):
            st = self.state[key]
            st.request_ids.discard(req_id)
            if not st.request_ids and st.phase is not LookupPhase.IN_FLIGHT:
                del self.state[key]

    def snapshot(self) -> dict[OffloadKey, tuple[str, bool | None, tuple[str, ...]]]:
        return {k: (s.phase.value, s.result, tuple(sorted(s.request_ids))) for k, s in self.state.items()}

    def check_invariants(self) -> None:
        for key, st in self.state.items():
            assert (st.result is not None) == (st.phase is LookupPhase.RESOLVED), f"T2: {key!r}: verdict vs phase"
            assert st.phase is LookupPhase.IN_FLIGHT or st.request_ids, f"T2: {key!r}: an idle probe nobody asked for"
            assert st.generation < self.next_generation, f"T2: {key!r}: a probe generation from the future"
        for req_id, keys in self.req_keys.items():
            for key in keys:
                assert key in self.state and req_id in self.state[key].request_ids, f"T2: {req_id}: stale reverse index"
        pending = {k for k, _, g in self.batch if k in self.state and self.state[k].generation == g}
        assert all(self.state[k].phase is LookupPhase.PENDING for k in pending), "T2: a batched probe left PENDING"
