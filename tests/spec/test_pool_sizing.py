"""Bytes per block, needed memory, the enough-memory check, auto-fit and max concurrency."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvref.spec import (
    EngineConfig,
    FullAttentionSpec,
    InsufficientKVCacheError,
    KVCacheGroupSpec,
    SlidingWindowSpec,
    cdiv,
    get_kv_cache_groups,
)
from kvref.spec.pool_sizing import (
    auto_fit_max_model_len,
    check_enough_kv_cache_memory,
    estimate_max_model_len,
    max_concurrency,
    needed_bytes_for,
    pool_bytes_per_block,
)

ATT = dict(block_size=16, num_kv_heads=2, head_size=64, dtype="float32")
FULL = FullAttentionSpec(**ATT)
PAGE = FULL.page_size_bytes


def test_bytes_per_block_is_widest_group_of_pages():
    swa = SlidingWindowSpec(**ATT, sliding_window=64)
    groups = get_kv_cache_groups({"f0": FULL, "f1": FULL, "s0": swa, "s1": swa, "s2": swa})
    assert pool_bytes_per_block(groups) == 2 * PAGE  # group size 2; the short SWA group is padded


def test_needed_bytes_charges_padding_per_block_id():
    swa = SlidingWindowSpec(**ATT, sliding_window=64)
    groups = get_kv_cache_groups({"f0": FULL, "f1": FULL, "s0": swa, "s1": swa, "s2": swa})
    cfg = EngineConfig(max_model_len=160, max_num_batched_tokens=16)
    cap = swa.max_admission_blocks_per_request(16, 160)
    assert needed_bytes_for(groups, cfg, 160) == 2 * PAGE * (cdiv(160, 16) + 2 * cap)


def test_vllm_documented_concurrency_full_attention():
    """32 full-attention layers, block 16, max_model_len 16384, 1536 blocks → 1.5 (vLLM test)."""
    group = KVCacheGroupSpec(tuple(f"l{i}" for i in range(32)), FULL)
    assert max_concurrency((group,), EngineConfig(max_model_len=16384), 16384, 1536) == 1.5


def test_vllm_documented_concurrency_sliding_window():
    """Window 1024, one batch of 1024 → 129 blocks per request; 387 blocks → 3.0 (vLLM test)."""
    swa = SlidingWindowSpec(**ATT, sliding_window=1024)
    cfg = EngineConfig(max_model_len=16384, max_num_batched_tokens=1024)
    assert swa.max_memory_usage_blocks(cfg) == 129
    assert max_concurrency((KVCacheGroupSpec(("s",), swa),), cfg, 16384, 387) == 3.0


def test_auto_fit_with_exactly_64_blocks_gives_63_blocks_of_tokens():
    groups = (KVCacheGroupSpec(("l0", "l1"), FULL),)
    bpb = pool_bytes_per_block(groups)
    cfg = EngineConfig(max_model_len="auto", derived_max_model_len=16384)
    assert auto_fit_max_model_len(groups, cfg, 64 * bpb - bpb, 16384) == 63 * 16
    # the model's own maximum is never exceeded
    assert auto_fit_max_model_len(groups, cfg, 10_000 * bpb, 100) == 100


def test_auto_fit_fails_without_one_token():
    groups = (KVCacheGroupSpec(("l0",), FULL),)
    with pytest.raises(InsufficientKVCacheError, match="Cannot auto-fit") as info:
        auto_fit_max_model_len(groups, EngineConfig(max_model_len="auto"), PAGE - 1, 8192)
    assert info.value.reason == InsufficientKVCacheError.AUTO_FIT_FAILED


def test_check_rejects_with_estimate_and_vllm_text():
    groups = (KVCacheGroupSpec(("l0",), FULL),)
    with pytest.raises(InsufficientKVCacheError) as info:
        check_enough_kv_cache_memory(groups, EngineConfig(), 10 * PAGE, 16 * 11)
    err = info.value
    assert isinstance(err, ValueError) and err.estimated_max_model_len == 160
    assert "estimated maximum model length is 160" in str(err) and "max seq len (176)" in str(err)
    assert "11 blocks" in str(err)
    with pytest.raises(InsufficientKVCacheError, match="No available memory") as info:
        check_enough_kv_cache_memory(groups, EngineConfig(), 0, 16)
    assert info.value.reason == InsufficientKVCacheError.NO_MEMORY


@given(m=st.integers(1, 5000), blocks=st.integers(0, 400), window=st.integers(1, 3000))
def test_estimate_is_the_largest_fitting_length(m, blocks, window):
    swa = SlidingWindowSpec(**ATT, sliding_window=window)
    groups = get_kv_cache_groups({"f": FULL, "s": swa})
    cfg = EngineConfig(max_model_len=m, max_num_batched_tokens=64)
    memory = blocks * pool_bytes_per_block(groups)
    est = estimate_max_model_len(groups, cfg, memory, m)
    if est:
        assert needed_bytes_for(groups, cfg, est) <= memory
    if est < m:
        assert needed_bytes_for(groups, cfg, est + 1) > memory
