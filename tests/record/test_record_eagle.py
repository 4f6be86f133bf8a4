"""check-run replays EAGLE-like speculative decoding (issue #28): vLLM's own ``Scheduler`` /
``AsyncScheduler`` (through ``scheduler_cls``) with an EAGLE drafter's lookahead slots and trailing
hit-block drop, on a full + sliding-window pool, recorded and replayed step by step; a planted
off-by-one in the lookahead reservation is a divergence at its step and a property violation."""

from __future__ import annotations

import pytest
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


def _record(env, tmp_path, fault=None, async_scheduling=True, seed=0):
    from kvref.demo import record_demo

    path = tmp_path / f"eagle-{fault}-{async_scheduling}-{seed}.kvtrace.gz"
    return record_demo(path, "spec-decode-eagle", fault, async_scheduling, seed=seed, ticks=150, env=env)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_eagle_run_is_replayed_step_by_step_not_left_to_the_properties(env, tmp_path, async_scheduling):
    """Before: the header's ``use_eagle`` put "eagle_block_drop" in the setup's unmodelled list and
    the recorder flagged the drafter's prefill lookahead of 1, so the replay stopped at line 1; the
    properties' block checks were off ("eagle") and, once on, an async sliding-window run broke
    conservation (rejected drafts were not rolled back under the steps already in flight)."""
    for seed in (0, 1):
        run = _record(env, tmp_path, async_scheduling=async_scheduling, seed=seed)
        assert run.crashed is None
        lines = read_lines(run.path)
        header = lines[0]
        assert header["spec"]["method"] == "eagle" and header["spec"]["num_lookahead_tokens"] == 2
        assert header["pool"]["use_eagle"] is True and header["unmodelled"] == []
        assert sum(1 for rec in lines[1:] if rec.get("spec")) > 20
        assert any(rec["t"] == "drafts" for rec in lines[1:]) is not async_scheduling
        r = check_trace(run.path, check_invariants_every=1)
        assert r.ok and r.followed and r.verdict == "agrees", (r.findings, r.divergence and r.divergence.table())
        assert r.steps_compared == r.summary["steps"] > 100
        assert r.summary["block_checks"] == "on" and r.summary["prefix_hits"] > 5
        p = check_trace(run.path, properties_only=True)
        assert p.ok and p.verdict == "properties hold", p.findings


def test_a_short_lookahead_reservation_is_caught_at_its_step(env, tmp_path, capsys):
    """``short-lookahead`` (demo_faults): allocate_slots reserves one lookahead slot fewer than the
    drafter asked for. Replay names the step whose block table differs; the properties alone see the
    table that does not cover the step's tokens plus the lookahead slots."""
    run = _record(env, tmp_path, "short-lookahead", async_scheduling=False)
    r = check_trace(run.path)
    assert r.divergence is not None and r.divergence.call == "schedule" and not r.ok
    step = r.divergence.step
    assert cli.main(["check-run", run.path, "--out", str(tmp_path / "cx")]) == 1
    out = capsys.readouterr().out
    assert f"divergence at schedule of step {step}" in out and out.strip().endswith("verdict: FINDINGS")
    p = check_trace(run.path, properties_only=True)
    assert "table_too_short" in {f.kind for f in p.findings}, p.findings
    [short] = [f for f in p.findings if f.kind == "table_too_short"]
    assert short.step == step and "2 lookahead slots" in short.message


@pytest.mark.parametrize("k", [3, 4])
def test_longer_lookahead_is_replayed_and_a_short_reservation_caught(env, tmp_path, monkeypatch, k):
    """An EAGLE-like drafter (EAGLE, EAGLE3, single-module MTP) proposing k > 2 drafts: k lookahead
    slots past every step, the drafts verified and rolled back, sync and async — the replay follows
    every step with the block checks on; the lookahead reservation one short diverges and is a
    table_too_short finding by the properties alone (#28). Multi-module MTP's prefill lookahead
    (num_prefill_lookahead > 1) is still named unmodelled: the reference scheduler does not split
    prefill chunks around it."""
    from dataclasses import replace

    from kvref.demo import record_demo
    from kvref.models.run_check import demo

    monkeypatch.setitem(demo.WORKLOADS, "eagle-k", replace(demo.WORKLOADS["spec-decode-eagle"], num_speculative_tokens=k))
    for async_scheduling in (True, False):
        path = tmp_path / f"k{k}-{async_scheduling}.kvtrace.gz"
        record_demo(path, "eagle-k", None, async_scheduling, seed=1, ticks=150, env=env)
        r = check_trace(path, check_invariants_every=1)
        assert r.header["spec"]["num_speculative_tokens"] == k == r.header["spec"]["num_lookahead_tokens"]
        assert r.followed and r.divergence is None and r.num_findings == 0, (r.stopped_because, r.findings[:2])
        assert r.summary["block_checks"] == "on"
    bad = tmp_path / f"k{k}-short.kvtrace.gz"
    record_demo(bad, "eagle-k", "short-lookahead", True, seed=1, ticks=150, env=env)
    assert check_trace(bad).divergence is not None
    assert {f.kind for f in check_trace(bad, properties_only=True).findings} == {"table_too_short"}
