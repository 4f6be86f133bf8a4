"""check-run replays multi-module MTP's prefill lookahead (issue #28).

A multi-module MTP drafter (``num_prefill_lookahead_tokens`` = 3 drafts) reads three prompt tokens
past every prefill chunk, so vLLM's scheduler never ends a chunk within three tokens of the prompt's
end (``_reserve_prefill_lookahead``) and its KV manager keeps the last two computed tokens
unpublished. The recorder named it unmodelled (``prefill_lookahead``) and check-run fell back to
the properties from line 1; now the header's spec carries ``num_prefill_lookahead``, the reference
scheduler cuts chunks as vLLM does (``scheduler_prefill_lookahead``) and the manager's tail follows.
The ``spec-decode-mtp`` demo workload (long prompts cut by a long-prefill threshold of 8 on a
full-attention pool) is recorded from vLLM's own ``Scheduler`` / ``AsyncScheduler`` through
``scheduler_cls``; seeded, so every profile records the same runs.
"""

from __future__ import annotations

import gzip
import json

import pytest
from kvref.models.run_check import check_trace

from kvref import cli
from tests.record.traces import read_lines
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """(sync run, async run, the chunks vLLM's _reserve_prefill_lookahead cut while recording)."""
    require_vllm()
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvref.demo import record_demo
    from kvref.impl.vllm.scheduler import VllmEnv

    env = VllmEnv()
    real = Scheduler._reserve_prefill_lookahead
    cuts = []

    def counted(self, request, num_computed_tokens, num_new_tokens):
        out = real(self, request, num_computed_tokens, num_new_tokens)
        cuts.append(out < num_new_tokens)
        return out

    d = tmp_path_factory.mktemp("mtp")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Scheduler, "_reserve_prefill_lookahead", counted)
        runs = [record_demo(d / f"mtp-{a}.kvtrace.gz", "spec-decode-mtp", None, a, seed=0, ticks=150, env=env)
                for a in (False, True)]
    return runs, sum(cuts), env


def test_multi_module_mtp_runs_are_replayed_step_by_step(recorded):
    runs, cuts, _ = recorded
    assert cuts >= 10  # vLLM cut prefill chunks short of the runway while these ran
    for run in runs:
        assert run.crashed is None
        header = read_lines(run.path)[0]
        assert header["spec"]["num_prefill_lookahead"] == 3 and header["spec"]["method"] == "mtp"
        assert header["unmodelled"] == []
        r = check_trace(run.path, check_invariants_every=1)
        assert r.followed and r.verdict == "agrees", (r.findings[:2], r.divergence and r.divergence.table())
        assert r.steps_compared == r.summary["steps"] > 100
        assert r.summary["block_checks"] == "on"
        p = check_trace(run.path, properties_only=True)
        assert p.verdict == "properties hold", p.findings[:2]


def test_a_replay_without_the_runway_diverges(recorded, tmp_path):
    """The replay reads the runway from the header: taken away, the reference ends chunks where
    vLLM did not (the replay does not silently fall back to the properties)."""
    runs, _, _ = recorded
    with gzip.open(runs[0].path, "rt") as f:
        header, *body = f.readlines()
    header = json.loads(header)
    header["spec"]["num_prefill_lookahead"] = 0
    bad = tmp_path / "no-runway.kvtrace.gz"
    with gzip.open(bad, "wt") as f:
        f.write(json.dumps(header) + "\n")
        f.writelines(body)
    r = check_trace(bad)
    assert r.divergence is not None and r.divergence.call == "schedule", r.verdict


def test_a_vllm_that_ignores_the_runway_is_found_by_replay_and_properties(recorded, tmp_path, monkeypatch, capsys):
    """vLLM's _reserve_prefill_lookahead planted away: the replay diverges at the first chunk it
    let end inside the runway, and the properties alone name that chunk (prefill_lookahead)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvref.demo import record_demo

    _, _, env = recorded
    monkeypatch.setattr(Scheduler, "_reserve_prefill_lookahead", lambda self, request, computed, new: new)
    path = tmp_path / "mtp-planted.kvtrace.gz"
    record_demo(path, "spec-decode-mtp", None, False, seed=0, ticks=150, env=env)
    r = check_trace(path)
    assert r.divergence is not None and r.divergence.call == "schedule"
    assert cli.main(["check-run", str(path), "--out", str(tmp_path / "cx")]) == 1
    assert capsys.readouterr().out.strip().endswith("verdict: FINDINGS")
    p = check_trace(path, properties_only=True)
    kinds = {f.kind for f in p.findings}
    assert "prefill_lookahead" in kinds, p.findings[:3]
    first = min(f.step for f in p.findings if f.kind == "prefill_lookahead")
    assert first == r.divergence.step
