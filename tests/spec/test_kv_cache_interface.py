"""Spec formulas: page sizes, memory bounds, admission caps, merge and uniform-type rules."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvref.spec import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    EngineConfig,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    SpecMergeError,
    UniformTypeKVCacheSpecs,
    WindowSizeMismatchError,
    cdiv,
)

ATT = dict(block_size=16, num_kv_heads=2, head_size=64, dtype="float16")


def test_attention_page_size_is_k_plus_v():
    assert FullAttentionSpec(**ATT).page_size_bytes == 2 * 16 * 2 * 64 * 2
    assert FullAttentionSpec(**ATT, head_size_v=32).page_size_bytes == 16 * 2 * (64 + 32) * 2


def test_mla_page_is_one_latent_vector_and_alignment_pads():
    mla = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype="bfloat16")
    assert mla.page_size_bytes == 64 * 576 * 2
    packed = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype="fp8",
                              cache_dtype_str="fp8_ds_mla", state_content_bytes=656)
    assert packed.page_size_bytes == 64 * 656
    aligned = MLAAttentionSpec(block_size=1, num_kv_heads=1, head_size=576, dtype="float16", alignment=1000)
    assert aligned.page_size_bytes == 2000 and aligned.unpadded_page_size_bytes == 1152


def test_full_attention_memory_is_every_block_of_max_model_len():
    cfg = EngineConfig(max_model_len=1000)
    assert FullAttentionSpec(**ATT).max_memory_usage_blocks(cfg) == cdiv(1000, 16)
    # DCP shards token positions of sharded caches
    assert FullAttentionSpec(**ATT).max_memory_usage_blocks(EngineConfig(max_model_len=1000, dcp_world_size=4)) == cdiv(250, 16)


@pytest.mark.parametrize("batches, want", [(1, 129), (2, 193)])
def test_swa_cap_vllm_documented(batches, want):
    """vLLM's documented figure: window 1024, block 16, `batches` × 1024 tokens in flight."""
    swa = SlidingWindowSpec(**ATT, sliding_window=1024)
    assert swa.max_admission_blocks_per_request(batches * 1024, 1 << 20) == want
    cfg = EngineConfig(max_model_len=1 << 20, max_num_batched_tokens=1024, max_concurrent_batches=batches)
    assert swa.max_memory_usage_blocks(cfg) == want  # single source of truth (vLLM #40946)


def test_swa_window_mid_block_needs_the_extra_block():
    small = SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float32", sliding_window=6)
    assert small.max_admission_blocks_per_request(0, 100) == 3
    # max_model_len caps the tokens held
    assert small.max_admission_blocks_per_request(1000, 8) == cdiv(8, 4) + 1


def test_swa_extra_retained_tokens_counted():
    swa = SlidingWindowSpec(**ATT, sliding_window=1024, extra_retained_tokens=16)
    assert swa.max_admission_blocks_per_request(1024, 1 << 20) == cdiv(1023 + 16 + 1024, 16) + 1


def test_chunked_local_vllm_documented():
    cl = ChunkedLocalAttentionSpec(**ATT, attention_chunk_size=1024)
    cfg = EngineConfig(max_model_len=1 << 20, max_num_batched_tokens=1024, max_concurrent_batches=2)
    assert cl.max_memory_usage_blocks(cfg) == 192
    assert cl.max_admission_blocks_per_request(2048, 1 << 20) == 192


@given(window=st.integers(1, 5000), f=st.integers(0, 10000), m=st.integers(1, 100000), bs=st.integers(1, 64))
def test_caps_are_monotone_and_bounded_by_full_attention(window, f, m, bs):
    kw = dict(ATT, block_size=bs)
    swa = SlidingWindowSpec(**kw, sliding_window=window)
    cap = swa.max_admission_blocks_per_request(f, m)
    assert cap <= cdiv(m, bs) + 1
    assert swa.max_admission_blocks_per_request(f + 1, m) >= cap
    assert swa.max_admission_blocks_per_request(f, m + 1) >= cap
    cl = ChunkedLocalAttentionSpec(**kw, attention_chunk_size=window)
    assert cl.max_admission_blocks_per_request(f, m) <= cdiv(m, bs)


@pytest.mark.parametrize("mode, want", [("none", 1 + 2), ("all", 1 + 2), ("align", 2 + 2 + 3)])
def test_mamba_blocks_per_request_by_mode(mode, want):
    spec = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=("float32",), mamba_cache_mode=mode,
                     num_speculative_blocks=2, num_prefill_checkpoint_blocks=3)
    assert spec.page_size_bytes == 4 * 8 * 4
    cfg = EngineConfig(max_model_len=4096, mamba_cache_mode=mode)
    assert spec.max_memory_usage_blocks(cfg) == want
    width = spec.max_num_blocks_per_req(cfg, 4096)
    assert width == (cdiv(4096, 16) + 2 if mode == "align" else want)


def test_cross_attention_sized_by_encoder_budget_and_encoder_only_needs_nothing():
    cfg = EngineConfig(max_model_len=448, max_num_encoder_input_tokens=1500)
    assert CrossAttentionSpec(**ATT).max_memory_usage_blocks(cfg) == cdiv(1500, 16)
    assert EncoderOnlyAttentionSpec(**ATT).max_memory_usage_bytes(cfg) == 0


def test_full_attention_merge_takes_the_single_window():
    plain, windowed = FullAttentionSpec(**ATT), FullAttentionSpec(**ATT, sliding_window=128)
    assert FullAttentionSpec.merge([plain, windowed]).sliding_window == 128
    with pytest.raises(WindowSizeMismatchError):
        FullAttentionSpec.merge([windowed, FullAttentionSpec(**ATT, sliding_window=256)])
    with pytest.raises(SpecMergeError):
        FullAttentionSpec.merge([plain, FullAttentionSpec(**dict(ATT, num_kv_heads=4))])
    with pytest.raises(SpecMergeError):
        FullAttentionSpec.merge([plain, MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype="float16")])


def test_mla_merge_drops_alignment_keeps_padding():
    mla = MLAAttentionSpec(block_size=1, num_kv_heads=1, head_size=576, dtype="float16", alignment=1000)
    merged = MLAAttentionSpec.merge([mla, mla])
    assert merged.alignment is None and merged.page_size_bytes == mla.page_size_bytes


def test_other_specs_merge_only_when_equal():
    a = SlidingWindowSpec(**ATT, sliding_window=128)
    assert SlidingWindowSpec.merge([a, a]) == a
    with pytest.raises(SpecMergeError):
        SlidingWindowSpec.merge([a, SlidingWindowSpec(**ATT, sliding_window=256)])


def test_uniform_type_rules():
    f1, f2 = FullAttentionSpec(**ATT), FullAttentionSpec(**dict(ATT, head_size=128))
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype="float16")
    u = UniformTypeKVCacheSpecs.from_specs({"a": f1, "b": f2, "c": mla})
    assert u is not None and u.page_size_bytes == f1.page_size_bytes + f2.page_size_bytes + mla.page_size_bytes
    cfg = EngineConfig(max_model_len=100)
    assert u.max_memory_usage_bytes(cfg) == cdiv(100, 16) * u.page_size_bytes
    # different windows, block sizes or DCP sharding are not one type
    w1, w2 = SlidingWindowSpec(**ATT, sliding_window=1), SlidingWindowSpec(**ATT, sliding_window=2)
    assert UniformTypeKVCacheSpecs.from_specs({"a": w1, "b": w2}) is None
    assert UniformTypeKVCacheSpecs.from_specs({"a": f1, "b": FullAttentionSpec(**dict(ATT, block_size=32))}) is None
    assert UniformTypeKVCacheSpecs.from_specs({"a": f1, "b": FullAttentionSpec(**ATT, dcp_sharded=False)}) is None
    assert UniformTypeKVCacheSpecs.from_specs({"a": f1, "b": w1}) is None
