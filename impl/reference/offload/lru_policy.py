"""LRU with request-scoped ranks (vLLM ``LRUCachePolicy``).

Each resident key has a rank; eviction takes the evictable, unprotected keys with the smallest
``(rank, key)``. A fresh global rank is ``(counter, 0)``. A request gets one provisional counter
value, and its keys are ranked ``(request_rank, -end_position)``: within a request, *tails are
evicted before heads* (a tail is useless without its head). ``touch`` and request finish give
fresh global ranks in reverse (tail-first) order so the head ends most recent.

vLLM keeps a lazily invalidated heap; the order it pops is exactly ``(rank, key)`` over the
evictable keys, which is what this reference computes directly.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Iterable, Sequence

from .cache_policy import CachePolicy, ChunkStatus
from .keys import OffloadKey, RequestContext, order_request_keys

Rank = tuple[int, int]


@dataclass
class _RequestRank:
    owner: object
    generation: int
    rank: int


class LRUCachePolicy(CachePolicy):
    name = "lru"

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.chunks: dict[OffloadKey, ChunkStatus] = {}
        self.ranks: dict[OffloadKey, Rank] = {}
        self.evictable: set[OffloadKey] = set()
        self._counter = 0
        self._generation = 0  # bumps on clear(): request ranks from before are stale

    def _fresh(self) -> int:
        self._counter += 1
        return self._counter

    def _request_rank(self, ctx: RequestContext) -> int:
        st = ctx.get_state(_RequestRank)
        if st is None or st.owner is not self or st.generation != self._generation:
            st = _RequestRank(self, self._generation, self._fresh())
            ctx.set_state(st)
        return st.rank

    def _refresh(self, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            if key in self.chunks:
                self.ranks[key] = (self._fresh(), 0)

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.chunks.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus, ctx: RequestContext) -> None:
        self.chunks[key] = chunk
        pos = ctx.get_offload_key_position(key)
        self.ranks[key] = (self._fresh(), 0) if pos is None else (self._request_rank(ctx), -pos)
        if chunk.ref_cnt == 0:
            self.evictable.add(key)

    def remove(self, key: OffloadKey) -> None:
        del self.chunks[key]
        self.ranks.pop(key, None)
        self.evictable.discard(key)

    def touch(self, keys: Iterable[OffloadKey], ctx: RequestContext) -> None:
        self._refresh(reversed(list(keys)))

    def on_request_access(self, keys: Iterable[OffloadKey], ctx: RequestContext) -> None:
        rr = self._request_rank(ctx)
        for key in keys:
            pos = ctx.get_offload_key_position(key)
            if pos is None or key not in self.chunks:
                continue
            # Only ever moves a key later (a request never makes its keys older).
            self.ranks[key] = max(self.ranks[key], (rr, -pos))

    def on_request_finished(self, key_groups: Sequence[Sequence[OffloadKey]], insertion_only_keys: set[OffloadKey],
                            reused_keys: set[OffloadKey], ctx: RequestContext) -> None:
        self._refresh(reversed(order_request_keys(key_groups, ctx)))

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        if n == 0:
            return []
        candidates = [k for k in self.evictable if k not in protected]
        if len(candidates) < n:
            return None
        victims = heapq.nsmallest(n, candidates, key=lambda k: (self.ranks[k], k))
        out = []
        for key in victims:
            chunk = self.chunks[key]
            self.remove(key)
            out.append((key, chunk))
        return out

    def clear(self) -> None:
        self.chunks.clear()
        self.ranks.clear()
        self.evictable.clear()
        self._counter = 0
        self._generation += 1

    def resident_keys(self) -> list[OffloadKey]:
        return list(self.chunks)

    def mark_evictable(self, key: OffloadKey) -> None:
        self.evictable.add(key)

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self.evictable.remove(key)

    def eviction_order(self) -> list[OffloadKey]:
        """Evictable keys, first victim first (for tests and reports)."""
        return sorted(self.evictable, key=lambda k: (self.ranks[k], k))

    def check_invariants(self) -> None:
        super().check_invariants()
        assert set(self.ranks) == set(self.chunks), "O7: rank table out of sync with residents"
        assert self.evictable == {k for k, c in self.chunks.items() if c.ref_cnt == 0}, \
            "O7: evictable set is not exactly the ref_cnt==0 chunks"
