"""vLLM 0.33.0 under-counts Mamba "align" state blocks when a KV connector loads external tokens.

Found by the KV-cache-manager conformance machine (connector-style ``num_external_computed_tokens``
at admission). ``MambaManager.get_num_blocks_to_allocate`` (align mode) caps the new blocks of a
request that holds no table yet at 1 (``physical_block_cap``), but ``allocate_slots`` then takes
*two* state blocks: ``allocate_external_computed_blocks`` allocates the block holding the state at
the end of the loaded prefix, and ``allocate_new_blocks`` the block for the state after the new
token(s). When the pool has exactly the predicted number of free blocks, the admission check passes
and ``BlockPool.get_new_blocks`` raises ``ValueError("Cannot get 1 free blocks from the pool")``
half-way through ``allocate_slots`` — after the full-attention group already took its blocks (the
digest's invariant M3, "predictor = allocator", is broken).

kvref's reference reproduces vLLM exactly, including the error and the half-updated state, which is
what this file checks; the state machine does not generate external loads on Mamba-align pools (see
``docs/differences.md``, KV cache manager section).
"""

from __future__ import annotations

import pytest

from kvref.impl.interface import PoolConfig, make_manager
from kvref.impl.request import Request
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_adapter():
    require_vllm()
    import kvref.impl.vllm.kv_cache_manager as adapter  # noqa: PLC0415 - imports vLLM once per module

    return adapter


def _pool(num_blocks: int) -> PoolConfig:
    fa = FullAttentionSpec(block_size=8, num_kv_heads=1, head_size=1, dtype="float16")
    mamba = MambaSpec(block_size=2, shapes=((2, 3), (4,)), dtypes=("float16", "float32"), mamba_cache_mode="align")
    return PoolConfig(num_blocks=num_blocks, groups=(KVCacheGroupSpec(("fa",), fa), KVCacheGroupSpec(("m",), mamba)),
                      max_model_len=32, scheduler_block_size=8, hash_block_size=2)


def _admit_with_external_load(kind: str, num_blocks: int):
    """A 25-token prompt whose first 24 tokens a connector loads; 1 token is computed."""
    m = make_manager(kind, _pool(num_blocks))
    r = Request("r", list(range(25)))
    hit, num_hit = m.get_computed_blocks(r)
    assert num_hit == 0
    try:
        out = m.allocate_slots(r, 1, 0, hit, num_external_computed_tokens=24)
    except ValueError as exc:
        return m, exc
    return m, out


@pytest.mark.parametrize("kind", ["vllm", "reference"])
def test_exactly_predicted_pool_raises_midway(vllm_adapter, kind):
    # FA needs cdiv(25, 8) = 4 blocks, Mamba is predicted 1 (capped): 5 == the free blocks of a
    # 6-block pool, so the admission check passes, but Mamba really takes 2.
    m, res = _admit_with_external_load(kind, num_blocks=6)
    assert isinstance(res, ValueError) and "Cannot get 1 free blocks" in str(res)
    assert m.get_num_free_blocks() == 0
    # Half-updated: FA got its 3 external + 1 new block, Mamba only its external-state block 4
    # (positions before the loaded state are null); the caller never learns the request holds them.
    assert m.get_block_ids("r") == ((1, 2, 3, 5), (0,) * 11 + (4,))


def test_reference_matches_vllm_state_after_the_error(vllm_adapter):
    vm, vres = _admit_with_external_load("vllm", 6)
    rm, rres = _admit_with_external_load("reference", 6)
    assert isinstance(vres, ValueError) and isinstance(rres, ValueError)
    assert vm.get_block_ids("r") == rm.get_block_ids("r")
    assert vm.free_block_queue() == rm.free_block_queue()


@pytest.mark.parametrize("kind", ["vllm", "reference"])
def test_one_more_block_admits(vllm_adapter, kind):
    m, out = _admit_with_external_load(kind, num_blocks=7)
    assert out == ((5,), (6,))  # the newly allocated blocks (external-load blocks are not reported)
    assert m.get_block_ids("r") == ((1, 2, 3, 5), (0,) * 11 + (4, 6))
    assert m.get_num_free_blocks() == 0  # 6 blocks taken, as allocated (the check predicted 5)
