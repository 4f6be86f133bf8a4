"""Hidden-state cache layers (vLLM's extract_hidden_states) and the MLA + sliding-window
full-allocation fallback in the grouping, kvref against vLLM 0.33.0 (#22).

The generated run is derandomized, so it reaches the same paths of vLLM's ``get_kv_cache_groups``
under every profile: hidden-state layers aligned to the common page, the common page scaled up to
hold one hidden-state token, and the fallback taken.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings

from kvref.impl.vllm.planning import VllmPlanner, kvref_outcome
from kvref.models.strategies.planning import plan_cases
from kvref.spec import FullAttentionSpec, HiddenStateCacheSpec, SlidingWindowSpec, get_kv_cache_groups
from kvref.spec.kv_cache_interface import MLAAttentionSpec, UniformTypeKVCacheSpecs
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def planner() -> VllmPlanner:
    require_vllm()
    return VllmPlanner()


def _agree(planner: VllmPlanner, case) -> str:
    theirs = planner.plan(case.layers, case.config, case.available_memory, case.extra_retained_tokens,
                          case.kv_cache_layout)
    ours = kvref_outcome(planner, case.layers, case.config, case.available_memory, case.kv_cache_layout)
    assert ours.key() == theirs.key(), f"kvref {ours.key()} vs vLLM {theirs.key()}\n{case}"
    for name, want in theirs.fields.items():
        assert ours.fields[name] == want, f"{name}: kvref {ours.fields[name]!r} != vLLM {want!r}\n{case}"
    return theirs.status


def test_generated_hidden_state_models_plan_like_vllm(planner, monkeypatch):
    from vllm.v1.core import kv_cache_planning as vp

    seen: Counter = Counter()
    ensure, fallback = vp._ensure_min_page_size, vp._try_get_full_allocation_fallback_groups

    def counted_ensure(groups, common_page, hidden):
        out = ensure(groups, common_page, hidden)
        seen["aligned"] += 1
        seen["scaled"] += out[1] != common_page
        return out

    def counted_fallback(specs):
        out = fallback(specs)
        seen["fallback"] += out is not None
        return out

    monkeypatch.setattr(vp, "_ensure_min_page_size", counted_ensure)
    monkeypatch.setattr(vp, "_try_get_full_allocation_fallback_groups", counted_fallback)

    @settings(max_examples=120, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(case=plan_cases("hidden"))
    def hidden(case):
        seen[_agree(planner, case)] += 1

    @settings(max_examples=200, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(case=plan_cases("mla"))
    def mla(case):
        _agree(planner, case)

    hidden()
    mla()
    assert seen["aligned"] > 0 and seen["scaled"] > 0 and seen["fallback"] > 0 and seen["ok"] > 0, seen


def test_hidden_state_groups_are_aligned_to_the_scaled_common_page():
    """FA + SWA pages of 16 tokens x 64 B = 1024 B. A hidden-state token of 4 x 512 x 2 B = 4096 B
    needs the common page scaled by 4 (attention block size 64); each hidden group's block size is
    the largest divisor of 64 whose tokens fit in 4096 B (96 B/token: 32; 4096 B/token: 1), its
    page padded to the common one."""
    kw = dict(block_size=16, num_kv_heads=1, head_size=16, dtype="float16")
    layers = {"fa": FullAttentionSpec(**kw), "swa": SlidingWindowSpec(**kw, sliding_window=32),
              "h1": HiddenStateCacheSpec(block_size=16, num_kv_heads=1, head_size=48, dtype="float16"),
              "h2": HiddenStateCacheSpec(block_size=16, num_kv_heads=4, head_size=512, dtype="float16")}
    groups = get_kv_cache_groups(layers)
    assert [g.layer_names for g in groups] == [("fa",), ("swa",), ("h1",), ("h2",)]
    assert [g.kv_cache_spec.block_size for g in groups] == [64, 64, 32, 1]
    assert {g.kv_cache_spec.page_size_bytes for g in groups} == {4096}


def test_hidden_state_layers_block_the_full_allocation_fallback():
    """MLA next to a sliding window whose pages cannot be unified falls back to one full-allocation
    group, but not with a hidden-state layer beside them (vLLM fails there too)."""
    from kvref.spec import KVCacheGroupingError

    layers = {"mla": MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype="float16"),
              "swa": SlidingWindowSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="float16",
                                       sliding_window=128)}
    (group,) = get_kv_cache_groups(layers)
    assert isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs)
    with pytest.raises(KVCacheGroupingError):
        get_kv_cache_groups({**layers, "hidden": HiddenStateCacheSpec(block_size=16, num_kv_heads=1,
                                                                      head_size=64, dtype="float16")})
