"""plan_kv_cache end to end: override, null block, auto-fit, check, scheduler view, PoolConfig."""

from __future__ import annotations

import pytest
from hypothesis import given

from kvref.spec import (
    EngineConfig,
    FullAttentionSpec,
    InsufficientKVCacheError,
    KVRefError,
    MambaSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    plan_kv_cache,
)
from kvref.models.strategies.planning import plan_cases

ATT = dict(block_size=16, num_kv_heads=2, head_size=64, dtype="float32")
FULL = FullAttentionSpec(**ATT)
PAGE = FULL.page_size_bytes


def test_num_blocks_is_memory_over_bytes_per_block_including_null_block():
    plan = plan_kv_cache({"l0": FULL, "l1": FULL}, EngineConfig(max_model_len=1024), 1000 * 2 * PAGE + 5)
    assert plan.bytes_per_block == 2 * PAGE and plan.num_blocks == 1000 and plan.num_usable_blocks == 999
    assert plan.blocks_per_request == (64,) and plan.max_concurrency == 1000 / 64  # null block counted, as vLLM
    plan.check_invariants()


def test_override_replaces_profiled_memory_before_the_check():
    cfg = EngineConfig(max_model_len=16384, num_gpu_blocks_override=32)
    with pytest.raises(InsufficientKVCacheError) as info:
        plan_kv_cache({"l0": FULL}, cfg, 1 << 40)
    assert info.value.estimated_max_model_len == 31 * 16  # 32 blocks minus the null block
    plan = plan_kv_cache({"l0": FULL}, EngineConfig(max_model_len=16 * 31, num_gpu_blocks_override=32), 0)
    assert plan.num_blocks == 32


def test_override_applies_before_auto_fit():
    cfg = EngineConfig(max_model_len="auto", derived_max_model_len=16384, num_gpu_blocks_override=32)
    plan = plan_kv_cache({"l0": FULL, "l1": FULL}, cfg, 1 << 40)
    assert plan.max_model_len == 31 * 16 and plan.auto_fitted and plan.num_blocks == 32


def test_exact_fit_without_null_block_is_rejected():
    with pytest.raises(InsufficientKVCacheError):
        plan_kv_cache({"l0": FULL}, EngineConfig(max_model_len=64 * 16), 64 * PAGE)
    assert plan_kv_cache({"l0": FULL}, EngineConfig(max_model_len=64 * 16), 65 * PAGE).num_blocks == 65


def test_sliding_window_groups_report_the_admission_cap():
    swa = SlidingWindowSpec(**ATT, sliding_window=1024)
    layers = {f"l{i}": (FULL if i % 6 == 5 else swa) for i in range(12)}
    plan = plan_kv_cache(layers, EngineConfig(max_model_len=32768, max_num_batched_tokens=1024), 1 << 30)
    assert plan.admission_caps == (129,) * 5 + (None,)
    assert plan.blocks_per_request == (129,) * 5 + (2048,)
    assert [g.num_padding_layers for g in plan.group_plans] == [0] * 6
    plan_async = plan_kv_cache(layers, EngineConfig(max_model_len=32768, max_num_batched_tokens=1024,
                                                    max_concurrent_batches=2), 1 << 30)
    assert plan_async.admission_caps[0] == 193


def test_uniform_type_group_is_its_first_layer_for_the_scheduler():
    other = FullAttentionSpec(**dict(ATT, head_size=128))
    plan = plan_kv_cache({"a": FULL, "b": other}, EngineConfig(max_model_len=256), 1 << 24)
    assert isinstance(plan.groups[0].kv_cache_spec, UniformTypeKVCacheSpecs)
    assert plan.scheduler_groups[0].kv_cache_spec == FULL
    assert plan.bytes_per_block == FULL.page_size_bytes + other.page_size_bytes


def test_mamba_hybrid_plan():
    mamba = MambaSpec(block_size=16, shapes=((4, 64),), dtypes=("float32",), mamba_cache_mode="align",
                      num_speculative_blocks=1)
    layers = {"m0": mamba, "m1": mamba, "m2": mamba, "f": FULL}
    plan = plan_kv_cache(layers, EngineConfig(max_model_len=1024, mamba_cache_mode="align"), 1 << 24)
    # 3 Mamba : 1 full -> groups of one layer; Mamba: 2 + 1 speculative; full: cdiv(1024, 16)
    assert plan.blocks_per_request == (3, 3, 3, 64)
    assert plan.bytes_per_block == PAGE  # the Mamba page is padded to the attention page
    assert plan.groups[0].kv_cache_spec.page_size_padded == PAGE
    plan.check_invariants()


def test_pool_config_kwargs_build_the_shared_pool_config():
    from kvref.impl.interface import PoolConfig

    plan = plan_kv_cache({"l0": FULL}, EngineConfig(max_model_len=1024), 1 << 24)
    pool = PoolConfig(**plan.pool_config_kwargs())
    assert pool.num_blocks == plan.num_blocks and pool.groups == plan.scheduler_groups
    assert pool.max_in_flight_tokens == 2048


def test_max_servable_len_reports_headroom():
    plan = plan_kv_cache({"l0": FULL}, EngineConfig(max_model_len=160, derived_max_model_len=100000), 101 * PAGE)
    assert plan.max_servable_len == 100 * 16


@given(plan_cases())
def test_generated_plans_keep_the_startup_guarantees(case):
    """Whatever kvref accepts satisfies S1/S4/S6; whatever it rejects is a clear KVRefError."""
    try:
        plan = plan_kv_cache(case.layers, case.config, case.available_memory)
    except KVRefError:
        return
    plan.check_invariants()
    assert plan.to_dict()["num_usable_blocks"] == plan.num_blocks - 1
