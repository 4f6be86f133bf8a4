"""Pause states in recorded runs (issue #28): the recorder writes vLLM's ``set_pause_state`` (the
engine's ``pause_generation``) as a ``pause`` record, ``kvref check-run`` replays it on the
reference, and the properties know what a pause lets run.

Generated runs (the pause machine's draws: arrivals, steps, aborts and pause states, pauses while
requests run, tight PRIORITY pools where PAUSED_NEW running requests preempt) of vLLM's own
``Scheduler`` / ``AsyncScheduler``, recorded through ``scheduler_cls``, must agree step by step;
a vLLM whose pause is planted away is found by the replay and by ``--properties-only``.
"""

from __future__ import annotations


import pytest
from kvref.models.run_check import check_trace
from kvref.models.run_check.pause_runs import record_pause_runs

from tests.conftest import profile_examples
from tests.record.traces import read_lines, without
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    require_vllm()
    return record_pause_runs(tmp_path_factory.mktemp("pause-runs"), profile_examples(12, 20), seed=1)


def _records(path) -> list[dict]:
    return read_lines(path)[1:]


def test_every_generated_pause_run_agrees_with_the_reference(recorded):
    states = set()
    held = 0  # schedule calls under PAUSED_ALL while requests were running (they keep their blocks)
    checked = 0
    for run in recorded:
        r = check_trace(run.path, check_invariants_every=1)
        if r.empty:
            continue
        assert r.followed and r.divergence is None, (run.path, r.stopped_because, r.divergence and r.divergence.table())
        assert r.crash is None and r.num_findings == 0, (run.path, r.findings[:3])
        assert r.steps_compared == r.summary["steps"]
        checked += 1
        paused, running = 0, False
        for rec in _records(run.path):
            if rec["t"] == "pause":
                paused = rec["state"]
                states.add(paused)
            elif rec["t"] == "sched":
                held += paused == 2 and running
                running = bool(rec["ids"]) if paused != 2 else running
    assert checked >= len(recorded) // 2
    assert states == {0, 1, 2}
    assert held > 0


def test_a_replay_without_the_pause_records_diverges(recorded, tmp_path):
    """The pause records carry what the replay needs: without them some run diverges."""
    diverged = 0
    for i, run in enumerate(recorded):
        recs = _records(run.path)
        if not any(rec["t"] == "pause" and rec["state"] for rec in recs):
            continue
        out = without(run.path, tmp_path / f"stripped-{i}.kvtrace.gz", "pause")
        diverged += check_trace(out).divergence is not None
    assert diverged > 0


@pytest.mark.parametrize("fault", ["ignored", "all_as_new"])
def test_a_vllm_whose_pause_is_planted_away_is_found(tmp_path, monkeypatch, fault):
    """vLLM's ``set_pause_state`` planted to ignore the pause, or to take PAUSED_ALL for
    PAUSED_NEW (running requests go on): the replay diverges and the properties alone name a step
    scheduled while paused."""
    require_vllm()
    from vllm.v1.core.sched.interface import PauseState
    from vllm.v1.core.sched.scheduler import Scheduler

    real = Scheduler.set_pause_state

    def planted(self, pause_state):
        if fault == "ignored":
            return None
        return real(self, PauseState.PAUSED_NEW if pause_state == PauseState.PAUSED_ALL else pause_state)

    monkeypatch.setattr(Scheduler, "set_pause_state", planted)
    runs = record_pause_runs(tmp_path, profile_examples(12, 20), seed=1, strict=False)
    replay = [check_trace(run.path) for run in runs]
    props = [check_trace(run.path, properties_only=True) for run in runs]
    assert any(r.divergence is not None for r in replay)
    assert any(f.kind == "scheduled_while_paused" for p in props for f in p.findings)


def test_mamba_align_runs_are_replayed(tmp_path):
    """Mamba "align" mode (vLLM's _mamba_block_aligned_split, align-mode state blocks and hits) was
    named unmodelled and skipped from line 1; without a KV connector the reference follows it step
    by step (#28). A split planted away in vLLM diverges."""
    require_vllm()
    from kvref.models.machines.scheduler import MAMBA_ALIGN_KINDS

    runs = record_pause_runs(tmp_path / "pristine", profile_examples(8, 12), seed=2, kinds=MAMBA_ALIGN_KINDS)
    followed = 0
    for run in runs:
        r = check_trace(run.path, check_invariants_every=1)
        if r.empty:
            continue
        assert any(g["spec"].get("mamba_cache_mode") == "align" for g in r.header["pool"]["groups"])
        assert not r.header["unmodelled"], r.header["unmodelled"]
        assert r.followed and r.divergence is None and r.num_findings == 0, (run.path, r.divergence, r.findings[:2])
        followed += 1
    assert followed >= len(runs) // 2


def test_a_mamba_split_planted_away_diverges(tmp_path, monkeypatch):
    require_vllm()
    from kvref.models.machines.scheduler import MAMBA_ALIGN_KINDS
    from vllm.v1.core.sched.scheduler import Scheduler

    monkeypatch.setattr(Scheduler, "_mamba_block_aligned_split", lambda self, request, num_new_tokens, *a, **k: num_new_tokens)
    runs = record_pause_runs(tmp_path, profile_examples(8, 12), seed=2, kinds=MAMBA_ALIGN_KINDS, strict=False)
    assert any(check_trace(run.path).divergence is not None for run in runs)
