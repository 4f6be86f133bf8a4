"""Bad input: every public constructor and plan_kv_cache reject junk with a clear ValueError
subclass naming the field and the value; nothing else escapes (Hypothesis fuzz)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvref.spec import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    EngineConfig,
    FullAttentionSpec,
    InvalidFieldError,
    KVCacheGroupSpec,
    KVRefError,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    plan_kv_cache,
)
from tests.conftest import profile_examples
from kvref.models.strategies.planning import plan_cases

ATT = dict(block_size=16, num_kv_heads=2, head_size=64, dtype="float16")
FULL = FullAttentionSpec(**ATT)


@pytest.mark.parametrize("cls, kw, field, value", [
    (FullAttentionSpec, dict(ATT, block_size=0), "FullAttentionSpec.block_size", 0),
    (FullAttentionSpec, dict(ATT, num_kv_heads=-2), "FullAttentionSpec.num_kv_heads", -2),
    (FullAttentionSpec, dict(ATT, head_size=0), "FullAttentionSpec.head_size", 0),
    (FullAttentionSpec, dict(ATT, dtype="float13"), "FullAttentionSpec.dtype", "float13"),
    (SlidingWindowSpec, dict(ATT, sliding_window=0), "SlidingWindowSpec.sliding_window", 0),
    (SlidingWindowSpec, dict(ATT, sliding_window=8, extra_retained_tokens=-1),
     "SlidingWindowSpec.extra_retained_tokens", -1),
    (ChunkedLocalAttentionSpec, dict(ATT, attention_chunk_size=0), "ChunkedLocalAttentionSpec.attention_chunk_size", 0),
    (MLAAttentionSpec, dict(ATT, alignment=0), "MLAAttentionSpec.alignment", 0),
    (MambaSpec, dict(block_size=16, shapes=((0, 4),), dtypes=("float32",)), "MambaSpec.shapes[0]", 0),
    (MambaSpec, dict(block_size=16, shapes=((2, 4),), dtypes=("fp7",)), "MambaSpec.dtypes[0]", "fp7"),
    (MambaSpec, dict(block_size=16, shapes=((2, 4),), dtypes=("float32",), mamba_cache_mode="some"),
     "MambaSpec.mamba_cache_mode", "some"),
    (EngineConfig, dict(num_gpu_blocks_override=0), "num_gpu_blocks_override", 0),
    (EngineConfig, dict(max_model_len=0), "max_model_len", 0),
    (EngineConfig, dict(max_model_len=-1.0), "max_model_len", -1.0),
    (EngineConfig, dict(block_size=-16), "block_size", -16),
    (EngineConfig, dict(max_num_batched_tokens=0), "max_num_batched_tokens", 0),
    (EngineConfig, dict(prefix_match_unit=0), "prefix_match_unit", 0),
])
def test_named_field_and_value(cls, kw, field, value):
    with pytest.raises(InvalidFieldError) as info:
        cls(**kw)
    err = info.value
    assert isinstance(err, ValueError) and err.field == field and err.value == value
    assert field in str(err) and repr(value) in str(err) and "expected" in str(err)


def test_empty_layer_set_is_rejected():
    with pytest.raises(InvalidFieldError, match="layers") as info:
        plan_kv_cache({}, EngineConfig(), 1 << 30)
    assert info.value.field == "layers"


def test_encoder_only_layers_are_rejected_by_planning():
    with pytest.raises(InvalidFieldError, match="EncoderOnlyAttentionSpec"):
        plan_kv_cache({"e": EncoderOnlyAttentionSpec(**ATT)}, EngineConfig(), 1 << 30)


def test_negative_memory_is_rejected():
    with pytest.raises(InvalidFieldError) as info:
        plan_kv_cache({"l": FULL}, EngineConfig(), -1)
    assert info.value.field == "available_memory" and info.value.value == -1


def test_block_sizes_violating_divisibility_are_rejected():
    swa = SlidingWindowSpec(**dict(ATT, block_size=32), sliding_window=64)
    layers = {"f": FULL, "s": swa, "t": swa}
    with pytest.raises(InvalidFieldError) as info:
        plan_kv_cache(layers, EngineConfig(prefix_match_unit=12, max_model_len=64), 1 << 30)
    assert info.value.field == "prefix_match_unit" and info.value.value == 12


def test_sliding_window_with_dcp_is_rejected_naming_dcp():
    layers = {"s": SlidingWindowSpec(**ATT, sliding_window=64)}
    with pytest.raises(InvalidFieldError) as info:
        plan_kv_cache(layers, EngineConfig(dcp_world_size=2, max_model_len=64), 1 << 30)
    assert info.value.field == "dcp_world_size"


def test_group_spec_and_uniform_type_validate():
    with pytest.raises(InvalidFieldError):
        KVCacheGroupSpec("l0", FULL)
    with pytest.raises(InvalidFieldError):
        KVCacheGroupSpec(("l0",), "full")
    with pytest.raises(InvalidFieldError):
        UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": 5})


JUNK = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70), st.floats(allow_nan=True),
                 st.text(max_size=5), st.sampled_from(("float16", "auto", "align", "fp8", "none")),
                 st.lists(st.integers(-2, 5), max_size=3), st.tuples(st.tuples(st.integers(-1, 4))),
                 st.just(FULL), st.dictionaries(st.text(max_size=2), st.just(FULL), max_size=2))
SMALL_INT = st.one_of(st.integers(-3, 70), JUNK)


def _maybe(draw, value):
    """Keep a valid value most of the time so deeper checks run too."""
    return draw(st.one_of(st.just(value), st.just(value), SMALL_INT))


@st.composite
def junk_constructor_calls(draw):
    cls = draw(st.sampled_from((FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec,
                                CrossAttentionSpec, EncoderOnlyAttentionSpec, MambaSpec, UniformTypeKVCacheSpecs,
                                KVCacheGroupSpec, EngineConfig)))
    if cls is MambaSpec:
        kw = dict(block_size=_maybe(draw, 16), shapes=_maybe(draw, ((2, 4),)), dtypes=_maybe(draw, ("float32",)),
                  mamba_cache_mode=_maybe(draw, "none"), num_speculative_blocks=_maybe(draw, 0),
                  num_prefill_checkpoint_blocks=_maybe(draw, 0), page_size_padded=_maybe(draw, None))
    elif cls is UniformTypeKVCacheSpecs:
        kw = dict(block_size=_maybe(draw, 16), kv_cache_specs=_maybe(draw, {"a": FULL}))
    elif cls is KVCacheGroupSpec:
        kw = dict(layer_names=_maybe(draw, ("a",)), kv_cache_spec=_maybe(draw, FULL))
    elif cls is EngineConfig:
        kw = {name: draw(JUNK) for name in draw(st.sets(st.sampled_from((
            "block_size", "max_model_len", "derived_max_model_len", "max_num_batched_tokens", "max_num_seqs",
            "max_concurrent_batches", "num_gpu_blocks_override", "enable_prefix_caching", "mamba_cache_mode",
            "max_num_encoder_input_tokens", "dcp_world_size", "disable_hybrid_kv_cache_manager",
            "prefix_match_unit", "has_kv_connector")), max_size=3))}
    else:
        kw = dict(block_size=_maybe(draw, 16), num_kv_heads=_maybe(draw, 2), head_size=_maybe(draw, 64),
                  dtype=_maybe(draw, "float16"), head_size_v=_maybe(draw, None), dcp_sharded=_maybe(draw, True),
                  page_size_padded=_maybe(draw, None), state_content_bytes=_maybe(draw, None))
        if cls is SlidingWindowSpec:
            kw.update(sliding_window=_maybe(draw, 32), extra_retained_tokens=_maybe(draw, 0))
        elif cls is ChunkedLocalAttentionSpec:
            kw.update(attention_chunk_size=_maybe(draw, 32))
        elif cls in (FullAttentionSpec, MLAAttentionSpec):
            kw.update(sliding_window=_maybe(draw, None), attention_chunk_size=_maybe(draw, None))
            if cls is MLAAttentionSpec:
                kw.update(alignment=_maybe(draw, None), head_size_v=_maybe(draw, 0))
    return cls, kw


@settings(max_examples=profile_examples(200, 1000, 100000))
@given(call=junk_constructor_calls(), cfg_len=st.integers(1, 1 << 20))
def test_constructors_raise_only_clear_value_errors(call, cfg_len):
    cls, kw = call
    try:
        obj = cls(**kw)
    except KVRefError as exc:
        assert isinstance(exc, ValueError) and str(exc)
        return
    # what was accepted is usable: the formulas answer without crashing
    if isinstance(obj, EngineConfig):
        assert obj.max_in_flight_tokens >= 1
    elif hasattr(obj, "page_size_bytes"):
        assert obj.page_size_bytes >= 1
        try:
            assert obj.max_memory_usage_bytes(EngineConfig(max_model_len=cfg_len)) >= 0
        except KVRefError:
            pass


@st.composite
def junk_plans(draw):
    case = draw(plan_cases())
    layers = dict(case.layers)
    if draw(st.booleans()):
        layers[draw(st.one_of(st.text(max_size=3), st.integers()))] = draw(JUNK)
    layers = draw(st.one_of(st.just(layers), st.just(layers), JUNK))
    memory = draw(st.one_of(st.just(case.available_memory), JUNK))
    config = draw(st.one_of(st.just(case.config), st.just(case.config), JUNK))
    return layers, config, memory


@settings(max_examples=profile_examples(100, 500, 50000))
@given(args=junk_plans())
def test_plan_kv_cache_raises_only_clear_value_errors(args):
    layers, config, memory = args
    try:
        plan = plan_kv_cache(layers, config, memory)
    except KVRefError as exc:
        assert isinstance(exc, ValueError) and str(exc)
        return
    plan.check_invariants()


@settings(max_examples=profile_examples(100, 400, 40000))
@given(layers=st.one_of(JUNK, st.dictionaries(st.one_of(st.text(max_size=3), st.integers()), JUNK, max_size=3)),
       groups=st.one_of(JUNK, st.lists(st.one_of(JUNK, st.just(KVCacheGroupSpec(("a",), FULL))), max_size=3)),
       config=st.one_of(st.just(EngineConfig()), JUNK), flag=st.one_of(st.booleans(), JUNK))
def test_public_functions_reject_junk_clearly(layers, groups, config, flag):
    from kvref.spec import get_kv_cache_groups, pool_bytes_per_block, resolve_kv_cache_block_sizes

    for call in (lambda: get_kv_cache_groups(layers, flag), lambda: pool_bytes_per_block(groups),
                 lambda: resolve_kv_cache_block_sizes(groups, config)):
        try:
            call()
        except KVRefError as exc:
            assert isinstance(exc, ValueError) and str(exc)
