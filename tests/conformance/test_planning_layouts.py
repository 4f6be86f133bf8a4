"""Block-outermost KV cache layouts (``VLLM_KV_CACHE_LAYOUT``): kvref's packed grouping and layout
checks against vLLM 0.33.0's ``_get_packed_kv_cache_groups`` / ``validate_kv_cache_layout`` /
``compute_layout_strides`` on generated layer sets (issue #22)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings

from kvref.impl.vllm.planning import VllmPlanner, kvref_outcome
from kvref.models.strategies.planning import plan_cases
from kvref.spec import EngineConfig, FullAttentionSpec, InvalidFieldError, SlidingWindowSpec, plan_kv_cache
from kvref.spec.planning_packed import approximate_gcd, get_packed_kv_cache_groups
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def planner() -> VllmPlanner:
    require_vllm()
    return VllmPlanner()


def _agree(planner, layers, config, memory, layout):
    theirs = planner.plan(layers, config, memory, 0, layout)
    ours = kvref_outcome(planner, layers, config, memory, layout)
    assert ours.key() == theirs.key(), (ours.key(), theirs.key(), layout, layers)
    for name, want in theirs.fields.items():
        assert ours.fields[name] == want, (name, ours.fields[name], want)
    return ours


def test_generated_packed_layer_sets_match_vllm(planner):
    """Repeating patterns of mixed page sizes, mostly under BLHNC/BLNHC: same verdict and plan; the
    run must reach multi-group packed plans and rejections (derandomized: a fixed draw)."""
    seen: Counter = Counter()

    @settings(max_examples=profile_examples(40, 300), derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(case=plan_cases("packed"))
    def run(case):
        theirs = planner.plan(case.layers, case.config, case.available_memory, case.extra_retained_tokens,
                              case.kv_cache_layout)
        ours = kvref_outcome(planner, case.layers, case.config, case.available_memory, case.kv_cache_layout)
        assert ours.key() == theirs.key(), (ours.key(), theirs.key(), case)
        for name, want in theirs.fields.items():
            assert ours.fields[name] == want, (name, ours.fields[name], want, case)
        groups = ours.fields.get("groups", ())
        if len(groups) > 1 and any(hasattr(spec, "kv_cache_specs")  # vLLM's UniformTypeKVCacheSpecs
                                   and len({s.page_size_bytes for s in spec.kv_cache_specs.values()}) > 1
                                   for _, spec in groups):
            seen["packed_multi_group"] += 1  # several groups, one with pages of different sizes
        seen[(ours.status, ours.detail)] += 1

    run()
    assert seen["packed_multi_group"] > 0 and seen[("insufficient", "too_long")] > 0, seen


def test_two_head_sizes_pack_into_repeat_groups(planner):
    """Full attention with 2 and 8 heads next to sliding window, 4 repeats: vLLM packs each page size
    pattern into groups instead of padding every page to the largest."""
    full2 = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="bfloat16")
    full8 = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=64, dtype="bfloat16")
    swa = SlidingWindowSpec(block_size=16, num_kv_heads=4, head_size=64, dtype="bfloat16", sliding_window=128)
    layers = {}
    for r in range(4):
        layers.update({f"r{r}.a": full2, f"r{r}.b": full8, f"r{r}.s": swa})
    cfg = EngineConfig(max_model_len=4096)
    packed = _agree(planner, layers, cfg, 1 << 30, "BLHNC")
    padded = _agree(planner, layers, cfg, 1 << 30, "LBNHC")
    assert packed.status == padded.status == "ok"
    assert 2 in {len({s.page_size_bytes for s in spec.kv_cache_specs.values()})
                 for _, spec in packed.fields["groups"] if hasattr(spec, "kv_cache_specs")}


def test_layer_outer_layout_cannot_express_mixed_pages(planner):
    """LHBNC keeps heads outside blocks: a uniform-type group of two page sizes is refused by both."""
    layers = {"a": FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float16"),
              "b": FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=64, dtype="float16")}
    out = _agree(planner, layers, EngineConfig(max_model_len=64), 1 << 24, "LHBNC")
    assert (out.status, out.detail) == ("invalid", "kv_cache_layout")
    with pytest.raises(InvalidFieldError, match="kv_cache_layout"):
        plan_kv_cache(layers, EngineConfig(max_model_len=64), 1 << 24, kv_cache_layout="LHBNC")
    with pytest.raises(InvalidFieldError, match="kv_cache_layout"):
        plan_kv_cache(layers, EngineConfig(max_model_len=64), 1 << 24, kv_cache_layout="NHD")


def test_approximate_gcd_minimises_padding():
    assert approximate_gcd([4, 6]) == 2  # 0 padding at 1 and 2: ties to the larger
    assert approximate_gcd([5, 7], lower_bound=3) == 7  # padding 3: 3, 4: 4, 5: 3, 6: 6, 7: 2
    assert approximate_gcd([3], lower_bound=9) == 9
    with pytest.raises(InvalidFieldError):
        approximate_gcd([])


def test_equal_pages_are_not_packed():
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float16")
    assert get_packed_kv_cache_groups({"a": full, "b": full}) is None


def test_unbalanced_state_bucket_split_fails_startup_but_sizes_per_layer(planner):
    """Sliding-window layers of 1 and 4 heads (4:2) next to MLA, BLHNC: vLLM's packed split keeps
    whole pattern repeats only, so startup fails (partition assertion / StopIteration) and kvref
    rejects; vLLM's per-layer memory check groups without the partition check and still answers."""
    from kvref.impl.vllm.planning import kvref_per_layer_outcome
    from kvref.spec import KVCacheGroupingError, MLAAttentionSpec

    def swa(heads):
        return SlidingWindowSpec(block_size=16, num_kv_heads=heads, head_size=64, dtype="float16", sliding_window=1024)

    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=128, dtype="float16")
    kinds = [swa(1), swa(1), swa(1), swa(4), mla, mla, swa(1), swa(4), mla, mla]
    layers = {f"model.layers.{i}.attn": s for i, s in enumerate(kinds)}
    cfg = EngineConfig(max_model_len=1, derived_max_model_len=8192)
    out = _agree(planner, layers, cfg, 1 << 30, "BLHNC")
    assert out.status == "grouping"
    with pytest.raises(KVCacheGroupingError):
        plan_kv_cache(layers, cfg, 1 << 30, kv_cache_layout="BLHNC")
    for memory in (0, 1 << 30):
        theirs = planner.check_per_layer(layers, cfg, memory, "BLHNC")
        assert kvref_per_layer_outcome(layers, cfg, memory, "BLHNC").key() == theirs.key()
        assert theirs.status == ("ok" if memory else "insufficient")
