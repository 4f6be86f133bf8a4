"""check-run replays SWA bounded replay (DeepSeek-V4.1's ``SlidingWindowMLASpec(bounded_replay=True)``,
issue #28, session 20).

A session-19 recorder named ``prefix_replay`` unmodelled and check-run fell back to the run
properties from line 1, which read the replay group as an unknown spec and reported false reuses and
metrics. Now the header's group carries the spec, each step's new requests carry vLLM's
``replay_start`` (``sched.replay``), and both the replay and the properties follow: the hit a replayed
admission adopts (a window past its computed tokens), the prefix-cache stats vLLM counts on the hit
before the rewind, a window group that never caches, and where the replay starts.

Generated runs (the bounded-replay machine's startup-consistent pools, recorded from vLLM's
``Scheduler`` / ``AsyncScheduler`` through ``scheduler_cls``) agree step by step and hold every
property; the same draws on a vLLM whose ``_mark_prefix_replay`` is wrong are flagged by the replay
and by ``--properties-only`` alone.
"""

from __future__ import annotations

import gzip
import json

import pytest
from kvref.models.run_check import check_trace
from kvref.models.run_check.feature_runs import record_feature_runs

from kvref.impl.vllm.record_faults import plant_feature_fault
from tests.record.traces import flagged_runs, followed_runs, read_lines
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

SEED, EXAMPLES, STEPS = 0, 8, 30
FAULTS = ("replay-start-at-hit", "replay-window-short")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """'pristine' and each fault -> the runs of the same draws."""
    require_vllm()
    d = tmp_path_factory.mktemp("prefix-replay")
    out = {"pristine": record_feature_runs(d / "pristine", "prefix-replay", EXAMPLES, seed=SEED, steps=STEPS)}
    for fault in FAULTS:
        with plant_feature_fault(fault):
            out[fault] = record_feature_runs(d / fault, "prefix-replay", EXAMPLES, seed=SEED, steps=STEPS,
                                             strict=False)
    return out


def _replays(path) -> int:
    return sum(len(rec.get("replay") or {}) for rec in read_lines(path)[1:] if rec["t"] == "sched")


def test_bounded_replay_runs_are_replayed_step_by_step(recorded):
    def header_check(header):
        assert header["unmodelled"] == [], header["unmodelled"]
        specs = [g["spec"] for g in header["pool"]["groups"]]
        assert any(s["type"] == "SlidingWindowMLASpec" and s["bounded_replay"] for s in specs), specs

    followed = followed_runs(recorded["pristine"], header_check)
    replays = sum(_replays(run.path) for run in followed)
    # admissions rewound by the window (replay_start > 0) are in the traces, not only misses
    assert len(followed) >= 5 and replays >= 5, (len(followed), replays)


@pytest.mark.parametrize("fault", FAULTS)
def test_a_wrong_replay_is_flagged_by_the_replay_and_the_properties(recorded, fault):
    """No false green, with or without the reference: every run the fault reached diverges, and
    ``--properties-only`` (what a user on another vLLM version runs) flags each of them too."""
    def on_divergence(d):
        if fault == "replay-start-at-hit":  # the scheduled tokens are vLLM's own: only replay_start differs
            assert "replay_start" in d.message, d.table()

    flagged, props = flagged_runs(recorded[fault], kinds={"replay_start", "metrics"}, on_divergence=on_divergence)
    assert flagged >= 3 and props == flagged, (flagged, props)


def test_a_replay_without_the_window_diverges(recorded, tmp_path):
    """The replay reads the replay window from the header's group: taken away (``bounded_replay``
    false), a run with a replayed admission diverges instead of agreeing."""
    diverged = 0
    for run in recorded["pristine"]:
        if not _replays(run.path):
            continue
        with gzip.open(run.path, "rt") as f:
            header, *body = f.readlines()
        header = json.loads(header)
        for g in header["pool"]["groups"]:
            if g["spec"].get("bounded_replay"):
                g["spec"]["bounded_replay"] = False
        bad = tmp_path / run.path.name
        with gzip.open(bad, "wt") as f:
            f.write(json.dumps(header) + "\n")
            f.writelines(body)
        r = check_trace(bad)
        diverged += r.divergence is not None
    assert diverged >= 2
