"""Block residency metrics: vLLM 0.33.0's ``KVCacheMetricsCollector`` (``vllm/v1/core/kv_cache_metrics.py``).

With ``--kv-cache-metrics`` vLLM samples a fraction (``--kv-cache-metrics-sample``) of the blocks
the pool hands out and follows each sampled block until it is evicted: when it was allocated,
when it was last hit, the gaps between its last hits; at eviction it reports one
``KVCacheEvictionEvent`` (lifetime, idle time, reuse gaps) that the scheduler's ``make_stats``
drains into the Prometheus histograms. The pool calls the collector at four points, which the
reference :class:`~kvref.impl.reference.block_pool.BlockPool` mirrors:

* ``get_new_blocks``: every block handed out is first *evicted* (only with prefix caching on:
  vLLM calls ``on_block_evicted`` before it drops the block's hash, whether or not the block had
  one, so a sampled block reused for new data reports its life), then *allocated* (sampled with
  probability ``sample_rate``; a block sampled again restarts its life);
* ``touch`` (a prefix-cache hit): an *access* of each touched block (the null block excepted);
* ``evict_blocks`` (a connector invalidating blocks): an eviction of each block;
* a successful ``reset_prefix_cache``: every followed block and pending event is forgotten.

Sampling is the only randomness: ``sampler()`` returns a float in [0, 1), the block is followed
when it is below ``sample_rate`` (vLLM draws ``random.random()``). A conformance run injects the
same stream into both: ``sample_rate=1.0`` follows every block, whatever the draw; below 1 the
reference draws from ``random.Random(seed)`` and vLLM's global ``random`` runs on the same seed
(:mod:`kvref.models.machines.kv_metrics_pairing`).

Times are ``clock()`` nanoseconds (``time.monotonic_ns`` as in vLLM). An event reads the clock
once, so a block never hit reports an idle time equal to its lifetime (vLLM reads it twice:
docs/differences.md).
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from kvref.spec.errors import InvalidFieldError, check_int

#: hits remembered per block (vLLM bounds the history so a hot block does not grow it)
ACCESS_HISTORY = 4


@dataclass(frozen=True)
class KVCacheEvictionEvent:
    """One followed block's life, reported when it was evicted (vLLM ``KVCacheEvictionEvent``)."""

    lifetime_seconds: float
    idle_seconds: float
    reuse_gaps_seconds: tuple[float, ...]


class BlockMetricsState:
    """When one followed block was allocated and hit (vLLM ``BlockMetricsState``)."""

    def __init__(self, clock: Callable[[], int]) -> None:
        self._clock = clock
        now = clock()
        self.birth_time_ns = now
        self.last_access_ns = now
        self.access_history: deque[int] = deque(maxlen=ACCESS_HISTORY)

    def record_access(self) -> None:
        now = self._clock()
        self.last_access_ns = now
        self.access_history.append(now)

    def eviction_event(self) -> KVCacheEvictionEvent:
        now = self._clock()
        hits = list(self.access_history)
        gaps = tuple((b - a) / 1e9 for a, b in zip(hits, hits[1:]))
        return KVCacheEvictionEvent((now - self.birth_time_ns) / 1e9, (now - self.last_access_ns) / 1e9, gaps)

    def check_invariants(self) -> None:
        hits = list(self.access_history)
        assert len(hits) <= ACCESS_HISTORY, f"K1: {len(hits)} accesses kept, at most {ACCESS_HISTORY}"
        assert all(a <= b for a, b in zip(hits, hits[1:])), "K1: access history out of order"
        assert self.birth_time_ns <= self.last_access_ns, "K1: last access before the block's birth"
        assert not hits or hits[-1] == self.last_access_ns, "K1: last access is not the newest in the history"
        assert not hits or hits[0] >= self.birth_time_ns, "K1: an access before the block's birth"


class KVCacheMetricsCollector:
    """The sampled blocks' lives and the eviction events not yet drained.

    Args:
        sample_rate: the fraction of allocations followed, in (0, 1] (vLLM asserts the same range).
        sampler: floats in [0, 1), one per allocation (default: the global ``random.random``, as vLLM).
        clock: nanoseconds (default ``time.monotonic_ns``).
    """

    def __init__(self, sample_rate: float = 0.01, sampler: Callable[[], float] | None = None,
                 clock: Callable[[], int] | None = None) -> None:
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float)) or not 0 < sample_rate <= 1:
            raise InvalidFieldError("sample_rate", sample_rate, "a number in (0, 1]")
        if sampler is not None and not callable(sampler):
            raise InvalidFieldError("sampler", sampler, "None or a callable returning a float in [0, 1)")
        if clock is not None and not callable(clock):
            raise InvalidFieldError("clock", clock, "None or a callable returning nanoseconds")
        self.sample_rate = float(sample_rate)
        self._sampler = sampler or random.random
        self._clock = clock or time.monotonic_ns
        self.block_metrics: dict[int, BlockMetricsState] = {}
        self._eviction_events: list[KVCacheEvictionEvent] = []

    @classmethod
    def seeded(cls, sample_rate: float, seed: int) -> "KVCacheMetricsCollector":
        """A collector whose sampling draws from ``random.Random(seed)`` (the stream vLLM's global
        ``random`` gives after ``random.seed(seed)``)."""
        check_int("seed", seed)
        return cls(sample_rate, sampler=random.Random(seed).random)

    def should_sample_block(self) -> bool:
        return self._sampler() < self.sample_rate

    def on_block_allocated(self, block_id: int) -> None:
        if self.should_sample_block():
            self.block_metrics[block_id] = BlockMetricsState(self._clock)

    def on_block_accessed(self, block_id: int) -> None:
        state = self.block_metrics.get(block_id)
        if state is not None:
            state.record_access()

    def on_block_evicted(self, block_id: int) -> None:
        state = self.block_metrics.pop(block_id, None)
        if state is not None:
            self._eviction_events.append(state.eviction_event())

    def reset(self) -> None:
        """A prefix-cache reset forgets every followed block and every pending event."""
        self.block_metrics.clear()
        self._eviction_events.clear()

    def drain_events(self) -> list[KVCacheEvictionEvent]:
        events, self._eviction_events = self._eviction_events, []
        return events

    def check_invariants(self) -> None:
        for state in self.block_metrics.values():
            state.check_invariants()
        for e in self._eviction_events:
            assert 0 <= e.idle_seconds <= e.lifetime_seconds and all(g >= 0 for g in e.reuse_gaps_seconds), \
                f"K1: eviction event idle {e.idle_seconds}s, lifetime {e.lifetime_seconds}s, " \
                f"gaps {e.reuse_gaps_seconds}"
