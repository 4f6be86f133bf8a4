"""check-run replays R-SWA and circular-buffer pools (issue #28, session 20).

A session-19 recorder named ``kv_cache_spec:RSWASpec`` / ``kv_cache_spec:CircularBufferSpec``
unmodelled and check-run fell back to the run properties from line 1, with the group's rules
unknown (no block checks). Now the header's spec is rebuilt (``rswa_window``; the ring's block
size) and both the replay and the properties follow: an R-SWA group frees the gap between the
prompt's last block and the decode window at each allocation, a ring group holds one block per
request, never hashed.

Generated runs (the conform-scheduler layouts machine's startup-consistent pools, recorded from
vLLM's ``Scheduler`` / ``AsyncScheduler`` through ``scheduler_cls``) agree step by step and hold
every property; the same draws on a vLLM with a planted fault in ``RSWAManager`` or
``CircularBufferManager`` are flagged by the replay and by ``--properties-only`` alone. Read as
full attention instead, the same pristine runs draw false findings (the last test): the rules are
what keeps the properties exact.
"""

from __future__ import annotations

import dataclasses

import pytest
from kvref.models.run_check import check_trace
from kvref.models.run_check.feature_runs import record_feature_runs

from kvref.impl.vllm.record_faults import plant_feature_fault
from tests.record.traces import flagged_runs, followed_runs
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

SEED, EXAMPLES, STEPS = 0, 8, 30
#: fault -> the feature whose runs it is planted in, the finding kinds --properties-only must name
FAULTS = {"rswa-gap-kept": ("rswa", {"conservation"}),
          "rswa-window-short": ("rswa", {"conservation", "reused_while_needed"}),
          "ring-grows": ("circular-buffer", {"admission_bound"})}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """'rswa' / 'circular-buffer' (pristine) and each fault -> the runs of the same draws."""
    require_vllm()
    d = tmp_path_factory.mktemp("layouts")
    out = {f: record_feature_runs(d / f, f, EXAMPLES, seed=SEED, steps=STEPS) for f in ("rswa", "circular-buffer")}
    for fault, (feature, _) in FAULTS.items():
        with plant_feature_fault(fault):
            out[fault] = record_feature_runs(d / fault, feature, EXAMPLES, seed=SEED, steps=STEPS, strict=False)
    return out


@pytest.mark.parametrize("feature,spec", [("rswa", "RSWASpec"), ("circular-buffer", "CircularBufferSpec")])
def test_layout_runs_are_replayed_step_by_step(recorded, feature, spec):
    def header_check(header):
        assert header["unmodelled"] == [], header["unmodelled"]
        assert any(g["spec"]["type"] == spec for g in header["pool"]["groups"]), header["pool"]["groups"]

    followed = len(followed_runs(recorded[feature], header_check))
    assert followed >= 5, followed


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_planted_manager_fault_is_flagged_by_the_replay_and_the_properties(recorded, fault):
    """No false green, with or without the reference: every run the fault reached diverges, and
    ``--properties-only`` (what a user on another vLLM version runs) flags each of them too."""
    flagged, props = flagged_runs(recorded[fault], kinds=FAULTS[fault][1])
    assert flagged >= 3 and props == flagged, (flagged, props)


def test_read_as_full_attention_the_pristine_runs_draw_false_findings(recorded, monkeypatch):
    """The group rules are load-bearing: with the R-SWA and ring groups read as full attention
    (what a rule-less reading would do), pristine runs report leaks, reuses or short tables."""
    from kvref.models.run_check import properties, windows

    real = windows.group_rules

    def as_full(header):
        return [dataclasses.replace(r, kind="full", bound=None, cacheable=True) if r.kind in ("rswa", "ring") else r
                for r in real(header)]

    monkeypatch.setattr(properties, "group_rules", as_full)
    false = sum(check_trace(run.path, properties_only=True).verdict == "FINDINGS"
                for feature in ("rswa", "circular-buffer") for run in recorded[feature])
    assert false >= 3, false
