"""KV zeroing (issue #23): which caches zero new blocks and which groups record them
(``kvref.spec.kv_zeroing``), and the reference's records through a request's life."""

from __future__ import annotations

import pytest

from kvref.impl.interface import PoolConfig
from kvref.impl.reference.kv_cache_manager import KVCacheManager
from kvref.impl.request import Request
from kvref.spec.errors import InvalidFieldError
from kvref.spec.kv_cache_interface import (
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    UniformTypeKVCacheSpecs,
)
from kvref.spec.kv_zeroing import (
    has_mixed_precision_kv_cache,
    iter_layer_specs,
    needs_kv_cache_zeroing,
    records_new_block_ids,
)


def _fa(dtype="float32", head_size=1):
    return FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=head_size, dtype=dtype)


def _groups(*specs):
    return tuple(KVCacheGroupSpec((f"l{i}",), s) for i, s in enumerate(specs))


MAMBA = MambaSpec(block_size=4, shapes=((2, 3),), dtypes=("float16",))


def test_which_caches_need_zeroing():
    assert not needs_kv_cache_zeroing(_groups(_fa(), _fa()))
    assert needs_kv_cache_zeroing(_groups(_fa("float16"), _fa("float32")))
    assert needs_kv_cache_zeroing(_groups(_fa(), MAMBA))
    # the Mamba state's own dtypes are not attention precisions
    assert not has_mixed_precision_kv_cache(_groups(_fa("float32"), MAMBA))
    # a UniformType group counts every layer's dtype
    uniform = UniformTypeKVCacheSpecs(block_size=4, kv_cache_specs={"a": _fa("float16", 1), "b": _fa("float32", 4)})
    assert len(iter_layer_specs(uniform)) == 2
    assert has_mixed_precision_kv_cache(_groups(uniform))


def test_which_groups_record():
    assert records_new_block_ids(_fa(), True)
    assert not records_new_block_ids(_fa(), False)
    assert not records_new_block_ids(MAMBA, True)
    assert not records_new_block_ids(CircularBufferSpec(block_size=4, num_kv_heads=1, head_size=1,
                                                        dtype="float32"), True)


@pytest.mark.parametrize("call", [
    lambda: needs_kv_cache_zeroing("x"),
    lambda: needs_kv_cache_zeroing([1]),
    lambda: records_new_block_ids(_fa(), 1),
    lambda: records_new_block_ids("spec", True),
    lambda: iter_layer_specs(None),
])
def test_bad_input_names_the_field(call):
    with pytest.raises(InvalidFieldError):
        call()


def test_records_follow_a_request_and_are_drained_once():
    """Mixed precisions: every new block of both groups, then a step's new block, each once; a
    free records nothing."""
    m = KVCacheManager(PoolConfig(num_blocks=20, groups=_groups(_fa("float16"), _fa("float32")), max_model_len=32,
                                  scheduler_block_size=4, hash_block_size=4, enable_caching=False))
    assert m.needs_kv_cache_zeroing
    r = Request("r0", list(range(8)), max_tokens=4)
    new = m.allocate_slots(r, 8)
    assert m.take_new_block_ids() == [b for g in new.get_block_ids() for b in g]
    assert m.take_new_block_ids() == []
    r.num_computed_tokens = 8
    r.output_token_ids.append(1)
    step = m.allocate_slots(r, 1)
    assert m.take_new_block_ids() == [b for g in step.get_block_ids() for b in g] and len(step.get_block_ids()[0]) == 1
    m.free(r)
    assert m.take_new_block_ids() == []
