"""Bad calls into the reference: a clear KVRefError / InvalidFieldError, and nothing changed.

Paths where vLLM itself had bugs of this kind:

* double frees: vLLM #42571 (eager SimpleCPUOffload + sliding window listed one block twice in a
  ``free_blocks`` call; the count went negative and the free list broke with "prev_free_block of
  fake_free_list_tail should always exist"; dedup PR #42612 was closed unmerged), the v0 block
  manager's "Double free!" (vLLM #1556), free-queue corruption reports downstream
  (vllm-ascend #15990). The reference refuses a free that would underflow and rolls back.
* "Cannot get N free blocks from the pool": the per-step predictor and the allocator disagreed
  (vLLM PR #40027 around #39734). The reference raises before taking anything.
"""

from __future__ import annotations

import copy

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvref.impl.interface import PoolConfig
from kvref.impl.reference.adapter import ReferenceKVCacheManager
from kvref.impl.reference.errors import BlockRefCountError, UnknownRequestError
from kvref.impl.reference.kv_cache_coordinator import KVCacheCoordinator, UnitaryKVCacheCoordinator
from kvref.impl.reference.kv_cache_manager import KVCacheBlocks, KVCacheManager
from kvref.impl.request import Request, RequestStatus
from kvref.spec.errors import InvalidFieldError, KVRefError
from kvref.spec.kv_cache_interface import KVCacheGroupSpec

from .helpers import config, cross, fa, local, mamba, swa


def snapshot(m: KVCacheManager):
    pool = m.block_pool
    return (pool.free_block_ids(), [b.ref_cnt for b in pool.blocks], [b.block_hash for b in pool.blocks],
            {g: {r: [b.block_id for b in t] for r, t in mgr.req_to_blocks.items()}
             for g, mgr in enumerate(m.coordinator.single_type_managers)},
            {g: dict(mgr.num_cached_block) for g, mgr in enumerate(m.coordinator.single_type_managers)})


def running_manager():
    m = KVCacheManager(config([fa(4), swa(4, 8)], num_blocks=20, max_model_len=64))
    req = Request("r", list(range(10)))
    hits, n, _ = m.get_computed_blocks(req)
    assert m.allocate_slots(req, 10, n, hits) is not None
    req.num_computed_tokens = 10
    req.status = RequestStatus.RUNNING
    return m, req


BAD_ALLOCATIONS = [
    (dict(num_new_tokens=-1), InvalidFieldError),
    (dict(num_new_tokens=0), InvalidFieldError),  # nothing to compute or adopt
    (dict(num_new_tokens=1, num_lookahead_tokens=-2), InvalidFieldError),
    (dict(num_new_tokens=1, reserved_blocks=-1), InvalidFieldError),
    (dict(num_new_tokens=1, num_external_computed_tokens=-4), InvalidFieldError),
    (dict(num_new_tokens=60), InvalidFieldError),  # 10 computed + 60 > max_model_len 64
    (dict(num_new_tokens=1.5), InvalidFieldError),
    (dict(num_new_tokens=True), InvalidFieldError),
]


@pytest.mark.parametrize("kwargs,error", BAD_ALLOCATIONS)
def test_bad_allocate_arguments_leave_state_unchanged(kwargs, error):
    m, req = running_manager()
    req.output_token_ids.append(3)
    before = snapshot(m)
    with pytest.raises(error):
        m.allocate_slots(req, **kwargs)
    assert snapshot(m) == before
    m.check_invariants()


def test_request_longer_than_max_model_len_is_rejected():
    m = KVCacheManager(config([fa(4)], num_blocks=20, max_model_len=16))
    before = snapshot(m)
    with pytest.raises(InvalidFieldError, match="max_model_len"):
        m.allocate_slots(Request("r", list(range(17))), 4)
    assert snapshot(m) == before


def test_unknown_request_claiming_computed_tokens_is_rejected():
    m, _ = running_manager()
    ghost = Request("ghost", list(range(8)), num_computed_tokens=4)
    before = snapshot(m)
    with pytest.raises(UnknownRequestError):
        m.allocate_slots(ghost, 4)
    assert snapshot(m) == before


def test_allocating_again_after_free_without_resetting_progress_is_rejected():
    m, req = running_manager()
    m.free(req)
    before = snapshot(m)
    with pytest.raises(UnknownRequestError):
        m.allocate_slots(req, 1)
    assert snapshot(m) == before
    m.check_invariants()


def test_new_hits_for_a_running_request_are_rejected():
    m, req = running_manager()
    other = Request("o", list(range(10)))
    hits, n, _ = m.get_computed_blocks(other)
    assert n == 8
    before = snapshot(m)
    with pytest.raises(InvalidFieldError, match="already running"):
        m.allocate_slots(req, 1, n, hits)
    assert snapshot(m) == before


def test_hits_must_match_the_group_count_and_the_pool():
    m, _ = running_manager()
    new = Request("n", list(range(10)))
    with pytest.raises(InvalidFieldError):
        m.allocate_slots(new, 2, 8, KVCacheBlocks(([],)))
    foreign = KVCacheManager(config([fa(4), swa(4, 8)], num_blocks=20)).block_pool.blocks[1]
    with pytest.raises(InvalidFieldError):
        m.allocate_slots(new, 2, 8, KVCacheBlocks(([foreign], [])))
    m.check_invariants()


def test_hits_with_caching_disabled_are_rejected():
    m = KVCacheManager(config([fa(4)], num_blocks=10, caching=False))
    with pytest.raises(InvalidFieldError, match="caching"):
        m.allocate_slots(Request("r", list(range(9))), 1, 8, KVCacheBlocks(([m.block_pool.blocks[1]],)))


def test_freeing_a_request_twice_is_a_no_op_like_vllm():
    """vLLM frees an unknown request silently (a request may be aborted before allocation)."""
    m, req = running_manager()
    m.free(req)
    before = snapshot(m)
    m.free(req)
    assert snapshot(m) == before
    m.check_invariants()


def test_freeing_a_block_twice_is_rejected():
    m, req = running_manager()
    blocks = list(m.get_blocks("r").blocks[0])
    m.free(req)
    before = snapshot(m)
    with pytest.raises(BlockRefCountError):
        m.block_pool.free_blocks(blocks)
    assert snapshot(m) == before
    m.check_invariants()


def test_adapter_rejects_out_of_range_hit_ids():
    ref = ReferenceKVCacheManager(config([fa(4)], num_blocks=10))
    with pytest.raises(InvalidFieldError):
        ref.allocate_slots(Request("r", list(range(9))), 1, 8, ((99,),))
    with pytest.raises(InvalidFieldError):
        ref.allocate_slots(Request("r", list(range(9))), 1, 8, ((1,), (2,)))
    ref.check_invariants()


def test_non_request_arguments_are_rejected():
    m, _ = running_manager()
    with pytest.raises(InvalidFieldError):
        m.get_computed_blocks("r")
    with pytest.raises(InvalidFieldError):
        m.free(None)
    with pytest.raises(InvalidFieldError):
        KVCacheManager("config")


@pytest.mark.parametrize("make,error", [
    # one group: hashes must be computed at its block size (vLLM asserts)
    (lambda: PoolConfig(num_blocks=8, groups=(KVCacheGroupSpec(("a",), fa(8)),), max_model_len=64,
                        scheduler_block_size=8, hash_block_size=4), InvalidFieldError),
    # Mamba prefix caching needs mamba_cache_mode="align" (vLLM asserts)
    (lambda: config([fa(4), mamba(4, "none")]), InvalidFieldError),
    # cross-attention is never cached (vLLM raises in cache_blocks)
    (lambda: config([fa(4), cross(4)]), InvalidFieldError),
    # chunked local hits need the scheduler block size (vLLM asserts at lookup)
    (lambda: config([fa(8), local(4, 8)]), InvalidFieldError),
    # EAGLE with chunked local and caching (vLLM asserts)
    (lambda: config([local(4, 8)], use_eagle=True), InvalidFieldError),
])
def test_configurations_vllm_rejects_or_kvref_does_not_model(make, error):
    with pytest.raises(error):
        KVCacheManager(make())


def test_coordinator_is_built_from_a_validated_pool_config():
    """Seed 003 / vLLM PR #44165: scheduler_block_size must be a multiple of hash_block_size and of
    every group's block size. PoolConfig checks it once; the coordinators take nothing else, so no
    coordinator can be built on an unchecked combination."""
    groups = (KVCacheGroupSpec(("a",), fa(8)),)
    with pytest.raises(InvalidFieldError, match="scheduler_block_size"):
        PoolConfig(8, groups, 64, scheduler_block_size=12, hash_block_size=4)
    for cls in (KVCacheCoordinator, UnitaryKVCacheCoordinator):
        with pytest.raises(InvalidFieldError, match="config"):
            cls(groups)  # the old positional form
    two = groups + (KVCacheGroupSpec(("b",), fa(8)),)
    with pytest.raises(InvalidFieldError, match="groups"):
        UnitaryKVCacheCoordinator(PoolConfig(8, two, 64, scheduler_block_size=8, hash_block_size=8))
    with pytest.raises(InvalidFieldError, match="hash_block_size"):
        UnitaryKVCacheCoordinator(PoolConfig(8, groups, 64, scheduler_block_size=8, hash_block_size=4))


@given(st.fixed_dictionaries({
    "num_new_tokens": st.integers(-3, 80),
    "num_new_computed_tokens": st.integers(-2, 12),
    "num_lookahead_tokens": st.integers(-2, 4),
    "num_external_computed_tokens": st.integers(-2, 8),
    "reserved_blocks": st.integers(-2, 30),
    "full_sequence_must_fit": st.booleans(),
}), st.integers(0, 12), st.booleans())
def test_fuzzed_allocations_either_answer_or_raise_cleanly(kwargs, computed, use_hits):
    m, req = running_manager()
    new = Request("n", list(range(12)) + [1, 2], num_computed_tokens=computed)
    hits = m.get_computed_blocks(new)[0] if use_hits else None
    before = snapshot(m)
    try:
        m.allocate_slots(new, new_computed_blocks=hits, **kwargs)
    except KVRefError:
        assert snapshot(m) == before  # rejected before anything changed
    m.check_invariants()
