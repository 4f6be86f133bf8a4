"""Block residency metrics on whole scheduler traces: vLLM's ``--kv-cache-metrics`` (#22).

With ``ObservabilityConfig.kv_cache_metrics`` vLLM's ``Scheduler.__init__`` builds its own
``KVCacheMetricsCollector`` (at ``kv_cache_metrics_sample``) and hands it to its KVCacheManager,
whose block pool reports every sampled block's allocation, prefix-cache hits and eviction;
``make_stats`` drains the eviction events into the engine's histograms. ``conform-kv-manager``
pairs the collectors on the manager alone (:mod:`kvref.models.machines.kv_metrics_pairing`); this
run has vLLM's scheduler build its collector itself and drives it with the scheduler's own
admissions, preemptions, finishes and hits, the reference scheduler's block pool carrying the
reference collector.

At ``sample_rate=1.0`` every block is followed, whatever ``random.random()`` draws, so the two
follow the same blocks. After every operation (on top of :class:`Lockstep`'s comparison of the
scheduler outputs, queues, requests and block tables) the followed blocks with the hits each
remembers are compared, and the eviction events drained from both are compared as a multiset of
their shapes (how many reuse gaps each: the times are two clocks' readings; vLLM's are checked for
consistency by :func:`~kvref.models.machines.kv_metrics_pairing.event_time_errors`).
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

from .kv_metrics_pairing import event_shape, event_time_errors, metrics_view
from .scheduler import Lockstep, SchedulerRun, _diverge, machine_with, run_lockstep_machine, scheduler_setups

COVERAGE: Counter = Counter()
"""Tallies of what the traces reached (tests assert the rare ones occur)."""


def _reference_collector(target):
    return target.kv_cache_manager.manager.block_pool.metrics_collector


class MetricsLockstep(Lockstep):
    """:class:`Lockstep` comparing the two collectors after every operation."""

    def compare(self, what: str) -> None:
        super().compare(what)
        ref = _reference_collector(self.targets["ref"])
        vllm = self.targets["vllm"].kv_metrics_collector
        ref.check_invariants()
        ref_view, vllm_view = metrics_view(ref), metrics_view(vllm)
        if ref_view != vllm_view:
            _diverge(f"after {what} (step {self.num_steps}): KV cache metrics: followed blocks and their hits "
                     f"differ\n  ref:  {ref_view}\n  vllm: {vllm_view}",
                     f"after {what}: KV cache metrics' followed blocks differ")
        ref_events, vllm_events = ref.drain_events(), vllm.drain_events()
        ref_shapes = sorted(event_shape(e) for e in ref_events)
        vllm_shapes = sorted(event_shape(e) for e in vllm_events)
        if ref_shapes != vllm_shapes:
            _diverge(f"after {what} (step {self.num_steps}): KV cache metrics: eviction events (reuse gaps each) "
                     f"differ\n  ref:  {ref_shapes}\n  vllm: {vllm_shapes}",
                     f"after {what}: KV cache metrics' eviction events differ")
        for e in vllm_events:
            errors = event_time_errors(e)
            if errors:
                raise AssertionError(f"after {what}: vLLM's eviction event {e}: " + "; ".join(errors))
        COVERAGE["followed_blocks_hit"] += sum(1 for hits in ref_view.values() if hits)
        COVERAGE["eviction_events"] += len(ref_events)
        COVERAGE["eviction_events_with_gaps"] += sum(1 for s in ref_shapes if s)


def metrics_factories(env=None) -> dict[str, Callable]:
    """``vllm``: vLLM's scheduler with ``--kv-cache-metrics`` at sample rate 1; ``ref``: the
    reference scheduler with the reference collector on its block pool."""
    from kvref.impl.reference.kv_cache_metrics import KVCacheMetricsCollector
    from kvref.impl.reference.scheduler import Scheduler
    from kvref.impl.vllm.scheduler import VllmEnv, VllmScheduler

    holder = {"env": env}

    def vllm(pool, config):
        if holder["env"] is None:
            holder["env"] = VllmEnv()
        return VllmScheduler(pool, config, holder["env"], kv_cache_metrics_sample=1.0)

    def ref(pool, config):
        sched = Scheduler(pool, config)
        sched.kv_cache_manager.manager.block_pool.metrics_collector = KVCacheMetricsCollector.seeded(1.0, 0)
        return sched

    return {"vllm": vllm, "ref": ref}


def run_kv_metrics_machine(examples: int, reproducible: bool = False, shrink: bool = True,
                           seed: int | None = None) -> SchedulerRun:
    """The scheduler machine's traces (at least 30 operations, liveness drained at teardown) with
    the collectors compared after every operation."""
    from .counted_lockstep import run_counted

    factories = metrics_factories()

    def machine_for(counting: type):
        machine = machine_with(factories, setups=scheduler_setups(), name="KVMetricsRun")
        machine.driver_class = counting
        return machine

    return SchedulerRun(**run_counted(
        machine_for, MetricsLockstep, lambda machine: run_lockstep_machine(
            machine, max(1, examples), steps=45, min_steps=31, seed=seed, reproducible=reproducible,
            shrink=shrink), COVERAGE))
