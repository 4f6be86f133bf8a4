"""T7 observed on vLLM's own manager: a step never takes more blocks than its check counted.

PR 40027 / #45856 (the admission cap also clamping the per-step predictor) changes nothing a
comparison sees while the pool has blocks to spare: ``allocate_new_blocks`` silently takes the
blocks the predictor forgot. The adapters' :class:`~kvref.impl.vllm.allocation_watch.AllocationWatch`
reads both numbers inside vLLM, so the fault is a finding on the first long sliding-window step,
with a pool far from full.
"""

from __future__ import annotations

import pytest
from kvref.impl.interface import PoolConfig
from kvref.impl.request import Request, RequestStatus
from kvref.spec.kv_cache_interface import KVCacheGroupSpec, SlidingWindowSpec

from tests.vllm_env import require_vllm
from tests.vllm_faults import planted_vllm_fault

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def kv():
    require_vllm()
    from kvref.impl.vllm import kv_cache_manager
    from kvref.impl.vllm.loader import load_vllm

    load_vllm()
    return kv_cache_manager


def _decode_long_window_request(kv, steps: int = 24):
    """One sliding-window request decoding well past its admission cap, on a pool with room to spare."""
    spec = SlidingWindowSpec(block_size=2, num_kv_heads=1, head_size=4, dtype="float16", sliding_window=3)
    pool = PoolConfig(num_blocks=40, groups=(KVCacheGroupSpec(("swa",), spec),), max_model_len=64,
                      scheduler_block_size=2, hash_block_size=2, max_in_flight_tokens=2)
    m = kv.VllmKVCacheManager(pool)
    r = Request("r", list(range(2)), max_tokens=steps + 4)
    assert m.allocate_slots(r, 2) is not None
    r.num_computed_tokens, r.status = 2, RequestStatus.RUNNING
    m.check_invariants()
    for i in range(steps):
        r.output_token_ids.append(100 + i)
        assert m.allocate_slots(r, 1) is not None, "the pool has room: every step is served"
        r.num_computed_tokens += 1
        m.check_invariants()
        assert m.get_num_free_blocks() > 10
    return m


def test_clean_vllm_takes_what_it_counted(kv):
    m = _decode_long_window_request(kv)
    assert m._allocation_watch.steps_checked == 25  # the prefill and every decode step were compared
    assert not m._allocation_watch.violations


def test_predictor_clamped_every_step_is_flagged_with_room_to_spare(kv):
    from kvref.impl.vllm.invariants import VllmStateError

    with planted_vllm_fault("stm.pr40027_cap_every_step"), pytest.raises(VllmStateError, match=r"M3 \(T7\): .*took 1 blocks"):
        _decode_long_window_request(kv)


def test_dropped_evictable_hits_term_is_flagged(kv):
    """The same watch on another under-count of the class: prefix hits sitting in the free queue
    left out of the predictor (``stm.evictable_hits_uncounted``)."""
    from kvref.impl.vllm.invariants import VllmStateError
    from kvref.spec.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=2, num_kv_heads=1, head_size=4, dtype="float16")
    pool = PoolConfig(num_blocks=20, groups=(KVCacheGroupSpec(("full",), spec),), max_model_len=32,
                      scheduler_block_size=2, hash_block_size=2)

    def run():
        m = kv.VllmKVCacheManager(pool)
        a = Request("a", list(range(8)), max_tokens=2)
        assert m.allocate_slots(a, 8) is not None
        a.num_computed_tokens, a.status = 8, RequestStatus.RUNNING
        m.free(a)  # its four full blocks stay cached, in the free queue
        m.forget("a")
        b = Request("b", list(range(8)) + [50], max_tokens=2)
        hit_ids, hit_tokens = m.get_computed_blocks(b)
        assert hit_tokens == 8
        assert m.allocate_slots(b, 1, hit_tokens, hit_ids) is not None
        m.check_invariants()
        return m

    assert run()._allocation_watch.steps_checked == 2
    with planted_vllm_fault("stm.evictable_hits_uncounted"), pytest.raises(VllmStateError, match="M3"):
        run()


def test_hits_touched_after_an_allocation_are_flagged_on_any_free_queue(kv):
    """#33775 re-planted (each group touches its hits and at once allocates its external blocks):
    M10 names the order on the first hybrid admission with hits and external tokens, though here
    the later group's hits are not where the allocation pops (nothing is evicted, the tables agree)."""
    from kvref.impl.vllm.invariants import VllmStateError
    from kvref.spec.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=2, num_kv_heads=1, head_size=4, dtype="float16")
    pool = PoolConfig(num_blocks=30, groups=(KVCacheGroupSpec(("a",), spec), KVCacheGroupSpec(("b",), spec)),
                      max_model_len=32, scheduler_block_size=2, hash_block_size=2)

    def run():
        m = kv.VllmKVCacheManager(pool)
        a = Request("a", list(range(8)), max_tokens=2)
        assert m.allocate_slots(a, 8) is not None
        a.num_computed_tokens, a.status = 8, RequestStatus.RUNNING
        m.free(a)  # four full blocks per group stay cached, at the free queue's tail
        m.forget("a")
        b = Request("b", list(range(8)) + list(range(50, 56)), max_tokens=2)
        hit_ids, hit_tokens = m.get_computed_blocks(b)
        assert hit_tokens == 8 and all(len(ids) == 4 for ids in hit_ids)
        assert m.allocate_slots(b, 2, hit_tokens, hit_ids, num_external_computed_tokens=4) is not None
        m.check_invariants()
        return m

    run()
    with planted_vllm_fault("coord.pre33775_external_before_touch"), pytest.raises(VllmStateError, match="M10"):
        run()


class _FakePool:
    def __init__(self, free: int) -> None:
        self.free = free

    def get_num_free_blocks(self) -> int:
        return self.free

    def touch(self, blocks):
        return None

    def get_new_blocks(self, n: int):
        self.free -= n
        return [object()] * n


class _FakeManager:
    """Just the four calls the watch wraps: a predictor that answers ``count`` and an allocation
    that takes ``take`` blocks from the free queue."""

    def __init__(self, count: int, take: int) -> None:
        self.block_pool = _FakePool(10)
        self.coordinator = self
        self.count, self.take = count, take

    def get_num_blocks_to_allocate(self, *args, **kwargs) -> int:
        return self.count

    def allocate_slots(self, request, *args, **kwargs):
        self.coordinator.get_num_blocks_to_allocate()
        return self.block_pool.get_new_blocks(self.take)


@pytest.mark.parametrize(("count", "take", "flagged"), [(-1, 0, False), (-2, 0, False), (0, 0, False), (-1, 1, True),
                                                         (0, 1, True), (2, 2, False), (2, 3, True)])
def test_a_count_below_zero_bounds_the_step_at_zero(count, take, flagged):
    """vLLM's Mamba "align" predictor may count below zero (a request holding more blocks than its
    chunk needs); taking nothing then is no finding, taking any block is (the hybrid sum can hide
    one group's need behind another's negative count)."""
    from types import SimpleNamespace

    from kvref.impl.vllm.allocation_watch import AllocationWatch

    mgr = _FakeManager(count, take)
    watch = AllocationWatch(mgr)
    mgr.allocate_slots(SimpleNamespace(request_id="r1"))
    assert watch.steps_checked == 1
    assert bool(watch.violations) is flagged, watch.violations


class _FakeGroup:
    def __init__(self, pool: _FakePool, count: int, take: int) -> None:
        self.pool, self.count, self.take = pool, count, take

    def get_num_blocks_to_allocate(self, *args, **kwargs) -> int:
        return self.count

    def allocate_new_blocks(self, *args, **kwargs):
        return self.pool.get_new_blocks(self.take)


class _FakeHybrid:
    """A coordinator that sums its groups' counts (vLLM's) over groups answering ``(count, take)``."""

    def __init__(self, free: int, groups: list[tuple[int, int]]) -> None:
        self.block_pool = _FakePool(free)
        self.single_type_managers = [_FakeGroup(self.block_pool, c, t) for c, t in groups]
        self.coordinator = self

    def get_num_blocks_to_allocate(self, *args, **kwargs) -> int:
        return sum(g.get_num_blocks_to_allocate() for g in self.single_type_managers)

    def allocate_slots(self, request, *args, **kwargs):
        if self.coordinator.get_num_blocks_to_allocate() > self.block_pool.get_num_free_blocks():
            return None
        return [g.allocate_new_blocks() for g in self.single_type_managers]


@pytest.mark.parametrize(("free", "groups", "flagged"), [
    (10, [(2, 3), (2, 1)], "group 0 took 3 blocks where its own count was 2"),  # the sum (4) hides it
    (10, [(0, 0), (-1, 0)], None),  # a negative count taking nothing, no other group's need
    # netted with room to spare: each group within its own count, the step over the sum (M3)
    (10, [(1, 1), (-1, 0)], "M3 (T7): allocate_slots('r1') took 1 blocks from the free queue where its per-step "
                            "check counted 0"),
    (10, [(3, 3), (0, 0), (1, 1)], None),
    (0, [(1, 1), (-1, 0)], "passed its admission check (counted 0, per-group {0: 1, 1: -1}, free 0)"),
])
def test_per_group_counts_bound_each_groups_take(free, groups, flagged):
    """M3g: each group's take is bounded by its own count (or 0 below zero), which the summed
    bound (M3) misses when another group over-counts; a step that passed the summed check and then
    asks an empty pool for blocks is named before vLLM raises (M3 never sees a step that raised)."""
    from types import SimpleNamespace

    from kvref.impl.vllm.allocation_watch import AllocationWatch

    mgr = _FakeHybrid(free, groups)
    watch = AllocationWatch(mgr)
    mgr.allocate_slots(SimpleNamespace(request_id="r1"))  # the fake pool lends below zero where vLLM raises
    assert watch.steps_checked == 1
    if flagged is None:
        assert not watch.violations, watch.violations
    else:
        assert any(flagged in v for v in watch.violations), watch.violations
