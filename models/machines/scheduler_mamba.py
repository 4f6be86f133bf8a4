"""Scheduler traces on FA + Mamba "align" pools (and sparse sliding windows): the third part of ``conform-scheduler``
(issue #22).

The cache-controls run (:mod:`kvref.models.machines.scheduler_cache_controls`) draws Mamba "align"
pools three setups in seven, yet in the default run vLLM's ``Scheduler._mamba_block_aligned_split``
was never executed: Hypothesis spends a run's first examples on its simplest choices, which pick
the first branch of the setups' ``one_of`` (a Mamba pool) together with the simplest rule (an
engine step with nothing queued), and the random examples after them landed on other pools. A
probe of the seeded run counted 11 vLLM schedulers built on Mamba "align" pools, 229 ``schedule()``
calls on them, not one request added. Here every trace is a Mamba "align" pool (the Mamba block is
the attention block, or twice the hash block for fine-grained partial hits), prefix caching on,
with the cache-controls machine's rules: arrivals sharing prefixes, multi-turn follow-ups of
finished turns (the hits that reach ``MambaManager.find_longest_cache_hit`` and, on fine-grained
pools, the partial-tail caching and copy-on-write), resets, aborts, preemption. vLLM clips each
prefill chunk to Mamba state boundaries (``_mamba_block_aligned_split``); the reference's
:mod:`kvref.impl.reference.scheduler_mamba_split` must clip it the same, and every observable
(scheduled tokens, block ids per group, queues, request states, free-block queue) is compared
after every step by :class:`~kvref.models.machines.scheduler.Lockstep`.

One trace in three runs instead on an FA + sliding-window pool with a sparse
``prefix_cache_retention_interval``, where ``SlidingWindowManager.reachable_block_mask`` decides
which window tails stay cached (the other scheduler runs draw dense pools only).

``mamba_cache_mode="all"`` is not drawn: vLLM 0.33.0 refuses prefix caching with it
(``MambaManager``: "Mamba prefix caching requires mamba_cache_mode='align'"), and without caching
it schedules as "none", which the main machine's ``full+mamba`` pools cover.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from hypothesis import strategies as st

from kvref.spec.kv_cache_interface import MambaSpec

from kvref.models.machines.counted_lockstep import run_counted
from kvref.models.machines.scheduler import (
    COVERAGE,
    MAMBA_ALIGN_KINDS,
    SchedulerRun,
    machine_with,
    run_lockstep_machine,
    scheduler_setups,
)
from kvref.models.machines.scheduler_cache_controls import (
    CacheControlsLockstep,
    CacheControlsMachine,
    _cacheable,
    _roomy,
)


@st.composite
def _with_checkpoints_and_retention(draw, setup):
    """``setup`` with, half the time each, a prefill-checkpoint block on the Mamba group (the
    backend exports the prompt's boundary state from inside the final chunk, on an alignment grid
    of 1 token or one hash block: vLLM then lets that chunk run past the last block boundary) and a
    sparse ``prefix_cache_retention_interval`` (0: only replay boundaries and shared-prefix
    junctions keep a state; k scheduler blocks: one more per k-block segment), the paths of
    ``MambaManager.reachable_block_mask`` and ``_cache_partial_tail_block`` that dense pools never
    take."""
    pool, config = setup
    checkpoint = draw(st.sampled_from((None, None, 1, pool.hash_block_size)), label="mamba_checkpoint")
    groups = tuple(replace(g, kv_cache_spec=replace(g.kv_cache_spec, num_prefill_checkpoint_blocks=1,
                                                    prefill_checkpoint_alignment=checkpoint))
                   if checkpoint is not None and isinstance(g.kv_cache_spec, MambaSpec) else g for g in pool.groups)
    retention = draw(st.sampled_from((None, None, 0, 1, 2)), label="retention_blocks")
    interval = None if retention is None else retention * pool.scheduler_block_size
    return replace(pool, groups=groups, prefix_cache_retention_interval=interval), config


def mamba_align_setups():
    """FA + Mamba "align" pools (coarse or fine-grained hashes), prefix caching on, synchronous or
    async scheduling, FCFS or PRIORITY, tight or startup-sized, with or without prefill
    checkpoints and sparse retention; as drawn or roomy (cached turns then survive until their
    follow-ups arrive)."""
    drawn = st.one_of(scheduler_setups(kinds=MAMBA_ALIGN_KINDS),
                      scheduler_setups(kinds=MAMBA_ALIGN_KINDS, tight=True)).filter(_cacheable)
    drawn = drawn.flatmap(_with_checkpoints_and_retention)
    return st.one_of(drawn.map(_roomy), drawn)


def sparse_window_setups():
    """FA + sliding-window pools with prefix caching and a sparse ``prefix_cache_retention_interval``
    (0, 1, 2 or 4 scheduler blocks): ``SlidingWindowManager.reachable_block_mask`` keeps only the
    window tails a hit can use, which the main machine's dense pools never ask."""
    return (scheduler_setups(kinds=("full+swa",)).filter(_cacheable)
            .flatmap(lambda setup: st.sampled_from((0, 1, 2, 4)).map(lambda k: (replace(
                setup[0], prefix_cache_retention_interval=k * setup[0].scheduler_block_size), setup[1])))
            .map(_roomy))


class MambaLockstep(CacheControlsLockstep):
    """:class:`CacheControlsLockstep` that tallies, at its first arrival, what kind of pool the
    trace runs on (``mamba_traces``, of them ``mamba_checkpoint_traces`` with prefill checkpoints
    and ``mamba_sparse_retention_traces`` with sparse retention; ``sparse_window_traces``)."""

    def add(self, spec) -> None:
        if not self.specs:
            groups = self.pool.groups
            if any(isinstance(g.kv_cache_spec, MambaSpec) for g in groups):
                COVERAGE["mamba_traces"] += 1
                COVERAGE["mamba_checkpoint_traces"] += any(
                    getattr(g.kv_cache_spec, "num_prefill_checkpoint_blocks", 0) for g in groups)
                COVERAGE["mamba_sparse_retention_traces"] += self.pool.prefix_cache_retention_interval is not None
            else:
                COVERAGE["sparse_window_traces"] += 1
        super().add(spec)


def run_mamba_align_machine(examples: int, reproducible: bool = False, shrink: bool = True,
                            seed: int | None = None, setups=None) -> SchedulerRun:
    """The reference scheduler in lock step with vLLM 0.33.0's on Mamba "align" pools (traces of
    at least 30 operations; liveness drained at teardown as in the main machine). The coverage
    adds :class:`MambaLockstep`'s tallies and ``mamba_clipped_chunks`` (prefill chunks the split
    cut short of what the budget allowed, by the reference's count). ``setups``: another setup
    strategy (default: Mamba "align" two in three, sparse sliding windows)."""
    from kvref.impl.reference import scheduler_mamba_split as split_module
    from kvref.impl.reference.scheduler import Scheduler
    from kvref.impl.vllm.scheduler import VllmEnv, VllmScheduler

    env = VllmEnv()
    factories: dict[str, Callable] = {"vllm": lambda p, c: VllmScheduler(p, c, env),
                                      "ref": lambda p, c: Scheduler(p, c)}
    # two traces in three on Mamba "align" pools, one on sparse sliding windows
    if setups is None:
        setups = st.one_of(mamba_align_setups(), mamba_align_setups(), sparse_window_setups())
    base = machine_with(factories, setups=setups, name="MambaAlignBase")
    original = split_module.mamba_block_aligned_split

    def counting_split(config, *args, **kwargs):
        n = original(config, *args, **kwargs)
        num_new_tokens = args[3] if len(args) > 3 else kwargs["num_new_tokens"]
        COVERAGE["mamba_clipped_chunks"] += n < num_new_tokens
        return n

    split_module.mamba_block_aligned_split = counting_split
    try:
        return SchedulerRun(**run_counted(
            lambda counting: type("MambaAlignRun", (CacheControlsMachine, base), {"driver_class": counting}),
            MambaLockstep,
            lambda machine: run_lockstep_machine(machine, examples, steps=45, min_steps=31, seed=seed,
                                                 reproducible=reproducible, shrink=shrink), COVERAGE))
    finally:
        split_module.mamba_block_aligned_split = original
