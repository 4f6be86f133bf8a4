"""check-run replays runs with vLLM's aux-output (routed-experts, "R3") connector (issue #28, session 20).

The connector caps every prefix hit at the blocks whose routing rows it can serve: those it retained
when their requests left and those still cached on the GPU (``max_cache_hit``). A session-19
recorder named it unmodelled and check-run fell back to the properties from line 1; the reference
models it now (:mod:`kvref.impl.reference.scheduler_aux_output`), so the header says it was on
(``scheduler.aux_output``) and the replay follows. Generated runs of the aux-output machine (a tiny
MoE model on the V2 runner, as vLLM requires; repeats of earlier prompts), recorded from vLLM's
scheduler, agree step by step; on a vLLM whose cap forgets the GPU-cached blocks, the same draws
diverge where a hit is cut short.
"""

from __future__ import annotations

import pytest
from kvref.models.run_check import check_trace
from kvref.models.run_check.feature_runs import record_feature_runs

from kvref.impl.vllm.record_faults import plant_feature_fault
from tests.record.traces import followed_runs
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

SEED, EXAMPLES, STEPS = 0, 8, 30


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    require_vllm()
    d = tmp_path_factory.mktemp("aux-output")
    pristine = record_feature_runs(d / "pristine", "aux-output", EXAMPLES, seed=SEED, steps=STEPS)
    with plant_feature_fault("aux-cap-retained-only"):
        faulty = record_feature_runs(d / "faulty", "aux-output", EXAMPLES, seed=SEED, steps=STEPS, strict=False)
    return pristine, faulty


def test_aux_output_runs_are_replayed_step_by_step(recorded):
    pristine, _ = recorded

    def header_check(header):
        assert header["unmodelled"] == [] and header["scheduler"]["aux_output"] is True, header["unmodelled"]
        assert header["scheduler"]["use_v2_model_runner"] is True

    followed = len(followed_runs(pristine, header_check))
    assert followed >= 5, followed


def test_a_cap_that_forgets_the_gpu_cached_blocks_is_flagged(recorded):
    _, faulty = recorded
    diverged = [run for run in faulty if check_trace(run.path).divergence is not None]
    assert len(diverged) >= 2, [r.path for r in faulty]
