"""Scheduler traces through the branches of vLLM's ``schedule()`` the main machine leaves
unexecuted: part of ``conform-scheduler`` (issue #22).

:class:`BranchesMachine` is :class:`~kvref.models.machines.scheduler.SchedulerMachine` on setups
that turn on what decides how much prefill a step carries
(:mod:`kvref.impl.reference.scheduler_cadence`): the local prefill cadence
(``prefill_schedule_interval`` 2-4: running chunks skipped and admissions stopped while decodes
run, the capacity escape of vLLM #44558) and the adaptive long-prefill threshold; and, on tight
PRIORITY pools, arrivals that outrank every request already running, so a later running request
that cannot grow preempts an earlier one *already scheduled in this step* (vLLM gives back its
tokens and drops its blocks from the step) or preempts itself and lets the ones after it go on.
After every operation the main machine's comparison runs (outputs, queues, request states, block
ids, free queue, KV events); at teardown the engine drains within :func:`drain_bound` times the
interval.

A separate machine (and a separate, small run) so that the main machine's rules draw nothing new:
its derandomized traces, and the tests that assert rare paths on them, stay as they are.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Callable

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from kvref.impl.reference.scheduler_cadence import adaptive_long_prefill_threshold
from kvref.impl.reference.scheduler_liveness import drain_bound
from kvref.impl.scheduler_types import PRIORITY
from kvref.models.machines.counted_lockstep import run_counted
from kvref.models.machines.scheduler import (
    COVERAGE,
    MAX_REQUESTS,
    Lockstep,
    SchedulerMachine,
    SchedulerRun,
    machine_with,
    request_specs,
    run_lockstep_machine,
    scheduler_setups,
)


class BranchesLockstep(Lockstep):
    """:class:`Lockstep` that tallies the cadence, adaptive-threshold and priority-victim paths
    (read from the reference target before each step) and drains within the cadence's bound."""

    def _reference(self):
        return self.targets.get("ref")

    def schedule(self):
        ref, snap = self._reference(), self.last_snapshot
        before = list(snap.running) if snap is not None else []
        if ref is not None:
            n = len(ref.running) + len(ref.waiting)
            threshold = self.config.long_prefill_token_threshold if n > 1 else 0
            if adaptive_long_prefill_threshold(self.config, threshold, n) > threshold:
                COVERAGE["adaptive_threshold_raised"] += 1
            if ref.cadence.interval > 1 and any(not r.is_prefill_chunk for r in ref.running):
                if ref.cadence.defer_prefills(ref.running):
                    COVERAGE["cadence_held_chunk"] += any(r.is_prefill_chunk for r in ref.running)
                    COVERAGE["cadence_held_waiting"] += bool(ref.waiting)
                elif ref.cadence.capacity_bound:
                    COVERAGE["cadence_capacity_escape"] += 1
        out = super().schedule()
        if self.config.policy == PRIORITY and len(before) > 1 and ref is not None:
            prio = {r.request_id: r.priority for r in ref.requests.values()}
            COVERAGE["priority_outranked_behind"] += any(prio.get(b, 0) < prio.get(before[0], 0) for b in before[1:])
        scheduled = {s.request_id for s in out.scheduled if s.kind == "running"}
        for rid in out.preempted_req_ids:
            if rid in before and any(r in scheduled for r in before[before.index(rid) + 1:]):
                # PRIORITY: a victim ahead of a request the loop went on to schedule (preempted by
                # a later request after it was scheduled itself, or it preempted itself and the
                # loop went on)
                COVERAGE["priority_victim_before_scheduled"] += 1
        return out

    def drain(self) -> int:
        """:meth:`Lockstep.drain` with the bound stretched by the cadence: a prefill chunk may wait
        ``interval - 1`` executed steps for its turn while decodes run."""
        live = [r for r in self.requests[next(iter(self.targets))].values() if not r.is_finished]
        interval = self.config.prefill_schedule_interval
        bound = (drain_bound(live, self.pool, self.config) + 1) * interval
        start = self.num_schedules
        while self.unfinished() or self.num_in_flight():
            if self.num_schedules - start > bound:
                snap = next(iter(self.snapshots().values()))
                raise AssertionError(
                    f"liveness: not drained within {bound} schedule calls (prefill_schedule_interval={interval}): "
                    f"waiting={snap.waiting} running={snap.running} free={snap.num_free_blocks}")
            self.engine_step()
        return self.num_schedules - start


class BranchesMachine(SchedulerMachine):
    """The scheduler machine with arrivals that outrank the running requests."""

    driver_class: type = BranchesLockstep

    @precondition(lambda self: self.num_added < MAX_REQUESTS and self.driver.config.policy == PRIORITY
                  and self.driver.last_snapshot is not None and self.driver.last_snapshot.running)
    @rule(data=st.data())
    def outranking_arrival(self, data, length: int | None = None):
        """A request better than every drawn priority (0..2) arrives while others run: admitted
        after them, it sits behind them in ``running``, so when it cannot grow the victim is a
        request the loop already scheduled in this step."""
        pool = self.driver.pool
        # short (it fits beside them), mostly one whole block: its first decode then needs a block
        short = min(pool.max_model_len - 1, pool.scheduler_block_size)
        spec = data.draw(request_specs(self.num_added, short + 1))
        if length is not None or data.draw(st.booleans()):
            n = short if length is None else length
            spec = replace(spec, prompt=(spec.prompt * n)[:n])
        self.num_added += 1
        self.driver.add(replace(spec, priority=-1 - self.num_added, max_tokens=max(spec.max_tokens, 10)))
        COVERAGE["outranking_arrivals"] += 1
        for _ in range(data.draw(st.integers(2, 12))):
            self.driver.engine_step()  # admitted behind them, both grow until the tight pool runs dry

    @precondition(lambda self: self.num_added + 2 <= MAX_REQUESTS and self.driver.config.policy == PRIORITY
                  and self.driver.last_snapshot is not None and not self.driver.last_snapshot.running
                  and not self.driver.last_snapshot.waiting)
    @rule(data=st.data())
    def priority_pair(self, data):
        """On an idle engine: a low-priority request, one step, then an outranking short one; both
        decode on the tight pool until one cannot grow. The outranking one sits second in
        ``running``, so the victim the loop picks for it is the first, already scheduled in this
        step (vLLM hands back its tokens and its step blocks), or the first cannot grow itself,
        preempts itself, and the loop goes on to the second."""
        pool = self.driver.pool
        # long: the tight pool holds it and a short one beside it, not both at full length
        long_min = max(1, pool.max_model_len - 3 * pool.scheduler_block_size)
        spec = data.draw(request_specs(self.num_added, pool.max_model_len, min_length=long_min))
        self.num_added += 1
        self.driver.add(replace(spec, priority=2, max_tokens=12))
        self.driver.engine_step()
        state = self.driver.last_snapshot.requests.get(spec.request_id)
        if state is None or spec.request_id not in self.driver.last_snapshot.running:
            return
        # the short one's length lines its block crossings up with the first's (or one step
        # ahead): when the pool has one block left at a crossing, the first takes it and the
        # second must preempt it
        bs = pool.scheduler_block_size
        n_first = len(spec.prompt) + len(state.output_token_ids) + 1 + data.draw(st.integers(-1, 0))
        length = min((n_first - 1) % bs + 1, pool.max_model_len - 1)
        self.outranking_arrival(data, length)

    @precondition(lambda self: self.num_added < MAX_REQUESTS and self.driver.config.prefill_schedule_interval > 1
                  and self.driver.last_snapshot is not None and self.driver.last_snapshot.running
                  and not self.driver.last_snapshot.waiting)
    @rule(data=st.data())
    def arrival_while_decoding(self, data):
        """Under the cadence, a prompt arrives at an empty queue while requests run: the steps
        within the interval stop the waiting loop at it (the step that drained the queue turned
        the capacity escape off), the next cadence step admits it."""
        spec = data.draw(request_specs(self.num_added, self.driver.pool.max_model_len, min_length=2))
        self.num_added += 1
        self.driver.add(spec)
        for _ in range(data.draw(st.integers(1, self.driver.config.prefill_schedule_interval + 1))):
            self.driver.engine_step()


@st.composite
def branches_setups(draw, kind: str | None = None):
    """The main machine's setups with the cadence (``kind="cadence"``: an interval of 2-4) or tight
    PRIORITY pools (``"priority"``; None: either), and the adaptive threshold drawn (a nonzero
    threshold, adaptive, in half)."""
    if kind not in (None, "cadence", "priority"):
        raise ValueError(f"kind={kind!r}: expected None, 'cadence' or 'priority'")
    choices = {"cadence": (2, 3, 4), "priority": (1,), None: (1, 1, 1, 2, 3, 4)}[kind]
    interval = draw(st.sampled_from(choices))
    if interval > 1:
        # room to admit: a tight pool or few slots leave requests waiting, which turns the cadence
        # off (the capacity escape) before it ever holds a prefill
        pool, cfg = draw(scheduler_setups(consistent=True))
        cfg = replace(cfg, max_num_seqs=max(cfg.max_num_seqs, 4))
    else:
        pool, cfg = draw(scheduler_setups(policy=PRIORITY, tight=True))
        cfg = replace(cfg, max_num_seqs=max(cfg.max_num_seqs, 2))  # two run at once: victims to pick
    adaptive = draw(st.booleans())
    threshold = cfg.long_prefill_token_threshold
    if adaptive and not threshold and cfg.enable_chunked_prefill:
        threshold = min(draw(st.sampled_from((2, 4))), pool.max_model_len)
    # cadence setups: an admission limit below the runner's slots in one of three (vLLM's
    # max_num_active_seqs); PRIORITY setups keep two or more running at once
    active = draw(st.one_of(st.none(), st.none(), st.integers(1, cfg.max_num_seqs))) if interval > 1 else None
    cfg = replace(cfg, prefill_schedule_interval=interval, long_prefill_token_threshold_adaptive=adaptive,
                  long_prefill_token_threshold=threshold, max_num_active_seqs=active)
    return pool, cfg


def run_branches_machine(examples: int, reproducible: bool = False, shrink: bool = True,
                         seed: int | None = None) -> SchedulerRun:
    """The reference scheduler in lock step with vLLM 0.33.0's on :class:`BranchesMachine` traces
    (at least 30 operations each; liveness drained at teardown): half the examples on tight
    PRIORITY pools, half on cadence setups, in two runs (each rule's precondition then holds in
    every example of its run, so the rare paths do not hang on which setups one run drew)."""
    from kvref.impl.reference.scheduler import Scheduler
    from kvref.impl.vllm.scheduler import VllmEnv, VllmScheduler

    env = VllmEnv()
    factories: dict[str, Callable] = {"vllm": lambda p, c: VllmScheduler(p, c, env),
                                      "ref": lambda p, c: Scheduler(p, c)}
    runs = []
    for kind, n in (("priority", (examples + 1) // 2), ("cadence", examples // 2)):
        base = machine_with(factories, setups=branches_setups(kind), name=f"Branches{kind.title()}Base")
        runs.append(SchedulerRun(**run_counted(
            lambda counting: type("BranchesRun", (BranchesMachine, base), {"driver_class": counting}),
            BranchesLockstep,
            lambda machine: run_lockstep_machine(machine, max(1, n), steps=45, min_steps=31, seed=seed,
                                                 reproducible=reproducible, shrink=shrink), COVERAGE)))
        if not runs[-1].ok:
            return runs[-1]
    coverage = Counter()
    for run in runs:
        coverage.update(run.coverage)
    return SchedulerRun(ok=True, traces=sum(r.traces for r in runs), ops=sum(r.ops for r in runs),
                        coverage=dict(coverage))
