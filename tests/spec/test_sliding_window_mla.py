"""``SlidingWindowMLASpec`` (vLLM 0.33.0, DeepSeek-V4.1 SWA; issue #22): the bounded-replay flag
decides prefix caching and the replay window; merging and uniform grouping follow vLLM's rules;
bad fields are named."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvref.spec.errors import InvalidFieldError, SpecMergeError
from kvref.spec.kv_cache_interface import (
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)


def _spec(**kw) -> SlidingWindowMLASpec:
    base = dict(block_size=4, num_kv_heads=1, head_size=16, dtype="float16", sliding_window=6)
    return SlidingWindowMLASpec(**{**base, **kw})


def test_bounded_replay_opts_out_of_prefix_caching_and_replays_the_window():
    plain, replay = _spec(), _spec(bounded_replay=True)
    assert plain.prefix_cacheable and plain.prefix_replay_tokens == 0
    assert not replay.prefix_cacheable and replay.prefix_replay_tokens == 6
    assert SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16",
                             sliding_window=6).prefix_replay_tokens == 0
    assert replay.manager_name == "SlidingWindowManager"
    assert replay.head_size_v == 0 and replay.page_size_bytes == 4 * 16 * 2  # one latent, no V


def test_alignment_pads_the_page():
    assert _spec(alignment=100).page_size_bytes == 200
    assert _spec(alignment=64).page_size_bytes == 128


def test_merge_needs_one_window_retention_dtype_and_replay_policy():
    s = _spec(bounded_replay=True)
    assert SlidingWindowMLASpec.merge([s, s]) == s
    for other in (replace(s, bounded_replay=False), replace(s, sliding_window=7), replace(s, cache_dtype_str="fp8"),
                  replace(s, extra_retained_tokens=1)):
        with pytest.raises(SpecMergeError):
            SlidingWindowMLASpec.merge([s, other])
    with pytest.raises(SpecMergeError):
        SlidingWindowMLASpec.merge([s, SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=8,
                                                         dtype="float16", sliding_window=6)])
    with pytest.raises(SpecMergeError):
        SlidingWindowMLASpec.merge([s, replace(s, num_kv_heads=2)])


def test_uniform_groups_keep_the_replay_policy_apart():
    s = _spec(bounded_replay=True)
    assert s.uniform_type_base() is SlidingWindowMLASpec
    assert s.is_uniform_with_collection({"a": s, "b": replace(s, head_size=32)})
    assert not s.is_uniform_with_collection({"a": s, "b": replace(s, bounded_replay=False)})
    assert not s.is_uniform_with_collection({"a": s, "b": replace(s, sliding_window=8)})
    u = UniformTypeKVCacheSpecs.from_specs({"a": s, "b": replace(s, head_size=32)})
    assert u is not None and not u.prefix_cacheable and u.prefix_replay_tokens == 6


@pytest.mark.parametrize("field, value", [
    ("bounded_replay", 1), ("bounded_replay", "yes"), ("sliding_window", 0), ("alignment", 0),
    ("extra_retained_tokens", -1),
])
def test_bad_fields_are_named(field, value):
    with pytest.raises(InvalidFieldError, match=field):
        _spec(**{field: value})

