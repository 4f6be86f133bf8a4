"""vLLM 0.33.0's public per-layer ``check_enough_kv_cache_memory`` / ``estimate_max_model_len``
against kvref's :mod:`kvref.spec.planning_per_layer_check` on generated layer sets (issue #22)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings

from kvref.impl.vllm.planning import VllmPlanner, kvref_per_layer_outcome
from kvref.models.strategies.planning import plan_cases
from kvref.spec import EngineConfig, FullAttentionSpec, InsufficientKVCacheError, SlidingWindowSpec
from kvref.spec.planning_per_layer_check import check_enough_kv_cache_memory_per_layer, per_layer_memory_bytes
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def planner() -> VllmPlanner:
    require_vllm()
    return VllmPlanner()


def test_generated_per_layer_checks_match_vllm(planner):
    """Same verdict, reason and estimated length on generated layers, settings and memory; the
    derandomized run reaches every verdict."""
    seen: Counter = Counter()

    @settings(max_examples=profile_examples(60, 400), derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(case=plan_cases())
    def run(case):
        theirs = planner.check_per_layer(case.layers, case.config, case.available_memory, case.kv_cache_layout)
        ours = kvref_per_layer_outcome(case.layers, case.config, case.available_memory, case.kv_cache_layout)
        assert ours.key() == theirs.key(), (ours.key(), theirs.key(), case)
        seen[ours.status if ours.status != "insufficient" else ours.detail] += 1

    run()
    assert seen["ok"] and seen["too_long"] and seen["no_memory"], seen


def test_per_layer_sum_boundary(planner):
    """5 sliding-window + 1 full layers: the layers' summed bounds plus the held-back null block
    pass, one byte less fails with vLLM's reason and estimated length."""
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float16")
    swa = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float16", sliding_window=64)
    layers = {f"l{i}": (full if i == 5 else swa) for i in range(6)}
    cfg = EngineConfig(max_model_len=4096)
    need = per_layer_memory_bytes(layers, cfg, 4096)
    page = full.page_size_bytes
    memory = need + page  # the null block held back, nothing to spare
    assert planner.check_per_layer(layers, cfg, memory).status == "ok"
    check_enough_kv_cache_memory_per_layer(layers, cfg, memory)
    theirs = planner.check_per_layer(layers, cfg, memory - 1)
    with pytest.raises(InsufficientKVCacheError) as info:
        check_enough_kv_cache_memory_per_layer(layers, cfg, memory - 1)
    assert (info.value.reason, info.value.estimated_max_model_len) == (theirs.detail, theirs.estimated_max_model_len)
    assert 0 < info.value.estimated_max_model_len < 4096
