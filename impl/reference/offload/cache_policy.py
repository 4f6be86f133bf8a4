"""Replacement policies of the CPU offloading manager: the common contract and the chunk status.

A policy owns *which* keys are resident and in what order they die; the manager owns ref counts,
the chunk pool and events (vLLM ``kv_offload/cpu/policies/base.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterable, Sequence

from .keys import OffloadKey, RequestContext


@dataclass
class ChunkStatus:
    """One resident chunk: ``ref_cnt == -1`` while its write is pending (not readable), ``0`` when
    ready and evictable, ``> 0`` while that many loads read it. ``chunk_id`` is its CPU slot."""

    chunk_id: int
    ref_cnt: int = -1

    @property
    def is_ready(self) -> bool:
        return self.ref_cnt >= 0


class CachePolicy(ABC):
    """Residency + eviction order. ``evict`` is all-or-nothing and never picks a protected key."""

    name: str = ""

    def __init__(self, cache_capacity: int) -> None:
        self.cache_capacity = cache_capacity

    @abstractmethod
    def get(self, key: OffloadKey) -> ChunkStatus | None: ...

    @abstractmethod
    def insert(self, key: OffloadKey, chunk: ChunkStatus, ctx: RequestContext) -> None: ...

    @abstractmethod
    def remove(self, key: OffloadKey) -> None: ...

    @abstractmethod
    def touch(self, keys: Iterable[OffloadKey], ctx: RequestContext) -> None: ...

    def on_store_miss(self, keys: Iterable[OffloadKey], ctx: RequestContext) -> None:
        """Keys offered for store that are not resident (before insertion). Default: a touch."""
        self.touch(keys, ctx)

    def on_request_access(self, keys: Iterable[OffloadKey], ctx: RequestContext) -> None:
        """First sighting of keys by a request (provisional recency). Default: nothing."""

    def on_request_finished(self, key_groups: Sequence[Sequence[OffloadKey]], insertion_only_keys: set[OffloadKey],
                            reused_keys: set[OffloadKey], ctx: RequestContext) -> None:
        """Commit one request's accesses, head-to-tail. Default: one touch per group."""
        for keys in key_groups:
            self.touch(keys, ctx)

    @abstractmethod
    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        """Remove exactly ``n`` evictable (``ref_cnt == 0``), unprotected chunks, or change nothing
        and return None."""

    @abstractmethod
    def clear(self) -> None: ...

    @abstractmethod
    def resident_keys(self) -> list[OffloadKey]: ...

    def mark_evictable(self, key: OffloadKey) -> None:
        """``ref_cnt`` became 0."""

    def mark_non_evictable(self, key: OffloadKey) -> None:
        """``ref_cnt`` left 0."""

    def check_invariants(self) -> None:
        keys = self.resident_keys()
        assert len(keys) == len(set(keys)), "O7: a key resident twice"
        assert len(keys) <= self.cache_capacity, "O7: more resident chunks than capacity"
