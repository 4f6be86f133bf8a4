"""Pause states in recorded KV-connector runs (issue #28, item 4): a server with a KV connector is
paused too (``pause_generation`` for weight updates), and under PAUSED_NEW vLLM 0.33.0 still
drains ``kv_holding_waiting`` (requests whose async load finished: "the only ones admitted under
PAUSED_NEW"), so a pause record and the connector's answers meet in one format-4 trace.

The runs are the connector pause machine's (vLLM's ``Scheduler`` / ``AsyncScheduler`` built from
``kvref.record.Recording*Scheduler`` through ``scheduler_cls``, kvref's scripted connector built by
vLLM's factory, pauses drawn while requests run or wait holding KV blocks); ``kvref check-run``
must agree with every one step by step, the pause records must matter to the replay, and a vLLM
that stops draining loaded requests under PAUSED_NEW must diverge.
"""

from __future__ import annotations

from collections import Counter

import pytest
from kvref.models.run_check import check_trace
from kvref.models.run_check.connector_runs import record_connector_runs

from tests.conftest import profile_examples
from tests.record.traces import read_lines, without
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

#: seed 7 draws, under both profiles' example counts, every pause state, running requests held
#: under PAUSED_ALL, steps under PAUSED_NEW, a loaded request admitted under PAUSED_NEW and one whose
#: load failed whole admitted there too (the record_connector_runs seed alone fixes the draws)
SEED = 7


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    require_vllm()
    return record_connector_runs(tmp_path_factory.mktemp("connector-pause-runs"), profile_examples(12, 20),
                                 seed=SEED, pause=True)


def _records(path) -> list[dict]:
    return read_lines(path)[1:]


def _pause_paths(path) -> Counter:
    """What a trace shows of pauses: states set, steps under each, admissions under PAUSED_NEW."""
    seen: Counter = Counter()
    state, running = 0, False
    for rec in _records(path):
        if rec["t"] == "pause":
            state = rec["state"]
            seen[f"state_{state}"] += 1
        elif rec["t"] == "sched":
            seen["held_under_paused_all"] += state == 2 and running
            seen["scheduled_under_paused_new"] += state == 1 and bool(rec["ids"])
            for _rid, computed, *_ in rec["new"] if state == 1 else ():
                # computed > 0: its load landed; 0: its load failed whole (recompute policy), its
                # blocks were freed, and vLLM still drains it from kv_holding_waiting
                seen["loaded_admitted_under_paused_new" if computed else "failed_load_admitted_under_paused_new"] += 1
            if state != 2:
                running = bool(rec["ids"])
    return seen


def test_every_generated_connector_pause_run_agrees_with_the_reference(recorded):
    seen: Counter = Counter()
    checked = 0
    for run in recorded:
        r = check_trace(run.path, check_invariants_every=1)
        assert r.header["connector"] is not None
        assert not r.header["unmodelled"], r.header["unmodelled"]
        if r.empty:
            continue
        assert r.followed and r.divergence is None, (run.path, r.stopped_because,
                                                     r.divergence and r.divergence.table())
        assert r.crash is None and r.num_findings == 0, (run.path, r.findings[:3])
        assert r.steps_compared == r.summary["steps"]
        checked += 1
        seen += _pause_paths(run.path)
    assert checked >= len(recorded) // 2
    for path in ("state_0", "state_1", "state_2", "held_under_paused_all", "scheduled_under_paused_new",
                 "loaded_admitted_under_paused_new", "failed_load_admitted_under_paused_new"):
        assert seen[path] > 0, (path, dict(seen))


def test_a_connector_replay_without_the_pause_records_diverges(recorded, tmp_path):
    """The pause records carry what the replay needs on connector runs too."""
    diverged = 0
    for i, run in enumerate(recorded):
        recs = _records(run.path)
        if not any(rec["t"] == "pause" and rec["state"] for rec in recs):
            continue
        out = without(run.path, tmp_path / f"stripped-{i}.kvtrace.gz", "pause")
        diverged += check_trace(out).divergence is not None
    assert diverged > 0


def test_a_vllm_whose_pause_is_ignored_on_connector_runs_is_found(tmp_path, monkeypatch):
    """vLLM's ``set_pause_state`` planted away on connector runs: the replay diverges and the
    properties alone still name a step scheduled while paused (the admissions they allow under
    PAUSED_NEW are only those vLLM drains from ``kv_holding_waiting``)."""
    require_vllm()
    from vllm.v1.core.sched.scheduler import Scheduler

    monkeypatch.setattr(Scheduler, "set_pause_state", lambda self, pause_state: None)
    runs = record_connector_runs(tmp_path, profile_examples(12, 20), seed=SEED, pause=True, strict=False)
    assert any(check_trace(run.path).divergence is not None for run in runs)
    props = [check_trace(run.path, properties_only=True) for run in runs]
    assert any(f.kind == "scheduled_while_paused" for p in props for f in p.findings)


def test_a_vllm_that_holds_loaded_requests_under_paused_new_is_found(tmp_path, monkeypatch):
    """vLLM's schedule() planted to keep ``kv_holding_waiting`` back under PAUSED_NEW (a loaded
    request waits for the pause to end, as a plain new one does): the replay diverges."""
    require_vllm()
    from vllm.v1.core.sched.interface import PauseState
    from vllm.v1.core.sched.request_queue import create_request_queue
    from vllm.v1.core.sched.scheduler import Scheduler

    real = Scheduler.schedule

    def planted(self, *a, **k):
        if self.pause_state != PauseState.PAUSED_NEW:
            return real(self, *a, **k)
        held = self.kv_holding_waiting
        self.kv_holding_waiting = create_request_queue(self.policy)
        try:
            return real(self, *a, **k)
        finally:
            added, self.kv_holding_waiting = self.kv_holding_waiting, held
            for request in list(added):
                held.add_request(request)

    monkeypatch.setattr(Scheduler, "schedule", planted)
    runs = record_connector_runs(tmp_path, profile_examples(12, 20), seed=SEED, pause=True, strict=False)
    assert any(check_trace(run.path).divergence is not None for run in runs)


def test_pause_runs_draw_their_own_setups(tmp_path):
    from kvref.spec.errors import InvalidFieldError

    with pytest.raises(InvalidFieldError, match="setups"):
        record_connector_runs(tmp_path, 1, pause=True, setups=object())
