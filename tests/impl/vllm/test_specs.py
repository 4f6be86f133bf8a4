"""The one spec converter (kvref.impl.vllm.specs) against vLLM's own classes and dtype table (#26).

Before #26 the scheduler adapter had a converter of its own whose dtype mapping sent ``fp8_inc`` and
``fp8_ds_mla`` to ``getattr(torch, name)`` (AttributeError) and dropped ``head_size_v``,
``page_size_padded``, ``dcp_sharded``; the KV cache manager's used vLLM's table only, so a
``float64`` Mamba state raised KeyError. Each test below fails with either of them.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvref.spec import kv_cache_interface as ks
from kvref.spec.dtypes import DTYPE_SIZES, canonical_dtype, get_dtype_size
from kvref.spec.errors import InvalidFieldError
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

NAMES = tuple(sorted(DTYPE_SIZES))


@pytest.fixture(scope="module")
def vllm_side():
    require_vllm()
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE, get_dtype_size as vllm_dtype_size, \
        kv_cache_dtype_str_to_dtype

    from kvref.impl.vllm import specs

    return specs, STR_DTYPE_TO_TORCH_DTYPE, kv_cache_dtype_str_to_dtype, vllm_dtype_size


@pytest.mark.parametrize("name", NAMES)
def test_every_dtype_name_maps_as_vllm_maps_a_cache_dtype(vllm_side, name):
    """A name vLLM knows as a cache dtype maps as vLLM's ``kv_cache_dtype_str_to_dtype`` maps it;
    any other (a Mamba state's torch dtype) maps to a torch dtype of kvref's element size."""
    specs, table, str_to_dtype, vllm_dtype_size = vllm_side
    got = specs.to_torch_dtype(name)
    if name in table:
        assert got is str_to_dtype(name, None)
    assert vllm_dtype_size(got) == get_dtype_size(name)


def test_an_unknown_dtype_name_is_refused_naming_the_field(vllm_side):
    specs = vllm_side[0]
    with pytest.raises(InvalidFieldError) as info:
        specs.to_torch_dtype("fp4")
    assert info.value.field == "dtype"


@st.composite
def kvref_specs(draw):
    """A kvref spec of every kind the converter takes, with every dtype name and optional field."""
    bs = draw(st.sampled_from((1, 2, 16, 32)))
    kind = draw(st.sampled_from(("full", "mla", "swa", "chunked", "cross", "mamba", "rswa", "sink", "circular")))
    if kind == "mamba":
        shapes = draw(st.lists(st.tuples(st.integers(1, 6), st.integers(1, 8)), min_size=1, max_size=3))
        spec = ks.MambaSpec(block_size=bs, shapes=tuple(shapes),
                            dtypes=tuple(draw(st.sampled_from(NAMES)) for _ in shapes),
                            mamba_cache_mode=draw(st.sampled_from(("none", "all", "align"))),
                            num_speculative_blocks=draw(st.integers(0, 2)))
        if draw(st.booleans()):
            spec = dataclasses.replace(spec, page_size_padded=spec.page_size_bytes + draw(st.integers(0, 64)))
        return spec
    kw = dict(block_size=bs, num_kv_heads=1 if kind == "mla" else draw(st.integers(1, 4)),
              head_size=draw(st.integers(1, 64)), dtype=draw(st.sampled_from(NAMES)),
              dcp_sharded=draw(st.booleans()))
    if kind != "mla" and draw(st.booleans()):
        kw["head_size_v"] = draw(st.integers(1, 64))
    window = draw(st.integers(1, 64))
    spec = {"full": lambda: ks.FullAttentionSpec(**kw),
            "mla": lambda: ks.MLAAttentionSpec(**kw),
            "swa": lambda: ks.SlidingWindowSpec(**kw, sliding_window=window),
            "chunked": lambda: ks.ChunkedLocalAttentionSpec(**kw, attention_chunk_size=window),
            "cross": lambda: ks.CrossAttentionSpec(**kw),
            "rswa": lambda: ks.RSWASpec(**kw, sliding_window=window, rswa_window=draw(st.integers(1, 64))),
            "sink": lambda: ks.SinkFullAttentionSpec(**kw, sink_len=draw(st.integers(1, 8))),
            "circular": lambda: ks.CircularBufferSpec(**kw)}[kind]()
    if draw(st.booleans()):
        spec = dataclasses.replace(spec, page_size_padded=spec.page_size_bytes + draw(st.integers(0, 64)))
    return spec


@settings(max_examples=profile_examples(60, 300), deadline=None)
@given(spec=kvref_specs())
def test_converted_spec_carries_every_field_and_sizes_as_kvref(vllm_side, spec):
    """vLLM's twin of a generated spec is of the same class, holds every field kvref has (dtype
    names through vLLM's mapping) and has kvref's page size."""
    specs, table, str_to_dtype, vllm_dtype_size = vllm_side
    theirs = specs.to_vllm_spec(spec)
    assert type(theirs).__name__ == type(spec).__name__
    for f in dataclasses.fields(spec):
        ours, got = getattr(spec, f.name), getattr(theirs, f.name)
        if f.name == "dtype":
            assert vllm_dtype_size(got) == get_dtype_size(ours)
            assert got is table.get(canonical_dtype(ours), got)
        elif f.name == "dtypes":
            assert tuple(vllm_dtype_size(d) for d in got) == tuple(get_dtype_size(d) for d in ours)
        else:
            assert got == (tuple(ours) if f.name == "shapes" else ours), f.name
    assert theirs.page_size_bytes == spec.page_size_bytes
