"""kvref.spec.kv_cache_tensors: the planned KV tensors' strides and offsets from the layout rules
(vLLM 0.33.0 ``get_kv_cache_config_from_groups`` / ``compute_layout_strides``, #22), their
placement invariants, and bad input. Pure spec, no vLLM; well under a second at CI=true."""

from __future__ import annotations

import dataclasses

import pytest

from kvref.spec import EngineConfig, FullAttentionSpec, MambaSpec, plan_kv_cache
from kvref.spec.errors import InvalidFieldError
from kvref.spec.hisparse import HiSparseHotSpec
from kvref.spec.kv_cache_interface import KVCacheGroupSpec
from kvref.spec.kv_cache_tensors import (
    KVCacheTensor,
    check_kv_cache_tensors,
    kv_cache_tensors,
    layout_strides,
    page_shape,
)

FULL = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float16")  # C = 256 B, page 8 KiB
MAMBA = MambaSpec(block_size=16, shapes=((4, 100),), dtypes=("float16",), page_size_padded=1024)  # 800 B state


def test_page_shapes():
    assert page_shape(FULL) == (2, 16, 256)
    assert page_shape(MAMBA) == (1, 1, 800)  # one "head", one state: the whole unpadded state


@pytest.mark.parametrize("layout, strides", [
    # [L, B, H, N, C] strides of 3 layers x 10 blocks x (2 heads, 16 tokens, 256 B)
    ("LBHNC", (81920, 8192, 4096, 256, 1)),
    ("LBNHC", (81920, 8192, 256, 512, 1)),
    ("LHBNC", (81920, 4096, 40960, 256, 1)),
    ("BLHNC", (8192, 24576, 4096, 256, 1)),
    ("BHLNC", (4096, 24576, 12288, 256, 1)),
])
def test_strides_follow_the_physical_order(layout, strides):
    assert layout_strides(FULL, 10, 3, layout) == strides


def test_a_fixed_block_stride_and_a_padded_page():
    # block-outermost: every block is the packed width, whatever the layer's own pages add up to
    assert layout_strides(FULL, 10, 3, "BLNHC", block_stride=30000)[:2] == (8192, 30000)
    # a padded Mamba page: the block stride is the padded page, not the 800 B state
    assert layout_strides(MAMBA, 10, 2, "LBNHC")[:2] == (10240, 1024)


def test_group_runs_and_offsets():
    """A packed group of two specs: under a layer-outermost layout the second run starts after the
    first run's whole regions; under a block-outermost one after its pages in the block."""
    from kvref.spec.kv_cache_interface import UniformTypeKVCacheSpecs

    wide = dataclasses.replace(FULL, num_kv_heads=4)
    uniform = UniformTypeKVCacheSpecs.from_specs({"a": wide, "b": FULL, "c": wide})
    group = KVCacheGroupSpec(("a", "b", "c"), uniform)
    bpb = 2 * wide.page_size_bytes + FULL.page_size_bytes
    outer = kv_cache_tensors([group], 5, "LBNHC")
    assert outer == (KVCacheTensor(bpb * 5, ("a", "c"), wide.page_size_bytes * 5, wide.page_size_bytes, 0),
                     KVCacheTensor(bpb * 5, ("b",), FULL.page_size_bytes * 5, FULL.page_size_bytes,
                                   2 * wide.page_size_bytes * 5))
    inner = kv_cache_tensors([group], 5, "BLHNC")
    assert [(t.layer_stride, t.block_stride, t.offset) for t in inner] == [
        (wide.page_size_bytes, bpb, 0), (FULL.page_size_bytes, bpb, 2 * wide.page_size_bytes)]
    for layout, tensors in (("LBNHC", outer), ("BLHNC", inner)):
        check_kv_cache_tensors([group], 5, layout, tensors)


def test_every_group_aliases_the_allocation_from_byte_zero():
    plan = plan_kv_cache({"f0": FULL, "m0": MAMBA, "f1": FULL, "m1": MAMBA}, EngineConfig(max_model_len=256),
                         1 << 20)
    tensors = plan.kv_cache_tensors
    assert tensors == kv_cache_tensors(plan.groups, plan.num_blocks, "LBNHC")
    assert {t.offset for t in tensors} == {0} and len(tensors) == len(plan.groups)
    assert {t.size for t in tensors} == {plan.bytes_per_block * plan.num_blocks}
    assert kv_cache_tensors([], 1, "LBNHC") == ()  # attention-free: no tensors


def test_placement_invariants_catch_a_shifted_or_missing_tensor():
    group = KVCacheGroupSpec(("a", "b"), FULL)
    (t,) = kv_cache_tensors([group], 4, "LBNHC")
    check_kv_cache_tensors([group], 4, "LBNHC", [t])
    with pytest.raises(AssertionError, match=r"kv_cache_tensors\[0\] addresses bytes 1\.\."):
        check_kv_cache_tensors([group], 4, "LBNHC", [dataclasses.replace(t, offset=1)])  # fault 706's shape
    with pytest.raises(AssertionError):
        check_kv_cache_tensors([group], 4, "LBNHC", [dataclasses.replace(t, layers=("a",))])


@pytest.mark.parametrize("call, field", [
    (lambda: kv_cache_tensors("x", 4, "LBNHC"), "groups"),
    (lambda: kv_cache_tensors([KVCacheGroupSpec(("a",), FULL)], 0, "LBNHC"), "num_blocks"),
    (lambda: kv_cache_tensors([KVCacheGroupSpec(("a",), FULL)], 4, "XYZ"), "kv_cache_layout"),
    (lambda: layout_strides(FULL, 4, 0, "LBNHC"), "num_layers"),
    (lambda: layout_strides(FULL, 4, 1, "LBNHC", block_stride=-2), "block_stride"),
    (lambda: layout_strides(HiSparseHotSpec(block_size=4, page_size=64, blocks_per_request=2), 4, 1, "BLHNC"),
     "kv_cache_spec"),
    (lambda: layout_strides(dataclasses.replace(FULL, page_size_padded=9000), 4, 1, "LHBNC"), "kv_cache_layout"),
])
def test_bad_input_names_the_field(call, field):
    with pytest.raises(InvalidFieldError) as err:
        call()
    assert err.value.field == field and isinstance(err.value, ValueError)
