"""The reference HiSparse coordinator (issue #23): write-back, unpinning, page loss on reuse, the
per-step transfer budget, free, and the reuse-watching pool. Conformance with vLLM's own
``HiSparseCoordinator`` on generated programs is tests/conformance/test_hisparse_managers.py."""

from __future__ import annotations

import pytest

from kvref.impl.reference.hisparse_block_pool import ReuseWatchingBlockPool
from kvref.impl.reference.hisparse_pool import HiSparsePool
from kvref.impl.reference.hisparse_state import ACTIVE_TAIL_PAGES
from kvref.spec.errors import InvalidFieldError
from kvref.spec.hisparse import HiSparsePoolConfig


def _pool(num_gpu_blocks: int = 40, max_model_len: int = 16) -> HiSparsePool:
    return HiSparsePool(HiSparsePoolConfig(block_size=1, num_gpu_blocks=num_gpu_blocks, host_num_blocks=30,
                                           blocks_per_request=1, num_resident_groups=1,
                                           max_model_len=max_model_len, max_in_flight_tokens=max_model_len))


def _admit_hot(pool: HiSparsePool, rid: str, num_tokens: int) -> None:
    pool.require_hot(rid)
    counts = pool.get_num_blocks_to_allocate(rid, num_tokens, 0, 0, False)
    assert sum(counts) <= pool.gpu_pool.get_num_free_blocks()
    pool.allocate(rid, num_tokens, 0, 0)


def _write_back(pool: HiSparsePool, rid: str, num_tokens: int) -> list[tuple]:
    pool.advance_scheduled([(rid, num_tokens)])
    sent = pool.build_offload_command()
    done = {t[0]: 1 for t in sent}
    pool.update_spills(done, done)
    return sent


def test_completed_write_backs_unpin_all_but_the_active_tail():
    pool = _pool()
    _admit_hot(pool, "a", 8)
    row = pool.observe()["tables"][2]["a"]
    sent = _write_back(pool, "a", 8)
    assert [t[2] for t in sent] == [(b,) for b in row] and all(t[3] and not t[4] for t in sent)
    state = pool.observe()["request_states"]["a"]
    assert state["valid"] == list(range(8)) and state["ready"] == 8 and not state["pending"]
    assert state["unpinned"] == list(range(8 - ACTIVE_TAIL_PAGES))
    assert state["pinned_clean"] == list(range(8 - ACTIVE_TAIL_PAGES, 8))
    # unpinned blocks count as free, at the back of the queue, and are still read
    assert pool.observe()["gpu_free_queue"][-6:] == row[:6]
    assert pool.observe()["tables"][2]["a"] == row
    pool.check_invariants()


def test_a_transfer_holds_its_pins_until_every_worker_completed_it():
    pool = _pool()
    _admit_hot(pool, "a", 4)
    pool.advance_scheduled([("a", 4)])
    sent = pool.build_offload_command()
    tid, resident = sent[0][0], pool.gpu_pool.blocks[sent[0][2][0]]
    assert resident.ref_cnt == 2  # the table and the transfer
    pool.update_spills({tid: 2}, {tid: 1})  # two workers enqueued it, one finished
    assert resident.ref_cnt == 2 and tid in pool.coordinator.pending_spills
    pool.update_spills({}, {tid: 1})
    assert tid not in pool.coordinator.pending_spills
    assert 0 in pool.observe()["request_states"]["a"]["valid"]
    pool.check_invariants()


def test_reusing_an_unpinned_block_loses_the_page_and_asks_for_a_hot_region():
    pool = _pool(num_gpu_blocks=25)
    _admit_hot(pool, "a", 8)
    row = pool.observe()["tables"][2]["a"]
    _write_back(pool, "a", 8)
    pool.take_residency_updates(["a"])  # the worker now holds pages 0..7
    pool.allocate("b", 4, 0, 0)  # takes the free front, then the oldest unpinned block
    state = pool.observe()["request_states"]["a"]
    lost = [p for p, b in enumerate(pool.observe()["tables"][2]["a"]) if b == 0]
    held_by_b = set(pool.observe()["tables"][1]["b"]) | set(pool.observe()["tables"][2]["b"])
    assert lost and all(row[p] in held_by_b for p in lost)  # b was handed a's unpinned blocks
    assert set(lost) <= set(state["stale"]) and not set(lost) & set(state["unpinned"])
    assert "a" in pool.observe()["hot_required"][0]
    update = pool.take_residency_updates(["a"])["a"]
    assert update[0] == sorted(lost) and update[1] == [[0] * len(lost)]
    pool.check_invariants()


def test_the_transfers_planned_per_step_are_capped_by_max_model_len_pages():
    pool = _pool(max_model_len=6)
    _admit_hot(pool, "a", 6)
    _admit_hot(pool, "b", 6)
    pool.advance_scheduled([("a", 6), ("b", 6)])
    sent = pool.build_offload_command()
    assert len(sent) == 6  # max_model_len // block_size, across the step's requests
    assert [t[0] for t in sent] == list(range(6))


def test_free_releases_clean_pages_and_in_flight_transfers_keep_their_blocks():
    pool = _pool()
    _admit_hot(pool, "a", 6)
    pool.advance_scheduled([("a", 6)])
    sent = pool.build_offload_command()
    first = {sent[0][0]: 1}
    pool.update_spills(first, first)  # page 0 is clean; pages 1..5 in flight
    host_block = pool.host_pool.blocks[sent[1][1]]
    pool.free("a")
    assert "a" not in pool.coordinator.request_states and host_block.ref_cnt == 1
    pool.check_invariants()
    rest = {t[0]: 1 for t in sent[1:]}
    pool.update_spills(rest, rest)
    assert not pool.coordinator.pending_spills and host_block.ref_cnt == 0
    assert pool.gpu_pool.get_num_free_blocks() == pool.config.num_gpu_blocks - 1
    pool.check_invariants()


def test_reuse_watching_pool_fires_once_on_reuse_and_on_reset():
    pool = ReuseWatchingBlockPool(6, enable_caching=False, hash_block_size=1)
    blocks = pool.get_new_blocks(2)
    seen = []
    pool.unpin_blocks(blocks, seen.append)
    assert pool.free_block_ids()[-2:] == (1, 2) and pool.watched_block_ids() == (1, 2)
    taken = pool.get_new_blocks(3)  # the never-used front
    assert seen == [] and pool.watched_block_ids() == (1, 2)
    taken += pool.get_new_blocks(1)
    assert [b.block_id for b in seen] == [1] and pool.watched_block_ids() == (2,)
    assert pool.reset_prefix_cache() is False  # blocks in use: nothing fires
    pool.free_blocks(taken)
    assert pool.reset_prefix_cache() is True and [b.block_id for b in seen] == [1, 2]
    assert pool.watched_block_ids() == ()
    pool.check_invariants()


@pytest.mark.parametrize("call", [
    lambda p: p.coordinator.update_spills({0: -1}, {}),
    lambda p: p.coordinator.update_spills([0], {}),
    lambda p: p.coordinator.advance_scheduled([("a", -1)]),
    lambda p: p.gpu_pool.unpin_blocks([p.gpu_pool.blocks[1]], print),
    lambda p: p.gpu_pool.unpin_blocks([], "not callable"),
])
def test_bad_input_names_the_field(call):
    pool = _pool()
    with pytest.raises(InvalidFieldError):
        call(pool)
    pool.check_invariants()
