"""Generated KV-connector runs of vLLM's own scheduler, recorded as a server would record them.

The connector machine (:mod:`kvref.models.machines.scheduler_connector`) draws a setup (pool,
scheduler, connector knobs: role, failure policy, delivery, one connector or vLLM's
``MultiConnector`` over two), arrivals with what the external store holds for each, and the fake
worker's reports (async loads finishing, late, failing as a whole or in some blocks, sync loads with
invalid blocks, sends finishing), aborts (mid-load too) and prefix-cache resets. Here its only
target is vLLM's ``Scheduler`` / ``AsyncScheduler`` built from ``kvref.record.Recording*Scheduler``
through ``scheduler_cls`` with kvref's scripted connector inside (vLLM's ``KVConnectorFactory``
builds it), so every generated run leaves a format-4 trace with the connector's answers; the
machine's drain settles every request and transfer, then the recorder shuts down.

:func:`record_connector_runs` returns the traces; ``kvref check-run`` must agree with every one of
them (tests/record/test_record_connector.py).
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RecordedRun:
    """One recorded connector run."""

    path: Path
    #: the drain met a hang vLLM 0.33.0 has itself (the machine's known_hang): the trace ends waiting
    known_hang: bool = False
    #: the generator stopped inside a step's settling (Hypothesis ran out of data after the step was
    #: taken off the batch queue): the trace schedules again with a step never settled, which no
    #: engine does and check-run rightly refuses
    lost_update: bool = False
    #: what the run's trace shows of the connector (kv entries by kind, worker reports)
    shows: Counter = field(default_factory=Counter)


def _recording_factory(env_holder: dict, directory: Path, runs: list[RecordedRun], anonymize: bool = False):
    from kvref.impl.vllm.record import recorded_vllm_scheduler
    from kvref.impl.vllm.scheduler import VllmEnv

    def build(pool, config, connector):
        if env_holder.get("env") is None:
            env_holder["env"] = VllmEnv()
        path = directory / f"connector-run-{len(runs)}.kvtrace.gz"
        saved = {k: os.environ.get(k) for k in ("KVREF_RECORD", "KVREF_RECORD_ANONYMIZE")}
        os.environ["KVREF_RECORD"] = str(path)
        os.environ["KVREF_RECORD_ANONYMIZE"] = "1" if anonymize else "0"
        try:
            target = recorded_vllm_scheduler(pool, config, env_holder["env"], connector=connector)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        runs.append(RecordedRun(path))
        return target

    return build


def record_connector_runs(directory: str | os.PathLike, examples: int, seed: int = 0, steps: int = 30,
                          setups=None, strict: bool = True, anonymize: bool = False,
                          pause: bool = False, lifecycle: bool = False, hisparse: bool = False,
                          replay: bool = False) -> list[RecordedRun]:
    """Record ``examples`` generated connector runs of vLLM's scheduler into ``directory``.

    Raises the machine's failure (an AssertionError naming it) when vLLM's run itself broke an
    invariant of the machine (a liveness failure that is not a known vLLM 0.33.0 hang) — unless not
    ``strict`` (a vLLM with a planted fault): the runs recorded up to that one are returned, it
    included. ``anonymize``: record as ``KVREF_RECORD_ANONYMIZE=1`` does (the connector's answers
    name the anonymous request ids). ``pause``: the connector machine with the pause rules
    (:func:`~kvref.models.machines.scheduler_pause._connector_pause_machine`: pause states drawn
    while requests run or wait holding KV blocks, PAUSED_NEW while loads are in flight), so the
    traces carry ``pause`` records beside the connector's answers (#28); not with ``setups`` (that
    machine draws the connector machine's own setups). ``lifecycle``: the lifecycle machine's
    arrivals and setups (:mod:`~kvref.models.machines.scheduler_lifecycle`: async consumers, stats
    on, the decode side of a P/D split -- one arrival in three carries ``kv_transfer_params``
    ``do_remote_prefill`` -- and the engine's shutdown); not with ``setups`` or ``pause``;
    ``hisparse`` (with ``lifecycle``): a HiSparse host pool, whose deferred async loads check-run
    does not replay (the recorder names them; the run properties hold). ``replay``: the
    bounded-replay connector machine's draws (:mod:`~kvref.models.machines.scheduler_replay_connector`:
    FA + a DeepSeek-V4.1 ``SlidingWindowMLASpec(bounded_replay=True)`` group, loads with and without
    the window), whose traces carry each load's ``["w", id, carries the window]`` (session 20); not
    with ``setups``, ``pause`` or ``lifecycle``.
    """
    from kvref.models.machines.scheduler import run_lockstep_machine
    from kvref.models.machines.scheduler_connector import ConnectorLockstep, connector_machine

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    runs: list[RecordedRun] = []
    holder: dict = {}
    drivers: list = []

    class Recorded(ConnectorLockstep):
        lost_update = False

        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            drivers.append(self)

        def complete(self, draw=None, report=None):
            queued = self.num_in_flight()
            pending = [len(t.scheduler._kvref_steps) for t in self.targets.values()]
            try:
                return super().complete(draw, report)
            except BaseException:
                # taken off the batch queue, never handed to the recorder's update_from_output
                if self.num_in_flight() < queued and pending == [len(t.scheduler._kvref_steps)
                                                                 for t in self.targets.values()]:
                    self.lost_update = True
                raise

    factories = {"vllm": _recording_factory(holder, directory, runs, anonymize)}
    if replay and (pause or lifecycle or setups is not None):
        from kvref.spec.errors import InvalidFieldError

        raise InvalidFieldError("replay", replay, "False with pause, lifecycle or setups (the bounded-replay "
                                "connector machine draws its own setups)")
    if lifecycle and (pause or setups is not None):
        from kvref.spec.errors import InvalidFieldError

        raise InvalidFieldError("lifecycle", lifecycle, "False with pause=True or setups (the lifecycle machine "
                                "draws its own setups)")
    if lifecycle:
        from kvref.models.machines.scheduler_lifecycle import LifecycleLockstep, lifecycle_machine

        # the recording driver with the lifecycle's worker outcomes and the engine's shutdown (not
        # its polled counts: make_stats() would reset the counters the recorder reads)
        recorded = type("RecordedLifecycle", (Recorded,), {
            "outcomes": LifecycleLockstep.outcomes, "shutdown": LifecycleLockstep.shutdown,
            "_reference_state": LifecycleLockstep._reference_state})  # None: vLLM is the only target
        machine = lifecycle_machine(factories, driver_class=recorded, hisparse=bool(hisparse))
    elif pause:
        from kvref.models.machines.scheduler_pause import PauseDriving, _connector_pause_machine

        if setups is not None:
            from kvref.spec.errors import InvalidFieldError

            raise InvalidFieldError("setups", setups, "None with pause=True (the connector pause machine draws "
                                    "its own setups)")

        class RecordedPause(PauseDriving, Recorded):
            def compare(self, what: str) -> None:
                # not the polled counts: make_stats() would reset the counters the recorder reads
                # from update_from_output's return value (the metrics endpoint's view)
                Recorded.compare(self, what)

        machine = _connector_pause_machine(factories, RecordedPause)
    elif replay:
        from kvref.models.machines.scheduler_replay_connector import ReplayConnectorMachine, replay_connector_setups

        base = connector_machine(factories, setups=replay_connector_setups(), name="RecordedReplayConnectorBase")
        # failed: ReplayConnectorMachine's teardown reads it (a divergence leaves the targets alone)
        machine = type("RecordedReplayConnectorRun", (ReplayConnectorMachine, base),
                       {"driver_class": type("RecordedReplay", (Recorded,), {"failed": False})})
    else:
        machine = connector_machine(factories, setups=setups, name="RecordedConnectorRun")
        machine.driver_class = Recorded
    base_teardown = machine.teardown

    def teardown(self):
        try:
            base_teardown(self)
        finally:
            driver = getattr(self, "driver", None)
            if driver is not None:
                for t in driver.targets.values():
                    t.close()
                if runs:
                    runs[-1].known_hang = driver.known_hang
                    runs[-1].lost_update = driver.lost_update

    machine.teardown = teardown
    # derandomize=True makes Hypothesis draw from the test's digest and ignore a forced seed (its
    # get_random_for_wrapped_test checks derandomize first), so every seed gave the same runs: the
    # seed alone fixes the draws (run_lockstep_machine forces it and keeps the constant pool empty)
    ok, failure, _ = run_lockstep_machine(machine, examples, steps=steps, min_steps=steps // 2, seed=seed,
                                          reproducible=False, shrink=False)
    if not ok and strict:
        raise AssertionError("a generated connector run failed the machine's own checks:\n" + failure)
    for run in runs:
        run.shows = trace_shows(run.path)
    return runs


def trace_shows(path) -> Counter:
    """What a trace shows of its connector: ``kv`` entries by kind (``m_async``: a lookup answered
    with an async load; ``m_none``: "ask again"), worker reports by list, error finishes, aborts of
    requests whose load was pending."""
    from kvref.impl.run_trace.reader import TraceReader

    out: Counter = Counter()
    loading: set[str] = set()
    with TraceReader(path) as reader:
        for _, rec in reader.records():
            for e in rec.get("kv") or ():
                out[e[0]] += 1
                if e[0] == "m" and e[3] is None:
                    out["m_none"] += 1
                if e[0] == "m" and e[4] and e[3]:
                    out["m_async"] += 1
                    loading.add(e[1])
                if e[0] == "m" and e[5] is not None:
                    out["multi"] += 1
                if e[0] == "f" and e[3]:
                    out["f_delay"] += 1
            for k, v in (rec.get("kvo") or {}).items():
                out["kvo_" + k] += len(v)
                if k == "r":
                    loading.difference_update(v)
            if rec["t"] == "update":
                out["fin_error"] += sum(1 for _, why in rec["fin"] if why == "error")
                stats = rec.get("stats") or {}
                out["stats_external_hits"] += bool(stats.get("ch") or stats.get("cph"))
                out["stats_connector_reset"] += bool(stats.get("creset"))
            if rec["t"] == "abort":
                out["abort_mid_load"] += sum(1 for i in rec["ids"] if i in loading)
            if rec["t"] == "reset":
                out["reset"] += 1
    return out


__all__ = ["RecordedRun", "record_connector_runs", "trace_shows"]
