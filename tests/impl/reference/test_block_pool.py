"""BlockPool: null block, free-queue order, eviction, duplicates, ref counts, usage, reset.

Invariant names I1–I10 are those of docs/invariants.md; ``check_invariants()`` asserts I1–I8 and the
stateful test checks every operation against a plain-list model of vLLM's rules.
"""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvref.impl.reference.block_hash import make_block_hash_with_group_id
from kvref.impl.reference.block_pool import BlockPool
from kvref.impl.reference.errors import BlockRefCountError, NotEnoughFreeBlocksError
from kvref.spec.errors import InvalidFieldError, KVRefError
from tests.conftest import profile_examples


def _queue(pool: BlockPool) -> list[int]:
    return list(pool.free_block_ids())


def _cache(pool, blocks, hashes, group=0, block_size=4):
    pool.cache_full_blocks(hashes, blocks, 0, len(blocks), block_size, group)


def test_null_block_is_block_zero_and_never_handed_out():  # I2
    pool = BlockPool(5, True, 4)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert _queue(pool) == [1, 2, 3, 4]
    got = pool.get_new_blocks(4)
    assert [b.block_id for b in got] == [1, 2, 3, 4]
    assert all(b.ref_cnt == 1 for b in got)
    pool.free_blocks([pool.null_block])  # skipped, not an error
    assert pool.null_block.ref_cnt == 0
    pool.check_invariants()


def test_free_prepends_unhashed_and_appends_hashed_in_given_order():  # I8
    pool = BlockPool(8, True, 4)
    a, b, c, d = pool.get_new_blocks(4)  # 1..4; queue now [5, 6, 7]
    _cache(pool, [a, b], [b"h0", b"h1"])
    # a request frees its table in reverse: d, c (scratch) and b, a (cached)
    pool.free_blocks([d, c, b, a])
    assert _queue(pool) == [4, 3, 5, 6, 7, 2, 1]
    pool.check_invariants()


def test_caching_disabled_prepends_everything():
    pool = BlockPool(5, False, 4)
    a, b = pool.get_new_blocks(2)
    pool.free_blocks([b, a])
    assert _queue(pool) == [2, 1, 3, 4]


def test_get_new_blocks_evicts_hashes_of_reused_cached_blocks():  # I7
    pool = BlockPool(3, True, 4)
    a, b = pool.get_new_blocks(2)
    _cache(pool, [a], [b"h0"])
    pool.free_blocks([b, a])  # queue: [b(2), a(1, cached)]
    assert pool.get_cached_block(b"h0", [0]) == [a]
    first, second = pool.get_new_blocks(2)
    assert (first, second) == (b, a)
    assert a.block_hash is None and pool.get_cached_block(b"h0", [0]) is None
    pool.check_invariants()


def test_touch_removes_a_free_cached_block_from_the_queue():  # I3
    pool = BlockPool(4, True, 4)
    a, b = pool.get_new_blocks(2)
    _cache(pool, [a], [b"h0"])
    pool.free_blocks([b, a])
    pool.touch([a, pool.null_block])
    assert a.ref_cnt == 1 and 1 not in _queue(pool)
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.check_invariants()


def test_duplicate_content_is_cached_in_both_blocks():
    pool = BlockPool(4, True, 4)
    a, b = pool.get_new_blocks(2)
    _cache(pool, [a], [b"same"])
    _cache(pool, [b], [b"same"])
    assert pool.get_cached_block(b"same", [0]) == [a]  # first inserted wins
    key = make_block_hash_with_group_id(b"same", 0)
    assert pool.cached_block_hash_to_block.contain(key, 2)
    pool.free_blocks([a])
    pool.get_new_blocks(2)  # queue was [3, 1 (a, cached)]: reusing a evicts its hash
    assert pool.get_cached_block(b"same", [0]) == [b]
    pool.check_invariants()


def test_get_cached_block_needs_a_hit_in_every_group():
    pool = BlockPool(4, True, 4)
    a, b = pool.get_new_blocks(2)
    _cache(pool, [a], [b"h"], group=0)
    assert pool.get_cached_block(b"h", [0, 1]) is None
    _cache(pool, [b], [b"h"], group=1)
    assert pool.get_cached_block(b"h", [0, 1]) == [a, b]


def test_coarse_blocks_use_the_last_fine_hash():
    pool = BlockPool(3, True, 4)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([b"f0", b"f1"], [a], 0, 1, 8, 0)
    assert a.block_hash == make_block_hash_with_group_id(b"f1", 0)
    assert a.block_hash_num_tokens == 8


def test_partial_entry_is_promoted_by_the_full_block():
    pool = BlockPool(3, True, 4)
    (a,) = pool.get_new_blocks(1)
    fine = [b"f0", b"f1"]
    pool.cache_partial_block(fine, a, 4, 0, 8)
    assert a.block_hash == make_block_hash_with_group_id(b"f0", 0) and a.block_hash_num_tokens == 4
    pool.cache_full_blocks(fine, [a], 0, 1, 8, 0)
    assert a.block_hash == make_block_hash_with_group_id(b"f1", 0)
    assert pool.get_cached_block(b"f0", [0]) is None
    pool.check_invariants()


def test_secondary_keys_are_evicted_with_the_block():
    pool = BlockPool(3, True, 4)
    (a,) = pool.get_new_blocks(1)
    fine = [b"f0", b"f1"]
    pool.cache_full_blocks(fine, [a], 0, 1, 8, 0)
    pool.cache_partial_block(fine, a, 4, 1, 8)  # another group's key on the same block
    assert pool.cached_block_hashes_by_block == {1: {make_block_hash_with_group_id(b"f0", 1)}}
    pool.evict_blocks({1})
    assert a.block_hash is None and not pool.cached_block_hashes_by_block
    assert len(pool.cached_block_hash_to_block) == 0
    pool.check_invariants()


def test_usage_excludes_the_null_block():
    pool = BlockPool(5, True, 4)
    assert pool.get_usage() == 0.0
    pool.get_new_blocks(2)
    assert pool.get_usage() == pytest.approx(0.5)
    assert BlockPool(1, True, 4).get_usage() == 0.0


def test_reset_prefix_cache_only_when_nothing_is_in_use():  # I10
    pool = BlockPool(4, True, 4)
    a, b = pool.get_new_blocks(2)
    _cache(pool, [a, b], [b"x", b"y"])
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is False and a.block_hash is not None
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() is True
    assert a.block_hash is None and b.block_hash is None and len(pool.cached_block_hash_to_block) == 0
    pool.check_invariants()


def test_evict_blocks_keeps_in_use_blocks_allocated():
    pool = BlockPool(4, True, 4)
    (a,) = pool.get_new_blocks(1)
    _cache(pool, [a], [b"x"])
    pool.evict_blocks([1])
    assert a.ref_cnt == 1 and a.block_hash is None
    pool.check_invariants()


# ---------------------------------------------------------------- bad input


def test_not_enough_free_blocks_takes_nothing():
    pool = BlockPool(3, True, 4)
    with pytest.raises(NotEnoughFreeBlocksError, match="Cannot get 3 free blocks"):
        pool.get_new_blocks(3)
    assert pool.get_num_free_blocks() == 2
    pool.check_invariants()


def test_double_free_is_rejected_and_rolled_back():
    pool = BlockPool(4, True, 4)
    a, b = pool.get_new_blocks(2)
    with pytest.raises(BlockRefCountError):
        pool.free_blocks([a, b, a])  # a appears twice: second free would underflow
    assert a.ref_cnt == 1 and b.ref_cnt == 1 and _queue(pool) == [3]
    pool.free_blocks([a])
    with pytest.raises(KVRefError):
        pool.free_blocks([a])
    pool.check_invariants()


@pytest.mark.parametrize("call", [
    lambda p: p.get_new_blocks(-1),
    lambda p: p.get_new_blocks(True),
    lambda p: p.touch([object()]),
    lambda p: p.free_blocks([BlockPool(4, True, 4).blocks[1]]),
    lambda p: p.evict_blocks([99]),
])
def test_foreign_or_negative_arguments_are_invalid_field_errors(call):
    pool = BlockPool(4, True, 4)
    with pytest.raises(InvalidFieldError):
        call(pool)
    pool.check_invariants()


@pytest.mark.parametrize("kwargs", [dict(num_gpu_blocks=0), dict(hash_block_size=0),
                                    dict(enable_caching="yes")])
def test_bad_constructor_arguments(kwargs):
    args = dict(num_gpu_blocks=4, enable_caching=True, hash_block_size=4) | kwargs
    with pytest.raises(InvalidFieldError):
        BlockPool(**args)


# ---------------------------------------------------------------- model-based


class PoolMachine(RuleBasedStateMachine):
    """Drives the pool with random operations and checks the queue order against a list model."""

    N = 9

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(self.N, True, 4)
        self.queue = list(range(1, self.N))  # model of the free queue
        self.ref = [0] * self.N
        self.hashed: dict[int, bytes] = {}
        self.counter = 0

    @rule(n=st.integers(0, 4))
    def allocate(self, n):
        if n > len(self.queue):
            with pytest.raises(NotEnoughFreeBlocksError):
                self.pool.get_new_blocks(n)
            return
        got = [b.block_id for b in self.pool.get_new_blocks(n)]
        assert got == self.queue[:n]
        self.queue = self.queue[n:]
        for bid in got:
            self.ref[bid] = 1
            self.hashed.pop(bid, None)

    @precondition(lambda self: any(self.ref[1:]))
    @rule(data=st.data())
    def free_some(self, data):
        held = [i for i in range(1, self.N) if self.ref[i] > 0]
        chosen = data.draw(st.lists(st.sampled_from(held), unique=True, min_size=1))
        self.pool.free_blocks([self.pool.blocks[i] for i in chosen])
        first, last = [], []
        for bid in chosen:
            self.ref[bid] -= 1
            if self.ref[bid] == 0:
                (last if bid in self.hashed else first).append(bid)
        self.queue = first + self.queue + last

    @precondition(lambda self: any(self.ref[i] > 0 and i not in self.hashed for i in range(1, self.N)))
    @rule(data=st.data())
    def cache_one(self, data):
        cands = [i for i in range(1, self.N) if self.ref[i] > 0 and i not in self.hashed]
        bid = data.draw(st.sampled_from(cands))
        self.counter += 1
        h = b"h%d" % self.counter
        self.pool.cache_full_blocks([h], [self.pool.blocks[bid]], 0, 1, 4, 0)
        self.hashed[bid] = h

    @precondition(lambda self: any(self.ref[i] == 0 for i in self.hashed))
    @rule(data=st.data())
    def hit_cached_free_block(self, data):
        bid = data.draw(st.sampled_from(sorted(i for i in self.hashed if self.ref[i] == 0)))
        assert self.pool.get_cached_block(self.hashed[bid], [0]) == [self.pool.blocks[bid]]
        self.pool.touch([self.pool.blocks[bid]])
        self.queue.remove(bid)
        self.ref[bid] = 1

    @rule()
    def reset(self):
        ok = self.pool.reset_prefix_cache()
        assert ok == (not any(self.ref[1:]))
        if ok:
            self.hashed.clear()

    @invariant()
    def matches_model(self):
        assert _queue(self.pool) == self.queue
        assert [b.ref_cnt for b in self.pool.blocks] == self.ref
        for bid in range(1, self.N):
            assert (self.pool.blocks[bid].block_hash is not None) == (bid in self.hashed)
        self.pool.check_invariants()


PoolMachine.TestCase.settings = __import__("hypothesis").settings(
    max_examples=profile_examples(30, 100), stateful_step_count=30, deadline=None)
test_pool_state_machine = PoolMachine.TestCase
