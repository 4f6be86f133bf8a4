"""DCP/PCP at runtime (issue #23): the pure rules of spec/context_parallel.py and their use in
PoolConfig and the reference managers."""

from __future__ import annotations

import dataclasses

import pytest

from kvref.impl.interface import PoolConfig
from kvref.impl.reference.kv_cache_manager import KVCacheManager
from kvref.impl.request import Request
from kvref.spec.context_parallel import check_context_parallel, manager_block_size, manager_world_sizes
from kvref.spec.errors import InvalidFieldError
from kvref.spec.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

FULL = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float16")
SWA = SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float16", sliding_window=4)
MAMBA = MambaSpec(block_size=4, shapes=((1,),), dtypes=("float32",), mamba_cache_mode="align")


def _replicated(spec):
    return dataclasses.replace(spec, dcp_sharded=False)


def test_world_sizes_and_block_size_follow_sharding():
    assert manager_world_sizes(FULL, 4, 2) == (4, 2)
    assert manager_world_sizes(_replicated(FULL), 4, 2) == (1, 1)
    assert manager_world_sizes(MAMBA, 4, 2) == (1, 1)  # Mamba state is replicated
    assert manager_block_size(FULL, 4) == 16
    assert manager_block_size(_replicated(FULL), 4) == 4
    assert manager_block_size(MAMBA, 8) == 4


@pytest.mark.parametrize("specs,dcp,pcp,field", [
    ((FULL, SWA), 2, 1, "dcp_world_size"),  # hybrid: a sharded window
    ((FULL, MAMBA), 1, 2, "pcp_world_size"),  # hybrid: PCP takes attention groups only
    ((FULL, SWA), 1, 2, "pcp_world_size"),  # hybrid: a sharded window under PCP
    ((SWA,), 2, 1, "dcp_world_size"),  # one group: the window lookup asserts DCP 1
    ((_replicated(SWA),), 1, 2, "pcp_world_size"),  # one group: the engine's PCP reaches the lookup
    ((MAMBA,), 1, 2, "pcp_world_size"),
])
def test_refused_with_prefix_caching(specs, dcp, pcp, field):
    with pytest.raises(InvalidFieldError) as info:
        check_context_parallel(specs, dcp, pcp, enable_caching=True)
    assert info.value.field == field
    check_context_parallel(specs, dcp, pcp, enable_caching=False)  # vLLM checks nothing without caching


@pytest.mark.parametrize("specs,dcp,pcp", [
    ((FULL, MAMBA), 4, 1),
    ((FULL, _replicated(SWA)), 2, 2),
    ((FULL, _replicated(FULL)), 2, 2),
    ((MLAAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float16"),), 8, 2),
    ((_replicated(SWA),), 4, 1),
])
def test_accepted(specs, dcp, pcp):
    check_context_parallel(specs, dcp, pcp, enable_caching=True)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_bad_world_size_names_the_field(bad):
    with pytest.raises(InvalidFieldError) as info:
        check_context_parallel((FULL,), bad, 1, enable_caching=True)
    assert info.value.field == "dcp_world_size"
    with pytest.raises(InvalidFieldError) as info:
        PoolConfig(num_blocks=8, groups=(KVCacheGroupSpec(("l",), FULL),), max_model_len=32,
                   scheduler_block_size=4, hash_block_size=4, pcp_world_size=bad)
    assert info.value.field == "pcp_world_size"


def test_unitary_pool_hashes_at_the_sharded_block():
    """One sharded full-attention group under DCP 2: the manager's block holds 8 tokens, the hash
    block must be 8 (4 is refused), hits and BlockStored events are in 8-token blocks."""
    group = KVCacheGroupSpec(("l",), FULL)
    KVCacheManager(PoolConfig(num_blocks=16, groups=(group,), max_model_len=64, scheduler_block_size=8,
                              hash_block_size=4, dcp_world_size=2, enable_caching=False))  # no hashing: fine
    with pytest.raises(InvalidFieldError) as info:
        KVCacheManager(PoolConfig(num_blocks=16, groups=(group,), max_model_len=64, scheduler_block_size=8,
                                  hash_block_size=4, dcp_world_size=2))
    assert info.value.field == "hash_block_size"
    m = KVCacheManager(PoolConfig(num_blocks=16, groups=(group,), max_model_len=64, scheduler_block_size=8,
                                  hash_block_size=8, dcp_world_size=2, enable_kv_cache_events=True))
    assert m.coordinator.single_type_managers[0].block_size == 8
    first = Request(request_id="a", prompt_token_ids=list(range(20)))
    assert m.allocate_slots(first, 20).get_block_ids() == ([1, 2, 3],)  # cdiv(20, 8) blocks
    stored = [e for e in m.take_events() if type(e).__name__ == "BlockStored"]
    assert [e.block_size for e in stored] == [8] and len(stored[0].block_hashes) == 2
    m.free(first)
    second = Request(request_id="b", prompt_token_ids=list(range(20)) + [99], kv_cache_report_mode="full")
    blocks, hit, _ = m.get_computed_blocks(second)
    assert hit == 16 and len(blocks.blocks[0]) == 2
    # the hit is announced in the blocks it holds (vLLM 0.33.0 asserts here: docs/differences.md)
    announced = [e for e in m.take_events() if type(e).__name__ == "BlockStored"]
    assert [(e.block_size, len(e.block_hashes)) for e in announced] == [(8, 2)]


def test_torch_implementation_refuses_context_parallel():
    """The torch implementation does not model DCP/PCP: it refuses such a pool instead of running it
    at world size 1."""
    pytest.importorskip("torch")
    from kvref.impl.interface import make_manager

    pool = PoolConfig(num_blocks=8, groups=(KVCacheGroupSpec(("l",), FULL),), max_model_len=32,
                      scheduler_block_size=8, hash_block_size=8, dcp_world_size=2)
    with pytest.raises(InvalidFieldError) as info:
        make_manager("torch", pool)
    assert info.value.field == "dcp_world_size"
    make_manager("torch", dataclasses.replace(pool, dcp_world_size=1, hash_block_size=4))
