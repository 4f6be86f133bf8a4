"""check-run follows vLLM's stop conditions (issue #28): the recorder writes what ``check_stop``
reads (format 5: ``add.eos``, ``add.min``, ``add.rep`` beside ``max_tokens`` and the stop ids),
and the replay's reference decides every finish from the recorded sampled tokens, so a request
stopped at the wrong token (which request, which step, which reason, the blocks freed) diverges.

The runs are the ``stop-conditions`` demo workload: vLLM's own ``Scheduler`` / ``AsyncScheduler``
built through ``scheduler_cls``, a fake model over a 4-token output vocabulary so that EOS, a stop
id, the length caps and repetition detection (held back by ``min_tokens``) all fire. Fixed seeds
and tick counts: the same runs at every profile."""

from __future__ import annotations

from collections import Counter

import pytest

from kvref.impl.run_trace.format import VERSION
from kvref.models.run_check import check_trace
from tests.record.traces import read_lines, rewrite
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

TICKS = 150


@pytest.fixture(scope="module")
def env():
    require_vllm()
    from kvref.impl.vllm.scheduler import VllmEnv

    return VllmEnv()


def _record(env, tmp_path, fault=None, async_scheduling=True):
    from kvref.demo import record_demo

    path = tmp_path / f"stop-{fault}-{async_scheduling}.kvtrace.gz"
    run = record_demo(path, "stop-conditions", fault, async_scheduling, ticks=TICKS, env=env)
    return run, read_lines(run.path)


@pytest.fixture(scope="module")
def pristine(env, tmp_path_factory):
    """The pristine async run (recorded once: three tests compare with it)."""
    return _record(env, tmp_path_factory.mktemp("stop"))


def _reasons(lines) -> set:
    return {why for rec in lines[1:] if rec["t"] == "update" for _, why in rec["fin"]}


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_pristine_stop_conditions_run_is_replayed_with_every_finish_compared(env, pristine, tmp_path,
                                                                              async_scheduling):
    run, lines = pristine if async_scheduling else _record(env, tmp_path, async_scheduling=False)
    assert run.crashed is None and lines[0]["version"] == VERSION and lines[0]["unmodelled"] == []
    adds = [rec for rec in lines[1:] if rec["t"] == "add"]
    # every check_stop input is in the trace, and nothing names repetition detection unmodelled
    assert any(rec.get("eos") == 3 for rec in adds) and any(rec.get("eos") is None for rec in adds)
    assert any(rec.get("min", 0) > 0 for rec in adds) and any(rec.get("rep") for rec in adds)
    assert not any(rec.get("x") for rec in adds)
    assert {"stop", "length", "repetition"} <= _reasons(lines)
    r = check_trace(run.path, check_invariants_every=1)
    assert r.ok and r.followed and r.verdict == "agrees", (r.findings, r.divergence and r.divergence.table())
    assert r.summary["block_checks"] == "on" and r.summary["finished"].get("repetition", 0) > 0
    p = check_trace(run.path, properties_only=True, check_invariants_every=1)  # the stop-rule property too
    assert p.ok and p.num_findings == 0, p.findings


def test_a_replay_without_the_stop_inputs_diverges_at_a_finish(pristine, tmp_path):
    """The recorded inputs are what the replay's finishes rest on: without ``rep`` and ``min`` the
    reference lets a repetition run on (or stops one min_tokens held back)."""
    run, _ = pristine

    def strip(rec):
        if rec["t"] == "add":
            rec.pop("rep", None)
            rec.pop("min", None)
        return rec

    out = rewrite(run.path, tmp_path / "stripped.kvtrace.gz", strip)
    r = check_trace(out)
    assert not r.ok and r.divergence is not None
    assert r.divergence.call == "update_from_output" and "finishes differ" in r.divergence.message


@pytest.mark.parametrize("fault", ["min-tokens-first", "repetition-ignores-min"])
def test_a_fault_planted_in_vllms_check_stop_is_flagged_at_its_finish(env, pristine, tmp_path, fault):
    """vLLM's check_stop with its rules in a historic wrong order (min_tokens before EOS and the stop
    ids; the repetition rule ignoring min_tokens) stops requests at other tokens: the replay names
    the update whose finishes differ (exit 1), and the stop-rule property alone names a request."""
    run, lines = _record(env, tmp_path, fault)
    assert run.crashed is None and lines[1:-1] != pristine[1][1:-1]  # the fault manifested
    r = check_trace(run.path)
    assert not r.ok and r.verdict == "FINDINGS" and r.divergence is not None
    assert r.divergence.call == "update_from_output" and "finishes differ" in r.divergence.message
    p = check_trace(run.path, properties_only=True)
    assert not p.ok and any(f.kind == "stop_rule" and "request " in f.message for f in p.findings), p.findings


def test_an_anonymized_stop_conditions_run_keeps_its_stops(env, tmp_path, monkeypatch):
    """Anonymized, the EOS id and stop ids go through the same token mapping as the sampled tokens
    (equal stays equal, so repetitions stay repetitions): the replay agrees and no plain EOS id or
    stop id is left in the arrivals."""
    from kvref.impl.vllm.record import ENV_ANONYMIZE, ENV_PATH, recorded_vllm_scheduler
    from kvref.models.run_check.demo import EOS_TOKEN, DemoEngine, plan_pool, workload

    w = workload("stop-conditions")
    pool, cfg = plan_pool(w, True)
    path = tmp_path / "anon.kvtrace.gz"
    monkeypatch.setenv(ENV_PATH, str(path))
    monkeypatch.setenv(ENV_ANONYMIZE, "1")
    target = recorded_vllm_scheduler(pool, cfg, env, scheduler_cls="kvref.record.RecordingAsyncScheduler",
                                     log_stats=True)
    try:
        DemoEngine(target, pool, cfg, seed=0).serve(w, TICKS)
    finally:
        target.close()
    lines = read_lines(path)
    assert lines[0]["anonymized"] is True
    eos = {rec["eos"] for rec in lines[1:] if rec["t"] == "add" and rec.get("eos") is not None}
    assert len(eos) == 1 and eos != {EOS_TOKEN}  # one EOS id, renamed
    assert {"stop", "repetition"} <= _reasons(lines)
    r = check_trace(path, check_invariants_every=1)
    assert r.ok and r.followed and r.verdict == "agrees", r.divergence and r.divergence.table()
    assert r.summary["finished"].get("repetition", 0) > 0


@pytest.fixture(scope="module")
def generated(env, tmp_path_factory):
    """fault -> the stop machine's generated runs of vLLM's scheduler (seed 0, 8 examples: the same
    draws at every profile), recorded through scheduler_cls; None: pristine."""
    from kvref.impl.vllm.record_faults import plant_feature_fault
    from kvref.models.run_check.feature_runs import record_feature_runs

    d = tmp_path_factory.mktemp("generated-stop")
    out = {None: record_feature_runs(d / "pristine", "stop-conditions", 8, seed=0, steps=30)}
    for fault in ("min-tokens-first", "repetition-ignores-min"):
        with plant_feature_fault(fault):
            out[fault] = record_feature_runs(d / fault, "stop-conditions", 8, seed=0, steps=30, strict=False)
    return out


def test_generated_stop_runs_are_replayed_and_hold_every_property(generated):
    """StopMachine's draws (an EOS token or none, min_tokens, repetition detectors, a three-token
    model), not a hand-picked workload: every run is followed step by step and agrees, and the
    stop-rule property holds alone, over stop, length and repetition finishes."""
    reasons: Counter = Counter()
    followed = 0
    for run in generated[None]:
        r = check_trace(run.path, check_invariants_every=1)
        if r.empty:
            continue
        assert r.followed and r.verdict == "agrees", (run.path, r.stopped_because, r.divergence and r.divergence.table())
        p = check_trace(run.path, properties_only=True)
        assert p.verdict == "properties hold", (run.path, p.findings[:3])
        reasons.update(_reasons_counted(read_lines(run.path)))
        followed += 1
    assert followed >= 6 and reasons["stop"] and reasons["length"] and reasons["repetition"], reasons


@pytest.mark.parametrize("fault", ["min-tokens-first", "repetition-ignores-min"])
def test_generated_stop_runs_on_a_faulty_check_stop_are_flagged(generated, fault):
    flagged = props = 0
    for run in generated[fault]:
        r = check_trace(run.path)
        if r.empty or r.verdict == "agrees":
            continue
        assert r.divergence is not None and "finishes differ" in r.divergence.message, r.verdict
        flagged += 1
        p = check_trace(run.path, properties_only=True)
        props += any(f.kind == "stop_rule" for f in p.findings)
    assert flagged >= 1 and props == flagged, (flagged, props)


def _reasons_counted(lines) -> Counter:
    return Counter(why for rec in lines[1:] if rec["t"] == "update" for _, why in rec["fin"])
