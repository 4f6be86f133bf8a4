"""The planned KV tensors (``KVCacheConfig.kv_cache_tensors``) of kvref and vLLM 0.33.0 (#22).

Before these, conform-planning compared every figure of a plan but not where each layer's bytes
live, and the generated fault ``gen.kv_cache_planning.706.inc`` (every group's first tensor one byte
into the allocation) survived. Here: representative models under every layout agree tensor by
tensor; a planted offset or stride fault in vLLM's planning is reported by index and field; and the
generated conformance runs (tests/conformance/test_planning_conformance.py and conform-planning)
compare the tensors on every plan vLLM accepts. Cost at CI=true: about 2 s.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvref.impl.vllm.planning import (
    VllmPlanner,
    kvref_outcome,
    outcome_divergence,
    tensor_divergence,
    vllm_kv_cache_tensors,
)
from kvref.spec import EngineConfig, FullAttentionSpec, HiddenStateCacheSpec, MambaSpec, SlidingWindowSpec
from kvref.spec.kv_cache_tensors import KVCacheTensor
from kvref.spec.planning_packed import KV_CACHE_LAYOUTS
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

_KW = dict(block_size=16, num_kv_heads=2, head_size=64, dtype="float16")
FULL = FullAttentionSpec(**_KW)
SWA = SlidingWindowSpec(**_KW, sliding_window=128)
MAMBA = MambaSpec(block_size=16, shapes=((4, 100),), dtypes=("float16",))  # 800 B, padded to the attention page
WIDE = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=64, dtype="float16")

#: uniform FA; FA + SWA (three groups); FA + Mamba (padded Mamba pages); two head counts (packed
#: under block-outermost layouts); hidden-state layers (their own groups, padded pages)
MODELS = {
    "uniform-fa": {f"l{i}": FULL for i in range(4)},
    "fa+swa": {f"l{i}": (FULL if i % 3 == 2 else SWA) for i in range(6)},
    "fa+mamba": {f"l{i}": (FULL if i % 4 == 3 else MAMBA) for i in range(8)},
    "two-head-counts": {f"l{i}": (FULL if i % 2 else WIDE) for i in range(4)},
    "hidden-state": {"fa": FULL, "swa": SWA,
                     "h": HiddenStateCacheSpec(block_size=16, num_kv_heads=1, head_size=512, dtype="float16")},
}
CONFIG = EngineConfig(max_model_len=1024)
MEMORY = 1 << 24


@pytest.fixture(scope="module")
def planner() -> VllmPlanner:
    require_vllm()
    return VllmPlanner()


@pytest.mark.parametrize("model", sorted(MODELS))
def test_tensors_match_vllm_under_every_layout(planner, model):
    layers, accepted = MODELS[model], 0
    for layout in KV_CACHE_LAYOUTS:
        theirs = planner.plan(layers, CONFIG, MEMORY, 0, layout)
        ours = kvref_outcome(planner, layers, CONFIG, MEMORY, layout)
        assert outcome_divergence(ours, theirs) is None, (model, layout, outcome_divergence(ours, theirs))
        if theirs.status == "ok":
            accepted += 1
            assert theirs.fields["kv_cache_tensors"], (model, layout)  # there is something to compare
    assert accepted >= 4, (model, accepted)  # LBNHC, LBHNC, BLHNC and BLNHC express every model here


def test_uniform_layer_outer_tensor_is_one_region_per_layer(planner):
    """One group of four equal layers under LBNHC: one tensor, each layer a contiguous region of
    ``num_blocks`` pages (layer stride = pages × blocks, block stride = page), from byte 0."""
    theirs = planner.plan(MODELS["uniform-fa"], CONFIG, MEMORY, 0, "LBNHC")
    page = FULL.page_size_bytes
    num_blocks = theirs.fields["num_blocks"]
    assert theirs.fields["kv_cache_tensors"] == (
        KVCacheTensor(4 * page * num_blocks, ("l0", "l1", "l2", "l3"), page * num_blocks, page, 0),)


def test_block_outer_runs_share_each_block(planner):
    """Two head counts under BLHNC pack into one group; the second run of equal specs starts after
    the first run's pages inside every block, and each block is the whole packed width."""
    ours = kvref_outcome(planner, MODELS["two-head-counts"], CONFIG, MEMORY, "BLHNC")
    first, second = ours.fields["kv_cache_tensors"]
    bpb = ours.fields["bytes_per_block"]
    assert (first.layers, second.layers) == (("l0", "l2"), ("l1", "l3"))
    assert (first.layer_stride, first.block_stride, first.offset) == (WIDE.page_size_bytes, bpb, 0)
    assert (second.layer_stride, second.block_stride, second.offset) == (FULL.page_size_bytes, bpb,
                                                                          2 * WIDE.page_size_bytes)


@pytest.mark.parametrize("field, shift", [("offset", 1), ("block_stride", 64), ("layer_stride", 64)])
def test_a_planted_tensor_fault_in_vllm_is_reported_by_index_and_field(planner, monkeypatch, field, shift):
    """vLLM's ``get_kv_cache_config_from_groups`` with one tensor field shifted (the generated fault
    706 shifts every group's offset by one byte): the comparison names the tensor and the field."""
    from vllm.v1.core import kv_cache_planning as vp

    real = vp.get_kv_cache_config_from_groups

    def shifted(vllm_config, groups, available_memory):
        cfg = real(vllm_config, groups, available_memory)
        for t in cfg.kv_cache_tensors:
            setattr(t, field, getattr(t, field) + shift)
        return cfg

    monkeypatch.setattr(vp, "get_kv_cache_config_from_groups", shifted)
    layers = MODELS["fa+swa"]
    theirs = planner.plan(layers, CONFIG, MEMORY, 0, "LBNHC")
    ours = kvref_outcome(planner, layers, CONFIG, MEMORY, "LBNHC")
    diff = outcome_divergence(ours, theirs)
    assert diff is not None and diff.startswith(f"kv_cache_tensors[0].{field}: kvref "), diff
    assert theirs.fields["num_blocks"] == ours.fields["num_blocks"]  # no block count shows the fault


def test_tensor_divergence_names_the_first_difference(planner):
    theirs = vllm_kv_cache_tensors(_worker_config(planner))
    assert tensor_divergence(theirs, theirs) is None
    moved = (*theirs[:1], dataclasses.replace(theirs[1], offset=theirs[1].offset + 8), *theirs[2:])
    assert tensor_divergence(moved, theirs).startswith("kv_cache_tensors[1].offset: kvref ")
    renamed = (dataclasses.replace(theirs[0], layers=theirs[0].layers[::-1]), *theirs[1:])
    assert tensor_divergence(renamed, theirs).startswith("kv_cache_tensors[0].layers: ")
    assert "kvref plans 2 tensors, vLLM 3" in tensor_divergence(theirs[:2], theirs)


def _worker_config(planner: VllmPlanner):
    """vLLM's worker ``KVCacheConfig`` of the FA + SWA model (three groups, three tensors)."""
    planner.configure(CONFIG)
    planner.vc.cache_config.kv_cache_layout = "LBNHC"
    specs = {n: planner.to_vllm(s) for n, s in MODELS["fa+swa"].items()}
    groups = planner.planning.get_global_kv_cache_groups(planner.vc, [specs])
    (cfg,) = planner.planning.get_kv_cache_configs(planner.vc, [specs], [MEMORY], groups)
    assert len(cfg.kv_cache_tensors) == 3
    return cfg
