"""ARC: adaptive replacement between recency (T1) and frequency (T2) (vLLM ``ARCCachePolicy``).

``T1`` holds keys seen once, ``T2`` keys a request re-used; ``B1``/``B2`` remember recently
evicted keys of each (ghosts, at most ``capacity`` each). A store miss that hits a B1 ghost
means T1 was too small: the target T1 size grows by ``max(1, |B2|/|B1|)``; a B2 ghost shrinks it
by ``max(1, |B1|/|B2|)``. Eviction takes from T1 while its (virtual, shrinking) size is at least
``int(target)``, else from T2, else T1 again; only ``ref_cnt == 0`` unprotected chunks; all or
nothing. Ordered dicts run LRU (first) to MRU (last).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Iterator, Sequence

from .cache_policy import CachePolicy, ChunkStatus
from .keys import OffloadKey, RequestContext, order_request_keys


class ARCCachePolicy(CachePolicy):
    name = "arc"

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.target_t1_size: float = 0.0
        self.t1: OrderedDict[OffloadKey, ChunkStatus] = OrderedDict()
        self.t2: OrderedDict[OffloadKey, ChunkStatus] = OrderedDict()
        self.b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b2: OrderedDict[OffloadKey, None] = OrderedDict()

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.t1.get(key) or self.t2.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus, ctx: RequestContext) -> None:
        self.t1[key] = chunk
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def remove(self, key: OffloadKey) -> None:
        if self.t1.pop(key, None) is None:
            self.t2.pop(key, None)

    def _adapt(self, key: OffloadKey) -> None:
        if key in self.b1:
            self.target_t1_size = min(self.target_t1_size + max(1, len(self.b2) / len(self.b1)),
                                      self.cache_capacity)
            self.b1.move_to_end(key)
        elif key in self.b2:
            self.target_t1_size = max(self.target_t1_size - max(1, len(self.b1) / len(self.b2)), 0)
            self.b2.move_to_end(key)

    def on_store_miss(self, keys: Iterable[OffloadKey], ctx: RequestContext) -> None:
        for key in reversed(list(keys)):
            self._adapt(key)

    def touch(self, keys: Iterable[OffloadKey], ctx: RequestContext) -> None:
        for key in reversed(list(keys)):
            if key in self.t1:
                chunk = self.t1.pop(key)
                # A chunk whose write is still pending was not used twice: stay in T1 (as MRU).
                (self.t1 if not chunk.is_ready else self.t2)[key] = chunk
            elif key in self.t2:
                self.t2.move_to_end(key)
            else:
                self._adapt(key)

    def on_request_finished(self, key_groups: Sequence[Sequence[OffloadKey]], insertion_only_keys: set[OffloadKey],
                            reused_keys: set[OffloadKey], ctx: RequestContext) -> None:
        for key in reversed(order_request_keys(key_groups, ctx)):
            if key in insertion_only_keys:
                # Storing is not a reuse: refresh recency within the list it is in.
                for lst in (self.t1, self.t2):
                    if key in lst:
                        lst.move_to_end(key)
                        break
            elif key in reused_keys:
                if key in self.t1:
                    self.t2[key] = self.t1.pop(key)
                elif key in self.t2:
                    self.t2.move_to_end(key)

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        if n == 0:
            return []

        def scan(items: Iterator[tuple[OffloadKey, ChunkStatus]]):
            for key, chunk in items:
                if chunk.ref_cnt == 0 and key not in protected:
                    return key, chunk
            return None

        t1_it, t2_it = iter(list(self.t1.items())), iter(list(self.t2.items()))
        virtual_t1 = len(self.t1)
        picked: list[tuple[OffloadKey, ChunkStatus, bool]] = []
        for _ in range(n):
            got = None
            if virtual_t1 >= int(self.target_t1_size):
                e = scan(t1_it)
                if e is not None:
                    got, virtual_t1 = (*e, True), virtual_t1 - 1
            if got is None:
                e = scan(t2_it)
                if e is not None:
                    got = (*e, False)
            if got is None:
                e = scan(t1_it)
                if e is None:
                    return None
                got, virtual_t1 = (*e, True), virtual_t1 - 1
            picked.append(got)

        out = []
        for key, chunk, from_t1 in picked:
            if from_t1:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
            out.append((key, chunk))
        for ghosts in (self.b1, self.b2):
            while len(ghosts) > self.cache_capacity:
                ghosts.popitem(last=False)
        return out

    def clear(self) -> None:
        for d in (self.t1, self.t2, self.b1, self.b2):
            d.clear()
        self.target_t1_size = 0.0

    def resident_keys(self) -> list[OffloadKey]:
        return list(self.t1) + list(self.t2)

    def check_invariants(self) -> None:
        super().check_invariants()
        assert not (self.t1.keys() & self.t2.keys()), "O7: key in both T1 and T2"
        assert not ((self.t1.keys() | self.t2.keys()) & (self.b1.keys() | self.b2.keys())), \
            "O7: a resident key is also a ghost"
        assert len(self.b1) <= self.cache_capacity and len(self.b2) <= self.cache_capacity, \
            f"O7: ghost lists of {len(self.b1)} and {len(self.b2)} keys, capacity {self.cache_capacity}"
        assert 0 <= self.target_t1_size <= self.cache_capacity, \
            f"O7: target_t1_size {self.target_t1_size}, capacity {self.cache_capacity}"
