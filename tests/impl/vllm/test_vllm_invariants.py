"""kvref's invariants read from vLLM's own objects catch drift that no observation comparison sees.

Each test builds real vLLM objects through kvref's adapters, plants one internal drift in-process
(a ref count, a free-queue back link, a counter that should have been popped, a table slot, a
scheduler queue), asserts that everything the conformance harnesses *observe* (block ids, free
count, free-queue order, cached hashes, snapshots) is unchanged — so a comparison with the
reference could not see it yet — and that the adapter's ``check_invariants`` names the rule.
"""

from __future__ import annotations

import pytest
from kvref.impl.interface import PoolConfig
from kvref.impl.request import Request, RequestStatus
from kvref.spec.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_mods():
    require_vllm()
    from kvref.impl.vllm import invariants, kv_cache_manager

    return kv_cache_manager, invariants


def _pool(num_blocks=12, swa=False) -> PoolConfig:
    groups = [KVCacheGroupSpec(("full",), FullAttentionSpec(block_size=2, num_kv_heads=1, head_size=4,
                                                            dtype="float16"))]
    if swa:
        groups.append(KVCacheGroupSpec(("swa",), SlidingWindowSpec(block_size=2, num_kv_heads=1, head_size=4,
                                                                   dtype="float16", sliding_window=2)))
    return PoolConfig(num_blocks=num_blocks, groups=tuple(groups), max_model_len=32, scheduler_block_size=2,
                      hash_block_size=2)


def _observe(m, rids):
    return ({r: m.get_block_ids(r) for r in rids}, m.get_num_free_blocks(), m.free_block_queue(), m.cached_blocks())


def _manager_with_requests(kv, swa=False):
    m = kv.VllmKVCacheManager(_pool(num_blocks=20 if swa else 12, swa=swa))
    a = Request("a", list(range(7)), max_tokens=4)
    assert m.allocate_slots(a, 7) is not None
    a.num_computed_tokens = 7
    a.status = RequestStatus.RUNNING
    b = Request("b", [9, 9, 9], max_tokens=4)
    assert m.allocate_slots(b, 3) is not None
    b.num_computed_tokens = 3
    b.status = RequestStatus.RUNNING
    m.check_invariants()  # clean state passes
    return m, a, b


def _assert_invisible_and_caught(m, before, rule, vllm_mods):
    _, inv = vllm_mods
    assert _observe(m, ("a", "b")) == before, "the planted drift changed an observation: not a state-only drift"
    with pytest.raises(inv.VllmStateError, match=rule):
        m.check_invariants()


def test_ref_count_drift_is_caught(vllm_mods):
    kv, _ = vllm_mods
    m, _, _ = _manager_with_requests(kv)
    before = _observe(m, ("a", "b"))
    held = m._pool.blocks[m.get_block_ids("a")[0][0]]
    held.ref_cnt += 1  # a leaked reference: the block would never be freed
    _assert_invisible_and_caught(m, before, "I9", vllm_mods)


def test_free_queue_back_link_drift_is_caught(vllm_mods):
    kv, _ = vllm_mods
    m, _, _ = _manager_with_requests(kv)
    before = _observe(m, ("a", "b"))
    q = m._pool.free_block_queue
    second = q.fake_free_list_head.next_free_block.next_free_block
    second.prev_free_block = q.fake_free_list_head  # forward walk (what get_all_free_blocks reads) intact
    _assert_invisible_and_caught(m, before, "I5", vllm_mods)


def test_stale_link_on_a_held_block_is_caught(vllm_mods):
    kv, _ = vllm_mods
    m, _, _ = _manager_with_requests(kv)
    before = _observe(m, ("a", "b"))
    held = m._pool.blocks[m.get_block_ids("b")[0][0]]
    held.next_free_block = m._pool.free_block_queue.fake_free_list_tail  # a half-done remove()
    _assert_invisible_and_caught(m, before, "I5", vllm_mods)


def test_cached_block_count_kept_after_free_is_caught(vllm_mods):
    kv, _ = vllm_mods
    m, _, b = _manager_with_requests(kv)
    mgr = m.vllm_manager.coordinator.single_type_managers[0]
    kept = mgr.num_cached_block["b"]
    m.free(b)
    b.status = RequestStatus.PREEMPTED
    before = _observe(m, ("a",))
    mgr.num_cached_block["b"] = kept  # the pop in free() skipped (catalogue: stm.free_keeps_cached_count)
    assert _observe(m, ("a",)) == before
    with pytest.raises(vllm_mods[1].VllmStateError, match="M2"):
        m.check_invariants()


def test_null_block_ref_count_drift_is_caught(vllm_mods):
    kv, _ = vllm_mods
    m, _, _ = _manager_with_requests(kv)
    before = _observe(m, ("a", "b"))
    m._pool.null_block.ref_cnt = 1  # touched like a real block
    _assert_invisible_and_caught(m, before, "I2", vllm_mods)


def test_null_slot_after_a_real_block_in_a_window_table_is_caught(vllm_mods):
    kv, _ = vllm_mods
    m, _, _ = _manager_with_requests(kv, swa=True)
    swa = m.vllm_manager.coordinator.single_type_managers[1]
    table = swa.req_to_blocks["a"]
    assert len(table) >= 3
    # swap a null slot in behind a real block, and keep the counts exact (the freed block is queued)
    freed = table[1]
    table[1] = m._pool.null_block
    freed.ref_cnt -= 1
    m._pool.free_block_queue.prepend_n([freed])
    m._requests.clear()  # M6 here is about null placement, not about spanning computed tokens
    with pytest.raises(vllm_mods[1].VllmStateError, match="M6: request 'a' group 1"):
        m.check_invariants()


def test_table_shorter_than_computed_tokens_is_caught(vllm_mods):
    kv, _ = vllm_mods
    m, a, _ = _manager_with_requests(kv)
    before = _observe(m, ("a", "b"))
    a.num_computed_tokens = 9  # the caller believes 9 tokens have KV; 4 blocks of 2 hold 8
    _assert_invisible_and_caught(m, before, "do not span", vllm_mods)


def test_block_pool_driver_reads_vllm_links(vllm_mods):
    require_vllm()
    from kvref.impl.vllm.block_pool import VllmBlockPoolDriver

    d = VllmBlockPoolDriver(8, 2)
    d.check_invariants()
    before = d.free_queue()
    last = d.pool.free_block_queue.fake_free_list_tail.prev_free_block
    last.prev_free_block = last  # a self-loop backwards only
    assert d.free_queue() == before
    with pytest.raises(vllm_mods[1].VllmStateError, match="I5"):
        d.check_invariants()


def test_scheduler_preempted_request_with_computed_tokens_is_caught(vllm_mods):
    from kvref.impl.scheduler_types import SchedulerConfig
    from kvref.impl.vllm.scheduler import VllmEnv, VllmScheduler

    cfg = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4)
    pool = PoolConfig(num_blocks=8, groups=(KVCacheGroupSpec(("full",), FullAttentionSpec(
        block_size=4, num_kv_heads=1, head_size=8, dtype="float16")),), max_model_len=16, scheduler_block_size=4,
        hash_block_size=4, max_in_flight_tokens=cfg.max_in_flight_tokens)
    s = VllmScheduler(pool, cfg, VllmEnv())
    s.add_request(Request("x", list(range(6)), max_tokens=3))
    s.add_request(Request("y", list(range(20, 25)), max_tokens=3))
    s.schedule()
    s.check_invariants()
    v = s.scheduler
    victim = v.running[-1]
    # what _preempt_request does, minus the reset of num_computed_tokens (sched.preempt_keeps_computed_tokens)
    v.running.remove(victim)
    v.kv_cache_manager.free(victim)
    from vllm.v1.request import RequestStatus as VS

    victim.status = VS.PREEMPTED
    v.waiting.prepend_request(victim)
    assert victim.num_computed_tokens > 0
    with pytest.raises(vllm_mods[1].VllmStateError, match="Q3"):
        s.check_invariants()
    victim.num_computed_tokens = 0
    s.check_invariants()
    v.running.append(v.running[0])  # the same request twice in running
    with pytest.raises(vllm_mods[1].VllmStateError, match="Q1"):
        s.check_invariants()


def test_block_in_two_groups_tables_is_caught(vllm_mods):
    """vLLM #33775's symptom: one group's allocation took a block another group then holds as a hit."""
    kv, _ = vllm_mods
    m, _, _ = _manager_with_requests(kv, swa=True)
    g0, g1 = m.vllm_manager.coordinator.single_type_managers
    shared = g0.req_to_blocks["b"][0]
    dropped = g1.req_to_blocks["b"][0]
    g1.req_to_blocks["b"][0] = shared  # keep ref counts exact: shared gains a holder, dropped loses one
    shared.ref_cnt += 1
    dropped.ref_cnt -= 1
    m._pool.free_block_queue.prepend_n([dropped])
    with pytest.raises(vllm_mods[1].VllmStateError, match="M8: block .* group 0's and group 1's"):
        m.check_invariants()
