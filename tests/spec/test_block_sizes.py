"""scheduler_block_size / hash_block_size resolution and the divisibility rule (vLLM PR #44165)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvref.spec import (
    CrossAttentionSpec,
    EngineConfig,
    FullAttentionSpec,
    InvalidFieldError,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
    resolve_kv_cache_block_sizes,
)


def _full(bs, **kw):
    return FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=8, dtype="float16", **kw)


def _groups(*specs):
    return tuple(KVCacheGroupSpec((f"l{i}",), s) for i, s in enumerate(specs))


def test_single_group_uses_its_block_size_times_dcp():
    assert resolve_kv_cache_block_sizes(_groups(_full(16)), EngineConfig()) == (16, 16)
    assert resolve_kv_cache_block_sizes(_groups(_full(16)), EngineConfig(dcp_world_size=4)) == (64, 64)
    assert resolve_kv_cache_block_sizes(_groups(_full(16, dcp_sharded=False)), EngineConfig(dcp_world_size=4)) == (16, 16)


def test_single_group_rejects_other_prefix_match_unit():
    with pytest.raises(InvalidFieldError) as info:
        resolve_kv_cache_block_sizes(_groups(_full(16)), EngineConfig(prefix_match_unit=8))
    assert info.value.field == "prefix_match_unit" and info.value.value == 8
    # ignored when nothing hashes
    cfg = EngineConfig(prefix_match_unit=8, enable_prefix_caching=False)
    assert resolve_kv_cache_block_sizes(_groups(_full(16)), cfg) == (16, 16)


def test_hybrid_lcm_and_gcd():
    swa = SlidingWindowSpec(block_size=24, num_kv_heads=1, head_size=8, dtype="float16", sliding_window=64)
    assert resolve_kv_cache_block_sizes(_groups(_full(16), swa), EngineConfig()) == (48, 8)
    assert resolve_kv_cache_block_sizes(_groups(_full(16), swa), EngineConfig(enable_prefix_caching=False)) == (48, 48)
    assert resolve_kv_cache_block_sizes(_groups(_full(16), swa), EngineConfig(prefix_match_unit=4)) == (48, 4)


def test_hybrid_divisibility_rule_rejects_bad_prefix_match_unit():
    with pytest.raises(InvalidFieldError, match="divisor") as info:
        resolve_kv_cache_block_sizes(_groups(_full(16), _full(32, sliding_window=None, head_size_v=4)),
                                     EngineConfig(prefix_match_unit=12))
    assert info.value.field == "prefix_match_unit"


def test_mamba_outside_align_disables_finer_hashing():
    mamba = MambaSpec(block_size=64, shapes=((2, 2),), dtypes=("float32",), mamba_cache_mode="none")
    assert resolve_kv_cache_block_sizes(_groups(_full(16), mamba), EngineConfig()) == (64, 64)
    aligned = MambaSpec(block_size=64, shapes=((2, 2),), dtypes=("float32",), mamba_cache_mode="align")
    assert resolve_kv_cache_block_sizes(_groups(_full(16), aligned), EngineConfig(mamba_cache_mode="align")) == (64, 16)


def test_cross_attention_counts_as_prefix_cacheable_like_vllm():
    cross = CrossAttentionSpec(block_size=8, num_kv_heads=1, head_size=8, dtype="float16")
    assert resolve_kv_cache_block_sizes(_groups(_full(16), cross), EngineConfig()) == (16, 8)


@given(sizes=st.lists(st.sampled_from((1, 2, 4, 8, 12, 16, 24, 32, 64)), min_size=1, max_size=4),
       pmu=st.one_of(st.none(), st.integers(1, 64)), caching=st.booleans())
def test_resolved_sizes_satisfy_the_coordinator_assertion(sizes, pmu, caching):
    groups = _groups(*[_full(bs) for bs in sizes])
    try:
        sbs, hbs = resolve_kv_cache_block_sizes(groups, EngineConfig(prefix_match_unit=pmu, enable_prefix_caching=caching))
    except InvalidFieldError as exc:
        assert exc.field == "prefix_match_unit"
        return
    assert sbs % hbs == 0 and all(sbs % bs == 0 for bs in sizes)
    assert sbs == math.lcm(*sizes) or len(sizes) == 1


def test_partial_hash_hits_with_aligned_mamba_blocks():
    from kvref.spec.block_sizes import resolve_cache_hit_alignment_tokens

    mamba = MambaSpec(block_size=64, shapes=((2, 2),), dtypes=("float32",), mamba_cache_mode="align")
    groups = _groups(_full(16), mamba)
    cfg = EngineConfig(mamba_cache_mode="align")
    sbs, hbs = resolve_kv_cache_block_sizes(groups, cfg)
    assert resolve_cache_hit_alignment_tokens(groups, cfg, sbs, hbs) == hbs == 16
    # a sliding-window group hashed coarser than the hash block has no fine-grained lookup
    swa = SlidingWindowSpec(block_size=32, num_kv_heads=1, head_size=8, dtype="float16", sliding_window=64)
    groups = _groups(_full(16), mamba, swa)
    sbs, hbs = resolve_kv_cache_block_sizes(groups, cfg)
    assert resolve_cache_hit_alignment_tokens(groups, cfg, sbs, hbs) == sbs == 64
    assert resolve_cache_hit_alignment_tokens(groups, EngineConfig(enable_prefix_caching=False), 64, 16) == 64
