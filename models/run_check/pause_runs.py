"""Generated runs of vLLM's scheduler with pause states, recorded as a server would record them.

The engine pauses its scheduler to drain it (``pause_generation``: weight updates, RL rollouts);
the recorder writes each ``set_pause_state`` as a ``pause`` record and ``kvref check-run`` replays
it on the reference (:mod:`kvref.impl.reference.scheduler_pause`). The runs are the pause machine's
(:class:`~kvref.models.machines.scheduler_pause.PauseMachine`: arrivals, steps, aborts and pause
states drawn together, pauses while requests run, tight PRIORITY pools where PAUSED_NEW running
requests preempt), with vLLM's ``Scheduler`` / ``AsyncScheduler`` built from
``kvref.record.Recording*Scheduler`` through ``scheduler_cls`` as the only target.

:func:`record_pause_runs` returns the traces; ``kvref check-run`` must agree with every one of them
(tests/record/test_record_pause.py).
"""

from __future__ import annotations

import os
from pathlib import Path

from .connector_runs import RecordedRun
from .recording import closing_targets, scheduler_recorder


def _startup_setups(kinds=None):
    """The pause machine's setups (:func:`~kvref.models.machines.scheduler_pause.pause_setups`)
    on pools vLLM's startup accepts only: the machine also draws startup-inconsistent pools (a
    request that can never fit waits at the head forever), which no engine runs, and check-run
    rightly calls that starvation."""
    from dataclasses import replace

    from hypothesis import strategies as st

    from kvref.impl.scheduler_types import PRIORITY
    from kvref.models.machines.scheduler import scheduler_setups

    more = {"kinds": tuple(kinds)} if kinds is not None else {}
    drawn = st.one_of(scheduler_setups(consistent=True, **more),
                      scheduler_setups(consistent=True, policy=PRIORITY, tight=True, **more))
    return drawn.map(lambda setup: (replace(setup[0], log_stats=True), setup[1]))


def record_pause_runs(directory: str | os.PathLike, examples: int, seed: int = 0, steps: int = 40,
                      strict: bool = True, kinds=None) -> list[RecordedRun]:
    """Record ``examples`` generated runs with pause states of vLLM's scheduler into ``directory``.

    Raises the machine's failure (an AssertionError) when vLLM's run broke one of the machine's own
    checks (liveness after the pause ends) — unless not ``strict`` (a vLLM with a planted fault):
    the runs recorded up to then are returned. The seed alone fixes the draws. ``kinds``: the pool
    kinds drawn (``kvref.models.machines.scheduler``'s, e.g. ``MAMBA_ALIGN_KINDS``), else the
    machine's default.
    """
    from kvref.models.machines.scheduler import Lockstep, machine_with, run_lockstep_machine
    from kvref.models.machines.scheduler_pause import PauseLockstep, PauseMachine

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    runs: list[RecordedRun] = []
    class Driver(PauseLockstep):
        def compare(self, what: str) -> None:
            # not the polled counts: make_stats() would reset the counters the recorder reads from
            # update_from_output's return value (the metrics endpoint's view)
            Lockstep.compare(self, what)

    base = machine_with({"vllm": scheduler_recorder({}, directory, runs, "pause")}, setups=_startup_setups(kinds),
                        name="RecordedPauseBase")
    machine = type("RecordedPauseRun", (PauseMachine, base), {"driver_class": Driver})
    machine = closing_targets(machine)
    ok, failure, _ = run_lockstep_machine(machine, examples, steps=steps, min_steps=steps // 2, seed=seed,
                                          reproducible=False, shrink=False)
    if not ok and strict:
        raise AssertionError("a generated pause run failed the machine's own checks:\n" + failure)
    return runs


__all__ = ["record_pause_runs"]
