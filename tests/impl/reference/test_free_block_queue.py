"""FreeKVCacheBlockQueue: order of popleft/append/prepend/remove and its invariants."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvref.impl.reference.free_block_queue import FreeKVCacheBlockQueue
from kvref.impl.reference.kv_cache_block import KVCacheBlock


def _ids(q: FreeKVCacheBlockQueue) -> list[int]:
    return [b.block_id for b in q.iter_blocks()]


def test_initial_order_is_block_id_order():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert _ids(q) == [0, 1, 2, 3, 4] and q.num_free_blocks == 5
    q.check_invariants()


def test_prepend_n_keeps_given_order_at_front_and_append_n_at_back():
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeKVCacheBlockQueue(blocks[:2])
    q.prepend_n([blocks[4], blocks[3]])
    q.append_n([blocks[5], blocks[2]])
    assert _ids(q) == [4, 3, 0, 1, 5, 2]
    q.check_invariants()


def test_remove_from_middle_and_popleft_n():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[2])
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None
    assert [b.block_id for b in q.popleft_n(2)] == [0, 1]
    assert _ids(q) == [3, 4] and q.num_free_blocks == 2
    assert q.popleft().block_id == 3
    q.check_invariants()


def test_popleft_on_empty_queue_raises():
    q = FreeKVCacheBlockQueue([])
    with pytest.raises(IndexError):
        q.popleft()
    q.check_invariants()


def test_iter_blocks_after_cursor():
    blocks = [KVCacheBlock(i) for i in range(4)]
    q = FreeKVCacheBlockQueue(blocks)
    assert [b.block_id for b in q.iter_blocks_after(blocks[1])] == [2, 3]
    assert [b.block_id for b in q.iter_blocks_after(None)] == [0, 1, 2, 3]


@given(st.lists(st.tuples(st.sampled_from(["pop", "append", "prepend", "remove"]),
                          st.integers(0, 5)), max_size=40))
def test_queue_matches_a_python_list_model(ops):
    blocks = [KVCacheBlock(i) for i in range(8)]
    q = FreeKVCacheBlockQueue(blocks)
    model = list(range(8))
    for op, k in ops:
        outside = [i for i in range(8) if i not in model]
        if op == "pop":
            k = min(k, len(model))
            assert [b.block_id for b in q.popleft_n(k)] == model[:k]
            model = model[k:]
        elif op == "append" and outside:
            chosen = outside[: k + 1]
            q.append_n([blocks[i] for i in chosen])
            model += chosen
        elif op == "prepend" and outside:
            chosen = outside[-(k + 1):]
            q.prepend_n([blocks[i] for i in chosen])
            model = chosen + model
        elif op == "remove" and model:
            victim = model[k % len(model)]
            q.remove(blocks[victim])
            model.remove(victim)
        assert _ids(q) == model
        q.check_invariants()
