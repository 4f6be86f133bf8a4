"""kvref's startup planning against vLLM 0.33.0's, on generated layer sets and settings.

For each case both planners get the same layers (kvref specs and their vLLM twins), the same
settings and the same profiled memory; they must agree on accept/reject (with the same reason and
estimated maximum length) and, when accepted, on the groups (layer partition and specs, worker and
scheduler views), page sizes, bytes per block, num_blocks, max_model_len after auto-fit,
per-group blocks of a max-length request, admission caps, memory bounds, scheduler/hash block
sizes, max concurrency and the planned KV tensors (each ``KVCacheTensor``'s size, layers, strides
and byte offset, reported by index and field; #22). The ci profile runs 1,000 + 8 × 25 generated plans (and 300 spec
formula cases).
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvref.spec import (
    EngineConfig,
    FullAttentionSpec,
    InsufficientKVCacheError,
    SlidingWindowSpec,
    plan_kv_cache,
)
from tests.conftest import profile_examples
from kvref.models.strategies.planning import FAMILIES, plan_cases
from tests.vllm_env import require_vllm

from kvref.impl.vllm.planning import Outcome, VllmPlanner, kvref_outcome, outcome_divergence

pytestmark = pytest.mark.vllm

SEEN: Counter = Counter()


@pytest.fixture(scope="module")
def planner() -> VllmPlanner:
    require_vllm()
    return VllmPlanner()


def _compare(ours: Outcome, theirs: Outcome, case) -> None:
    diff = outcome_divergence(ours, theirs)
    assert diff is None, f"{diff}\n{case}"
    assert set(ours.fields) == set(theirs.fields), (sorted(ours.fields), sorted(theirs.fields))


def _run(planner: VllmPlanner, case) -> Outcome:
    theirs = planner.plan(case.layers, case.config, case.available_memory, case.extra_retained_tokens,
                          case.kv_cache_layout)
    ours = kvref_outcome(planner, case.layers, case.config, case.available_memory, case.kv_cache_layout)
    _compare(ours, theirs, case)
    SEEN[(case.family, ours.status)] += 1
    return ours


@settings(max_examples=profile_examples(60, 1000, 100000), suppress_health_check=list(HealthCheck))
@given(case=plan_cases())
def test_plan_matches_vllm(planner, case):
    _run(planner, case)


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=profile_examples(8, 25, 2500), suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_plan_matches_vllm_per_family(planner, family, data):
    _run(planner, data.draw(plan_cases(family)))


def test_generated_cases_cover_accept_and_reject():
    """The generator reaches both outcomes in the run above (otherwise it tests little)."""
    if not SEEN:
        pytest.skip("runs after the generated conformance tests")
    statuses = Counter(status for (_, status) in SEEN.elements())
    assert statuses["ok"] > 0 and statuses["insufficient"] > 0, SEEN


# -- documented vLLM cases, through both planners -------------------------------------------


def _full(bs=16):
    return FullAttentionSpec(block_size=bs, num_kv_heads=2, head_size=64, dtype="float32")


def test_null_block_reserved_exact_fit_is_rejected(planner):
    """A pool of exactly the blocks one request needs is rejected: block 0 is the null block."""
    layers = {"l0": _full()}
    cfg = EngineConfig(max_model_len=64 * 16, num_gpu_blocks_override=64)
    theirs = planner.plan(layers, cfg, 1 << 30, 0)
    ours = kvref_outcome(planner, layers, cfg, 1 << 30)
    _compare(ours, theirs, "exact fit")
    assert ours.status == "insufficient" and ours.estimated_max_model_len == 63 * 16


def test_auto_fit_reserves_null_block(planner):
    layers = {"l0": _full(), "l1": _full()}
    page = _full().page_size_bytes
    cfg = EngineConfig(max_model_len="auto", derived_max_model_len=16384)
    theirs = planner.plan(layers, cfg, 64 * 2 * page, 0)
    ours = kvref_outcome(planner, layers, cfg, 64 * 2 * page)
    _compare(ours, theirs, "auto-fit 64 blocks")
    assert ours.fields["max_model_len"] == 63 * 16


def test_override_applies_before_check(planner):
    layers = {"l0": _full(), "l1": _full()}
    cfg = EngineConfig(max_model_len=16384, num_gpu_blocks_override=32)
    theirs = planner.plan(layers, cfg, 1 << 34, 0)
    ours = kvref_outcome(planner, layers, cfg, 1 << 34)
    _compare(ours, theirs, "override 32")
    assert ours.status == "insufficient"
    with pytest.raises(InsufficientKVCacheError, match="max seq len"):
        plan_kv_cache(layers, cfg, 1 << 34)


def test_gemma_like_sliding_window_pool(planner):
    swa = SlidingWindowSpec(block_size=16, num_kv_heads=8, head_size=256, dtype="bfloat16", sliding_window=1024)
    full = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=256, dtype="bfloat16")
    layers = {f"l{i}": (full if i % 6 == 5 else swa) for i in range(48)}
    cfg = EngineConfig(max_model_len=32768, max_num_batched_tokens=1024)
    theirs = planner.plan(layers, cfg, 8 << 30, 0)
    ours = kvref_outcome(planner, layers, cfg, 8 << 30)
    _compare(ours, theirs, "gemma-like")
    assert ours.status == "ok" and len(ours.fields["groups"]) == 6
    assert ours.fields["admission_caps"] == [129] * 5 + [None]  # SWA buckets first (layer 0 is SWA)


# -- the spec formulas one by one -----------------------------------------------------------


@st.composite
def _spec_and_config(draw):
    from kvref.spec import AUTO, EncoderOnlyAttentionSpec, UniformTypeKVCacheSpecs
    from kvref.models.strategies.planning import engine_configs, layer_sets

    mode = draw(st.sampled_from(("none", "align", "all")))
    _, layers = draw(layer_sets(None, mode))
    spec = draw(st.sampled_from(list(layers.values())))
    if draw(st.integers(0, 5)) == 0:
        uniform = UniformTypeKVCacheSpecs.from_specs(layers)
        if uniform is not None:
            spec = uniform
    elif draw(st.integers(0, 9)) == 0:
        spec = EncoderOnlyAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float16")
    config = draw(engine_configs(mode))
    if config.max_model_len == AUTO:
        config = config.with_max_model_len(config.derived_max_model_len)
    return spec, config


@settings(max_examples=profile_examples(50, 300, 30000), suppress_health_check=list(HealthCheck))
@given(args=_spec_and_config(), max_len=st.integers(1, 1 << 17))
def test_spec_formulas_match_vllm(planner, args, max_len):
    """page_size_bytes, max_memory_usage_bytes, max_admission_blocks_per_request (one formula for
    sizing and the gate, vLLM #40946) and the block-table width, per spec, against vLLM's."""
    from kvref.spec import EncoderOnlyAttentionSpec, InvalidFieldError

    spec, config = args
    planner.configure(config)
    if isinstance(spec, EncoderOnlyAttentionSpec):
        theirs = planner.kci.EncoderOnlyAttentionSpec(block_size=16, num_kv_heads=2, head_size=64,
                                                      dtype=planner.torch.float16)
    else:
        theirs = planner.to_vllm(spec)
    assert spec.page_size_bytes == theirs.page_size_bytes
    try:
        want = theirs.max_memory_usage_bytes(planner.vc)
    except AssertionError:  # vLLM: "DCP not support sliding window."
        with pytest.raises(InvalidFieldError) as info:
            spec.max_memory_usage_bytes(config)
        assert info.value.field == "dcp_world_size"
        return
    assert spec.max_memory_usage_bytes(config) == want
    if hasattr(theirs, "max_admission_blocks_per_request"):
        f, m = planner.vc.max_in_flight_tokens, planner.vc.model_config.max_model_len
        cap = spec.max_admission_blocks_per_request(f, m)
        assert cap == theirs.max_admission_blocks_per_request(f, m)
        assert want == cap * spec.page_size_bytes  # single source of truth
    try:
        width = theirs.max_num_blocks_per_req(planner.vc, max_len)
    except AssertionError:
        with pytest.raises(InvalidFieldError):
            spec.max_num_blocks_per_req(config, max_len)
        return
    assert spec.max_num_blocks_per_req(config, max_len) == width


@pytest.mark.parametrize("example", ["deepseek_v3_like", "gemma3_27b_like", "llama3_8b", "nemotron_h_8b_like"])
def test_packaged_examples_match_vllm(planner, example):
    """The layouts `kvref size` ships plan the same in vLLM."""
    from kvref.cli.size import build_layers, load_layout, parse_bytes

    data = load_layout(None, example)
    config = EngineConfig(**data["engine"])
    layers = build_layers(data, mamba_cache_mode=config.mamba_cache_mode)
    memory = parse_bytes(data["available_memory"])
    theirs = planner.plan(layers, config, memory, 0)
    ours = kvref_outcome(planner, layers, config, memory)
    _compare(ours, theirs, example)
    assert ours.status == "ok"
