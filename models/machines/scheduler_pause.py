"""Scheduler traces with pause states and the counts the engine polls: part of ``conform-scheduler``
(issue #22).

:class:`PauseMachine` is :class:`~kvref.models.machines.scheduler.SchedulerMachine` with a
``set_pause_state`` rule (vLLM's ``Scheduler.set_pause_state``, what the engine's
``pause_generation`` calls) drawn among the arrivals, steps and aborts. Under ``PAUSED_ALL``
vLLM schedules nothing and running requests keep their blocks; under ``PAUSED_NEW`` running
requests still grow (allocating, and preempting on the tight pools drawn here) while no waiting
request is admitted, preempted ones included. After every operation, besides the main machine's
snapshot (queues, request states, block ids, free queue), the driver compares what the engine
polls: ``get_request_counts``, ``get_num_unfinished_requests`` (pause-aware: it decides when the
engine loop idles), ``has_finished_requests``, ``get_kv_cache_usage`` and the KV-cache part of
``make_stats`` (pools built with ``log_stats``: request counts, ``kv_cache_usage``, and the
prefix-cache stats recorded at admission since the last call: requests, queries and hits, new and
preempted apart, and the reset flag).

A separate machine (and a separate, small run) so that the main machine's rules draw nothing new:
its derandomized traces, and the tests that assert rare paths on them, stay as they are.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from kvref.impl.reference.scheduler_pause import PauseState
from kvref.impl.scheduler_types import PRIORITY
from kvref.models.machines.counted_lockstep import run_counted
from kvref.models.machines.scheduler import (
    COVERAGE,
    Lockstep,
    SchedulerMachine,
    SchedulerRun,
    _diverge,
    machine_with,
    run_lockstep_machine,
    scheduler_setups,
)

#: drawn pause states: UNPAUSED as often as both pauses together, so traces leave the pause again
PAUSE_DRAWS = (PauseState.UNPAUSED, PauseState.UNPAUSED, PauseState.PAUSED_NEW, PauseState.PAUSED_ALL)


def polled(target) -> tuple:
    """What vLLM's engine core polls from its scheduler between steps."""
    return (tuple(target.get_request_counts()), target.get_num_unfinished_requests(),
            target.has_finished_requests(), target.get_kv_cache_usage(), target.make_stats())


class PauseDriving:
    """Mixed into a lock-step driver: ``set_pause_state`` sent to every target and the polled
    counts compared after every operation."""

    pause_state = PauseState.UNPAUSED

    def set_pause_state(self, state: PauseState) -> None:
        for t in self.targets.values():
            t.set_pause_state(state)
        self.pause_state = state
        self.num_steps += 1
        COVERAGE[f"pause_set_{state.name.lower()}"] += 1
        self.compare(f"set_pause_state({state.name})")

    def schedule(self):
        snap = self.last_snapshot
        out = super().schedule()
        if snap is not None and self.pause_state == PauseState.PAUSED_ALL and snap.running:
            COVERAGE["paused_all_held_running"] += 1
        if snap is not None and self.pause_state == PauseState.PAUSED_NEW:
            COVERAGE["paused_new_held_waiting"] += bool(snap.waiting)
            COVERAGE["paused_new_scheduled_running"] += bool(out.scheduled)
            COVERAGE["paused_new_preempted"] += bool(out.preempted_req_ids)
            COVERAGE["paused_new_admitted"] += any(x.kind != "running" for x in out.scheduled)  # KV-holding
        return out

    def compare(self, what: str) -> None:
        super().compare(what)
        (n0, p0), *rest = ((name, polled(t)) for name, t in self.targets.items())
        stats = p0[-1]
        if stats is not None:
            COVERAGE["stats_admissions_recorded"] += stats["prefix_cache_stats"]["requests"]
            COVERAGE["stats_preempted_recorded"] += stats["prefix_cache_stats"]["preempted_requests"]
            COVERAGE["stats_hits_recorded"] += stats["prefix_cache_stats"]["hits"] > 0
        for name, p in rest:
            if p != p0:
                _diverge(f"after {what} (step {self.num_steps}): polled counts differ (request counts, unfinished, has finished, "
                         f"kv cache usage, stats) {n0}: {p0}, {name}: {p}",
                         f"after {what}: polled counts differ")


class PauseLockstep(PauseDriving, Lockstep):
    """:class:`Lockstep` with pause states."""


class PauseMachine(SchedulerMachine):
    """The scheduler machine with pause states."""

    driver_class: type = PauseLockstep

    @rule(state=st.sampled_from(PAUSE_DRAWS))
    def set_pause_state(self, state):
        self.driver.set_pause_state(state)

    @precondition(lambda self: self.driver.last_snapshot is not None and self.driver.last_snapshot.running)
    @rule(state=st.sampled_from((PauseState.PAUSED_NEW, PauseState.PAUSED_ALL)))
    def pause_while_running(self, state):
        """A pause while requests run: what it must hold (their blocks, their growth) is there.
        Pauses drawn at any time mostly land on an idle or a waiting-only engine."""
        self.driver.set_pause_state(state)

    def teardown(self):
        driver = getattr(self, "driver", None)
        if driver is not None and driver.pause_state != PauseState.UNPAUSED:
            driver.set_pause_state(PauseState.UNPAUSED)  # the engine resumes; then the liveness drain
        super().teardown()


def pause_setups():
    """The main machine's setups, or tight PRIORITY pools (under PAUSED_NEW running requests still
    grow: on a tight pool they preempt, and the victims may not come back until the pause ends)."""
    drawn = st.one_of(scheduler_setups(), scheduler_setups(policy=PRIORITY, tight=True))
    return drawn.map(lambda setup: (replace(setup[0], log_stats=True), setup[1]))  # make_stats compared


def run_pause_machine(examples: int, reproducible: bool = False, shrink: bool = True,
                      seed: int | None = None) -> SchedulerRun:
    """The reference scheduler in lock step with vLLM 0.33.0's on :class:`PauseMachine` traces (at
    least 30 operations each; liveness drained at teardown after resuming)."""
    from kvref.impl.reference.scheduler import Scheduler
    from kvref.impl.vllm.scheduler import VllmEnv, VllmScheduler

    env = VllmEnv()
    factories: dict[str, Callable] = {"vllm": lambda p, c: VllmScheduler(p, c, env),
                                      "ref": lambda p, c: Scheduler(p, c, record_prefix_cache_stats=True)}
    base = machine_with(factories, setups=pause_setups(), name="PauseBase")
    return SchedulerRun(**run_counted(
        lambda counting: type("PauseRun", (PauseMachine, base), {"driver_class": counting}), PauseLockstep,
        lambda machine: run_lockstep_machine(machine, examples, steps=45, min_steps=31, seed=seed,
                                             reproducible=reproducible, shrink=shrink), COVERAGE))


# ---- with a KV connector: PAUSED_NEW still admits requests holding KV blocks ----------------------
def _connector_pause_machine(factories: dict[str, Callable], driver_class: type):
    """:class:`~kvref.models.machines.scheduler_connector.ConnectorMachine` with the pause rules:
    under PAUSED_NEW vLLM still drains ``kv_holding_waiting`` (async loads that finished, promoted
    loads), and ``get_num_unfinished_requests`` counts them; delayed frees keep finished requests
    in ``requests`` (``has_finished_requests``)."""
    from kvref.models.machines.scheduler_connector import ConnectorMachine, connector_machine

    class ConnectorPauseMachine(ConnectorMachine):
        @rule(state=st.sampled_from(PAUSE_DRAWS))
        def set_pause_state(self, state):
            self.driver.set_pause_state(state)

        @precondition(lambda self: self.driver.last_snapshot is not None and (
            self.driver.last_snapshot.running or self.driver.last_snapshot.kv_holding_waiting))
        @rule(state=st.sampled_from((PauseState.PAUSED_NEW, PauseState.PAUSED_ALL)))
        def pause_while_running(self, state):
            """A pause while requests run or hold KV blocks in the waiting queue."""
            if self.driver.last_snapshot.kv_holding_waiting:
                COVERAGE["paused_with_kv_holding_waiting"] += 1
            self.driver.set_pause_state(state)

        @precondition(lambda self: self.driver.last_snapshot is not None
                      and self.driver.last_snapshot.kv_holding_waiting
                      and self.driver.pause_state != PauseState.PAUSED_NEW)
        @rule()
        def pause_new_while_loading(self):
            """PAUSED_NEW while requests wait holding KV blocks (loading, or loaded): the pause
            must still let them in once their load finished, and only them."""
            self.driver.set_pause_state(PauseState.PAUSED_NEW)

        def teardown(self):
            driver = getattr(self, "driver", None)
            if driver is not None and driver.pause_state != PauseState.UNPAUSED:
                driver.set_pause_state(PauseState.UNPAUSED)
            super().teardown()

    base = connector_machine(factories, name="ConnectorPauseBase")
    return type("ConnectorPauseRun", (ConnectorPauseMachine, base), {"driver_class": driver_class})


def run_connector_pause_machine(examples: int, reproducible: bool = False, shrink: bool = True,
                                seed: int | None = None) -> SchedulerRun:
    """The reference scheduler with kvref's scripted KV connector in lock step with vLLM 0.33.0's
    (the connector built by vLLM's factory) on connector traces with pause states."""
    from kvref.models.machines.scheduler_connector import (
        CONNECTOR_COVERAGE,
        ConnectorLockstep,
        reference_factory,
        vllm_factory,
    )

    factories: dict[str, Callable] = {"vllm": vllm_factory(), "ref": reference_factory}
    driver = type("PauseConnectorLockstep", (PauseDriving, ConnectorLockstep), {})
    return SchedulerRun(**run_counted(
        lambda counting: _connector_pause_machine(factories, counting), driver,
        lambda machine: run_lockstep_machine(machine, examples, steps=40, min_steps=20, seed=seed,
                                             reproducible=reproducible, shrink=shrink),
        CONNECTOR_COVERAGE, COVERAGE, min_ops=0))
