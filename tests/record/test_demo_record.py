"""``kvref demo record``: vLLM's own scheduler (through ``scheduler_cls``) on the demo workloads, with and
without planted faults, checked by ``check-run`` (replay) and ``--properties-only`` (issue #28, #25)."""

from __future__ import annotations

import pytest
from kvref.impl.run_trace.format import VERSION
from kvref.models.run_check import check_trace

from kvref import cli
from tests.record.traces import read_lines
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def env():
    require_vllm()
    from kvref.impl.vllm.scheduler import VllmEnv

    return VllmEnv()


def _record(env, tmp_path, workload, fault=None, async_scheduling=True, ticks=120):
    from kvref.demo import record_demo

    path = tmp_path / f"{workload}-{fault}-{async_scheduling}.kvtrace.gz"
    return record_demo(path, workload, fault, async_scheduling, ticks=ticks, env=env)


@pytest.mark.parametrize("workload, async_scheduling", [("n-burst", True), ("priority", False),
                                                       ("chunked-local", True), ("spec-decode", False),
                                                       ("spec-decode", True)])
def test_a_pristine_demo_run_agrees_with_every_observable_compared(env, tmp_path, workload, async_scheduling):
    run = _record(env, tmp_path, workload, async_scheduling=async_scheduling)
    assert run.crashed is None and run.scheduler_cls.endswith("AsyncScheduler" if async_scheduling else ".RecordingScheduler")
    lines = read_lines(run.path)
    assert lines[0]["log_stats"] is True and lines[0]["version"] == VERSION
    assert all("free" in rec for rec in lines[1:] if rec["t"] in ("sched", "update"))
    assert any(rec.get("stats", {}).get("req") for rec in lines[1:] if rec["t"] == "update")
    r = check_trace(run.path, check_invariants_every=1)
    assert r.ok and r.followed and r.verdict == "agrees", (r.findings, r.divergence and r.divergence.table())
    assert r.summary["steps"] > 50 and r.summary["block_checks"] == "on"
    if workload == "spec-decode":  # replayed, not skipped: drafts and acceptances are in the trace (#28)
        assert lines[0]["spec"]["method"] == "ngram" and lines[0]["unmodelled"] == []
        assert sum(1 for rec in lines[1:] if rec.get("spec")) > 20
        assert any(rec["t"] == "drafts" for rec in lines[1:]) is not async_scheduling


def test_a_crash_inside_schedule_is_recorded_and_never_agrees(env, tmp_path):
    """The engine's finally calls shutdown(), which writes a normal end record: before #28 the trace
    then checked as "agrees"."""
    run = _record(env, tmp_path, "multi-turn", "crash", ticks=200)
    assert run.crashed and run.crashed.startswith("ValueError: Cannot get")
    lines = read_lines(run.path)
    [err] = [rec for rec in lines[1:] if rec["t"] == "error"]
    assert err["call"] == "schedule" and err["type"] == "ValueError" and lines[-1]["t"] == "end"
    assert lines[-1]["errors"] == 1 and lines[-1]["how"] == "shutdown"
    r = check_trace(run.path)
    assert r.verdict == "CRASH" and r.crash.step == err["step"] and not r.ok
    assert "crash" in [f.kind for f in check_trace(run.path, properties_only=True).findings]


@pytest.mark.parametrize("fault, workload, kinds", [
    ("leak-on-refusal", "aborts", {"conservation"}),
    ("early-free", "sliding-window", {"conservation", "reused_while_needed"}),
    ("wrong-hit-length", "n-burst", {"wrong_hit"}),
    ("hit-stats", "priority", {"metrics"}),
])
def test_a_planted_fault_is_caught_by_replay_and_by_the_properties_alone(env, tmp_path, fault, workload, kinds):
    run = _record(env, tmp_path, workload, fault)
    r = check_trace(run.path)
    assert r.divergence is not None and not r.ok, r.verdict
    p = check_trace(run.path, properties_only=True)
    assert kinds <= {f.kind for f in p.findings}, p.findings


def test_the_demo_record_command_writes_a_trace_check_run_reads(tmp_path, capsys, env):
    out = tmp_path / "run.kvtrace.gz"
    assert cli.main(["demo", "record", str(out), "--workload", "n-burst", "--sync", "--ticks", "60"]) == 0
    text = capsys.readouterr().out
    assert "RecordingScheduler" in text and f"next: kvref check-run {out}" in text
    assert cli.main(["check-run", str(out)]) == 0
    assert capsys.readouterr().out.strip().endswith("verdict: agrees")
    assert cli.main(["demo", "record", str(out), "--workload", "nosuch"]) == 2
    assert "--workload" in capsys.readouterr().err


def test_the_campaign_counts_what_replay_and_the_properties_catch(env, capsys):
    """A slice of ``kvref demo campaign``: every crash caught, no false alarm on the pristine run."""
    from kvref.demo_campaign import run_campaign, summarize, table

    rows = run_campaign(["multi-turn"], ["crash", "hit-stats"], (True,), ticks=200)
    s = summarize(rows)
    assert s["pristine_runs"] == 1 and s["false_alarms_replay"] == s["false_alarms_properties"] == 0
    assert s["faults"]["crash"]["crashes"] == s["faults"]["crash"]["crashes_caught"] == 1
    assert s["faults"]["hit-stats"]["manifested"] == s["faults"]["hit-stats"]["properties"] == 1
    assert "| crash | 1 | 1 | 1 | 1 | 1 (1) |" in table(s)
    assert cli.main(["demo", "campaign", "--faults", "nosuch"]) == 2
    assert "--faults" in capsys.readouterr().err


@pytest.mark.parametrize("call", ["update_from_output", "add_request"])
def test_a_crash_in_any_recorded_call_is_recorded_with_its_inputs(env, tmp_path, monkeypatch, call):
    """Not only schedule(): vLLM raising in update_from_output or add_request leaves an error record
    with the call's inputs, and check-run replays that call on the reference at that point."""
    from vllm.v1.core.sched.scheduler import Scheduler

    orig = getattr(Scheduler, call)
    calls = {"n": 0}

    def failing(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 6:
            raise RuntimeError(f"planted failure in {call}")
        return orig(self, *args, **kwargs)

    monkeypatch.setattr(Scheduler, call, failing)
    run = _record(env, tmp_path, "multi-turn", ticks=60)
    assert run.crashed == f"RuntimeError: planted failure in {call}"
    [err] = [rec for rec in read_lines(run.path)[1:] if rec["t"] == "error"]
    assert err["call"] == call and ("update" in err if call == "update_from_output" else "add" in err)
    r = check_trace(run.path)
    assert r.verdict == "CRASH" and r.crash.call == call and not r.crash.reference_raised
    assert r.crash.reference.startswith("settles" if call == "update_from_output" else "accepts")
