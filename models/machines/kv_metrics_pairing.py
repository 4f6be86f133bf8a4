"""Block residency metrics in lock step: vLLM's ``KVCacheMetricsCollector`` on vLLM's block pool,
the reference's (:mod:`kvref.impl.reference.kv_cache_metrics`) on the reference's, the same
operations through the KV-manager machine, compared after every one (issue #22).

vLLM samples blocks with the global ``random.random()``. The pairing makes the draw the same on
both sides through the collector's public parameters: at ``sample_rate=1.0`` every block is
followed whatever the draw; below 1 the reference draws from ``random.Random(seed)`` and every
operation on vLLM runs with the global ``random`` swapped to a private stream started from the
same seed (and swapped back after, so nothing else in the process sees or perturbs it). The rate
and seed follow from the pool already drawn (no new Hypothesis draws: the machine's derandomized
traces stay as they were).

Compared after each operation: which blocks are followed and how many hits each remembers, and
the eviction events drained (how many, with how many reuse gaps each, as a multiset: vLLM
evicts a *set* of block ids); vLLM's event times must also be consistent (:func:`event_time_errors`).
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from typing import Any, Iterator

from kvref.impl.reference.kv_cache_metrics import ACCESS_HISTORY, KVCacheMetricsCollector


def metrics_view(collector) -> dict[int, int]:
    """``{block_id: hits remembered}`` of the followed blocks: what a collector (the reference's or
    vLLM's, which share the attribute names) knows beyond its clock readings."""
    return {bid: len(state.access_history) for bid, state in sorted(collector.block_metrics.items())}


def event_shape(event) -> int:
    """An eviction event without its clock readings: how many reuse gaps it reports."""
    return len(event.reuse_gaps_seconds)


def event_time_errors(event) -> list[str]:
    """What is wrong with an event's times (empty: nothing), as far as two clock readings allow:
    the idle time and the gaps are not negative, the gaps lie within the lifetime (they and the
    lifetime come from readings up to the eviction's first), at most ``ACCESS_HISTORY - 1`` gaps.

    Not checked: idle <= lifetime. vLLM reads the clock once for the lifetime and again for the
    idle time, so a block never hit reports an idle time *longer* than its life by however long
    the process waited between the two reads (microseconds, or milliseconds on a loaded machine);
    the reference reads it once (docs/differences.md)."""
    errors = []
    life, idle, gaps = event.lifetime_seconds, event.idle_seconds, tuple(event.reuse_gaps_seconds)
    if life < 0 or idle < 0:
        errors.append(f"negative lifetime {life} s or idle time {idle} s")
    if any(g < 0 for g in gaps) or sum(gaps) > life + 1e-9:
        errors.append(f"reuse gaps {gaps} not within the lifetime {life} s")
    if len(gaps) > ACCESS_HISTORY - 1:
        errors.append(f"{len(gaps)} reuse gaps (at most {ACCESS_HISTORY - 1})")
    return errors


class MetricsPairing:
    """Collectors attached to the ``reference`` and ``vllm`` managers of one harness."""

    def __init__(self, managers: dict[str, Any], num_blocks: int) -> None:
        self.sample_rate = 1.0 if num_blocks % 2 else 0.5
        seed = num_blocks
        self.reference = KVCacheMetricsCollector.seeded(self.sample_rate, seed)
        managers["reference"].manager.block_pool.metrics_collector = self.reference
        self.vllm = managers["vllm"].enable_kv_cache_metrics(self.sample_rate)
        self._vllm_random = random.Random(seed).getstate()
        self.num_events = 0
        self.num_events_with_gaps = 0
        self.max_followed = 0
        self.max_followed_hit = 0  # the most followed blocks with a hit at once

    @contextmanager
    def vllm_random(self) -> Iterator[None]:
        """Run the block with the global ``random`` on vLLM's private sampling stream."""
        outer = random.getstate()
        random.setstate(self._vllm_random)
        try:
            yield
        finally:
            self._vllm_random = random.getstate()
            random.setstate(outer)

    def compare(self) -> str | None:
        """What differs after an operation (None: nothing); drains both collectors' events."""
        self.reference.check_invariants()
        ref_view, vllm_view = metrics_view(self.reference), metrics_view(self.vllm)
        ref_events, vllm_events = self.reference.drain_events(), self.vllm.drain_events()
        self.max_followed = max(self.max_followed, len(ref_view))
        self.max_followed_hit = max(self.max_followed_hit, sum(1 for hits in ref_view.values() if hits))
        self.num_events += len(ref_events)
        self.num_events_with_gaps += sum(1 for e in ref_events if event_shape(e))
        if ref_view != vllm_view:
            return (f"KV cache metrics (sample_rate {self.sample_rate}): followed blocks and their hits "
                    f"differ\n  reference: {ref_view}\n  vllm:      {vllm_view}")
        ref_shapes = sorted(event_shape(e) for e in ref_events)
        vllm_shapes = sorted(event_shape(e) for e in vllm_events)
        if ref_shapes != vllm_shapes:
            return (f"KV cache metrics: eviction events (reuse gaps each) differ\n  reference: {ref_shapes}\n"
                    f"  vllm:      {vllm_shapes}")
        for e in vllm_events:
            errors = event_time_errors(e)
            if errors:
                return f"KV cache metrics: vLLM's eviction event {e}: " + "; ".join(errors)
        return None
