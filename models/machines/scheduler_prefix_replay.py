"""Scheduler traces on full attention + a bounded-replay sliding window (DeepSeek-V4.1 "SWA bounded
replay"): a part of ``conform-scheduler`` (issue #22).

The pools are the cache-controls machine's FA + sliding-window pools with the window group replaced
by a :class:`~kvref.spec.kv_cache_interface.SlidingWindowMLASpec` with ``bounded_replay=True``
(vLLM 0.33.0: not prefix-cacheable, ``prefix_replay_tokens = sliding_window``), windows of 1 to 4
blocks, prefix caching on, so the arrivals' shared prefixes and multi-turn follow-ups hit both
shorter and longer than the window. vLLM's ``Scheduler`` then drops hits no longer than the window
and rewinds longer ones by it (``_mark_prefix_replay``); its coordinator leaves the replay group
out of the hit search (``verify_and_split_kv_cache_groups``) and its manager never caches the
group's blocks (``SingleTypeKVCacheManager.cache_blocks``). The reference
(:mod:`kvref.impl.reference.scheduler_prefix_replay`) must do the same: scheduled tokens, block
ids per group, queues, request states and the free-block queue are compared after every step by
:class:`~kvref.models.machines.scheduler.Lockstep`, and each admitted request's ``replay_start``
is compared with vLLM's after every schedule.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Callable

from hypothesis import strategies as st

from kvref.spec.kv_cache_interface import KVCacheGroupSpec, SlidingWindowMLASpec, SlidingWindowSpec

from kvref.models.machines.counted_lockstep import run_counted
from kvref.models.machines.scheduler import (
    COVERAGE,
    SchedulerRun,
    _diverge,
    machine_with,
    run_lockstep_machine,
    scheduler_setups,
    signature,
)
from kvref.models.machines.scheduler_cache_controls import (
    CacheControlsLockstep,
    CacheControlsMachine,
    _cacheable,
    _roomy,
)

#: what the reference's replay did, summed over a run (reset by :func:`run_prefix_replay_machine`)
REPLAY_COVERAGE: Counter = Counter()


def _replay_group(group: KVCacheGroupSpec) -> KVCacheGroupSpec:
    """The window group as a bounded-replay SWA-MLA group of the same page size (one latent of
    ``head_size + head_size_v`` per token, no V)."""
    s = group.kv_cache_spec
    if not isinstance(s, SlidingWindowSpec):
        return group
    assert s.head_size_v is not None
    return replace(group, kv_cache_spec=SlidingWindowMLASpec(
        block_size=s.block_size, num_kv_heads=s.num_kv_heads, head_size=s.head_size + s.head_size_v,
        dtype=s.dtype, sliding_window=s.sliding_window, extra_retained_tokens=s.extra_retained_tokens,
        bounded_replay=True))


def prefix_replay_setups():
    """FA + bounded-replay SWA-MLA pools (window 1 to 4 blocks), prefix caching on, synchronous or
    async, FCFS or PRIORITY, as drawn (mostly tight) or roomy (finished turns stay cached until their
    follow-ups arrive)."""
    drawn = scheduler_setups(kinds=("full+swa",)).filter(_cacheable).map(
        lambda setup: (replace(setup[0], groups=tuple(_replay_group(g) for g in setup[0].groups)), setup[1]))
    return st.one_of(drawn.map(_roomy), drawn)


def compare_replay_starts(driver) -> None:
    """After a schedule: every live reference request's ``replay_start`` (vLLM's
    ``Request.replay_start``, which the workers read to bound the window's attention) equals
    vLLM's; a divergence otherwise. Nothing to compare without both targets."""
    vllm = driver.targets.get("vllm")
    if vllm is None or "ref" not in driver.targets:
        return
    theirs = vllm.scheduler.requests
    for rid, r in driver.requests["ref"].items():
        if rid in theirs and theirs[rid].replay_start != r.replay_start:
            _diverge(f"after schedule (step {driver.num_steps}): {rid}.replay_start: ref {r.replay_start} "
                     f"!= vllm {theirs[rid].replay_start}", signature("replay_start differs"))


class PrefixReplayLockstep(CacheControlsLockstep):
    """:class:`CacheControlsLockstep` that also compares ``replay_start`` (vLLM's
    ``Request.replay_start``, which the workers read to bound the window's attention) of every live
    request with vLLM's after each schedule."""

    def schedule(self):
        out = super().schedule()
        compare_replay_starts(self)
        return out


def run_prefix_replay_machine(examples: int, reproducible: bool = False, shrink: bool = True,
                              seed: int | None = None) -> SchedulerRun:
    """The reference scheduler in lock step with vLLM 0.33.0's on bounded-replay pools (traces of at
    least 30 operations; liveness drained at teardown as in the main machine). The coverage adds,
    by the reference's count of admission attempts, ``replay_admissions`` (rewound by the window),
    ``replay_hits_dropped`` (hits no longer than the window, dropped) and
    ``replay_chunks_inside_window`` (replayed admissions whose chunk ended inside the replayed
    range: no new slot asked)."""
    from kvref.impl.reference import scheduler_prefix_replay as replay_module
    from kvref.impl.reference.scheduler import Scheduler
    from kvref.impl.vllm.scheduler import VllmEnv, VllmScheduler

    env = VllmEnv()
    factories: dict[str, Callable] = {"vllm": lambda p, c: VllmScheduler(p, c, env),
                                      "ref": lambda p, c: Scheduler(p, c)}
    base = machine_with(factories, setups=prefix_replay_setups(), name="PrefixReplayBase")
    originals = (replay_module.drop_short_hit, replay_module.replay_admission, replay_module.slots_past_hit)
    drop, admission, past = originals

    def counting_drop(window, num_hit):
        dropped = drop(window, num_hit)
        REPLAY_COVERAGE["replay_hits_dropped"] += dropped
        return dropped

    def counting_admission(window, num_hit):
        a = admission(window, num_hit)
        REPLAY_COVERAGE["replay_admissions"] += a.num_replay_tokens > 0
        return a

    def counting_past(num_new_tokens, num_replay_tokens):
        n = past(num_new_tokens, num_replay_tokens)
        REPLAY_COVERAGE["replay_chunks_inside_window"] += num_replay_tokens > 0 and n == 0
        return n

    replay_module.drop_short_hit = counting_drop
    replay_module.replay_admission = counting_admission
    replay_module.slots_past_hit = counting_past
    try:
        return SchedulerRun(**run_counted(
            lambda counting: type("PrefixReplayRun", (CacheControlsMachine, base), {"driver_class": counting}),
            PrefixReplayLockstep,
            lambda machine: run_lockstep_machine(machine, examples, steps=45, min_steps=31, seed=seed,
                                                 reproducible=reproducible, shrink=shrink), COVERAGE, REPLAY_COVERAGE))
    finally:
        replay_module.drop_short_hit, replay_module.replay_admission, replay_module.slots_past_hit = originals
