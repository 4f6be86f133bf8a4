"""Calls in the wrong order or with objects from the wrong place: a ``ValueError`` subclass and
the state unchanged (pickled bytes equal, ``check_invariants()`` passes) — or, where vLLM allows
the call, a state that still passes ``check_invariants()``. Never an ``AssertionError`` from an
internal invariant reached through a public call."""

from __future__ import annotations

import pytest
from kvref.impl.reference.kv_cache_manager import KVCacheBlocks, KVCacheManager
from kvref.impl.reference.scheduler import Scheduler
from kvref.impl.request import Request
from kvref.impl.scheduler_types import ModelOutput, SchedulerConfig

from tests.hardening.api_targets import GROUP, pool_config, snapshot


def _rejected_without_change(obj, check_invariants, call):
    before = snapshot(obj)
    with pytest.raises(ValueError) as info:
        call()
    assert str(info.value)
    assert snapshot(obj) == before, "the call raised after changing state"
    check_invariants()


def _manager():
    m = KVCacheManager(pool_config())
    r0 = Request("r0", list(range(9)), max_tokens=4)
    assert m.allocate_slots(r0, 9) is not None
    return m, r0


def _scheduler():
    pc = pool_config(max_in_flight_tokens=16)
    s = Scheduler(pc, SchedulerConfig(max_num_batched_tokens=16))
    s.add_request(Request("a", list(range(6)), max_tokens=3))
    return s


def test_schedule_twice_without_update_keeps_invariants():
    s = _scheduler()
    out1 = s.schedule()
    try:
        s.schedule()
    except ValueError:
        pass
    s.check_invariants()
    s.update_from_output(out1, ModelOutput({r.request_id: [1] for r in out1.scheduled}))
    s.check_invariants()


def test_update_twice_with_the_same_output_is_rejected():
    s = _scheduler()
    out = s.schedule()
    s.update_from_output(out, ModelOutput({r.request_id: [1] for r in out.scheduled}))
    _rejected_without_change(s, s.check_invariants, lambda: s.update_from_output(out, ModelOutput({})))


def test_update_with_another_schedulers_output_is_rejected():
    s, other = _scheduler(), _scheduler()
    s.schedule()
    foreign = other.schedule()
    _rejected_without_change(s, s.check_invariants, lambda: s.update_from_output(foreign, ModelOutput({})))


def test_add_the_same_request_twice_is_rejected():
    s = _scheduler()
    _rejected_without_change(s, s.check_invariants, lambda: s.add_request(Request("a", [1, 2], max_tokens=1)))


@pytest.mark.parametrize("which", ["uncached", "null", "foreign", "in-use-uncached"])
def test_fake_prefix_hit_is_rejected(which):
    """``new_computed_blocks`` must be a real hit: cached blocks of this pool, as many as claimed."""
    m, _ = _manager()
    r1 = Request("r1", list(range(9)), max_tokens=4)
    pool = m.block_pool
    if which == "uncached":
        blocks = [pool.blocks[pool.free_block_ids()[0]]]
    elif which == "null":
        blocks = [pool.null_block]
    elif which == "foreign":
        blocks = [KVCacheManager(pool_config()).block_pool.blocks[1]]
    else:
        blocks = [b for b in pool.blocks if b.ref_cnt and b.block_hash is None][:1]
        assert blocks
    groups = tuple([blocks] + [[] for _ in range(m.num_kv_cache_groups - 1)])
    if which == "foreign":  # create_kv_cache_blocks refuses them already; a hand-built KVCacheBlocks too
        _rejected_without_change(m, m.check_invariants, lambda: m.create_kv_cache_blocks(groups))
        hit = KVCacheBlocks(groups)
    else:
        hit = m.create_kv_cache_blocks(groups)
    _rejected_without_change(m, m.check_invariants, lambda: m.allocate_slots(r1, 5, 4, hit))


def test_hit_tokens_without_blocks_are_rejected():
    m, _ = _manager()
    r1 = Request("r1", list(range(9)), max_tokens=4)
    _rejected_without_change(m, m.check_invariants, lambda: m.allocate_slots(r1, 5, 4, None))


def test_free_of_an_unknown_request_is_a_no_op():
    m, _ = _manager()
    before = snapshot(m)
    m.free(Request("nobody", [1, 2], max_tokens=1))
    assert snapshot(m) == before
    m.check_invariants()


def test_simple_offload_meta_before_binding_a_pool_is_rejected():
    from kvref.impl.reference.offload.simple_cpu_offload_scheduler import (
        SimpleCPUOffloadScheduler,
        SimpleOffloadStep,
    )

    sched = SimpleCPUOffloadScheduler((GROUP,), num_cpu_blocks=4, max_model_len=32, scheduler_block_size=4,
                                      hash_block_size=4)
    step = SimpleOffloadStep() if not SimpleOffloadStep.__dataclass_fields__ else _empty_step(SimpleOffloadStep)
    before = snapshot(sched)
    with pytest.raises(ValueError):
        sched.build_connector_meta(step)
    assert snapshot(sched) == before


def _empty_step(cls):
    import dataclasses

    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            kwargs[f.name] = {} if "dict" in str(f.type) else []
    return cls(**kwargs)


# ---------------------------------------------------------------- random call sequences

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tests.conftest import profile_examples

_COUNTS = st.one_of(st.integers(-2, 40), st.sampled_from([10**30, None, "3", 2.0]))


class ManagerMisuse(RuleBasedStateMachine):
    """Valid and invalid calls in any order on one reference KV cache manager: every call either
    works or raises a ValueError subclass with the state unchanged; invariants hold throughout."""

    def __init__(self) -> None:
        super().__init__()
        self.m = KVCacheManager(pool_config())
        self.requests = {f"r{i}": Request(f"r{i}", [i % 3] * 5 + list(range(4)), max_tokens=4) for i in range(3)}

    def _call(self, fn, *args, **kwargs):
        before = snapshot(self.m)
        try:
            return fn(*args, **kwargs)
        except ValueError as exc:
            assert str(exc)
            assert snapshot(self.m) == before, f"{fn.__name__}{args} raised after changing state"
            return None

    @rule(rid=st.sampled_from(["r0", "r1", "r2"]), n=_COUNTS, hit=st.booleans(), fit=st.booleans(),
          reserved=_COUNTS, lookahead=_COUNTS)
    def allocate(self, rid, n, hit, fit, reserved, lookahead):
        r = self.requests[rid]
        blocks, num_hit = (None, 0)
        if hit and r.num_computed_tokens == 0:
            got = self._call(self.m.get_computed_blocks, r)
            if got is not None:
                blocks, num_hit = got[0], got[1]
        out = self._call(self.m.allocate_slots, r, n, num_hit, blocks, num_lookahead_tokens=lookahead,
                         full_sequence_must_fit=fit, reserved_blocks=reserved)
        if out is not None and type(n) is int:
            r.num_computed_tokens += num_hit + n

    @rule(rid=st.sampled_from(["r0", "r1", "r2", "ghost"]))
    def free(self, rid):
        r = self.requests.get(rid) or Request(rid, [1, 2], max_tokens=1)
        self._call(self.m.free, r)
        r.num_computed_tokens = 0

    @rule(ids=st.one_of(st.lists(st.integers(-1, 12), max_size=3), st.just(5), st.just(None)))
    def evict(self, ids):
        self._call(self.m.evict_blocks, ids)

    @rule(rid=st.sampled_from(["r0", "r1", "r2", "ghost"]), n=_COUNTS)
    def remove_skipped(self, rid, n):
        self._call(self.m.remove_skipped_blocks, rid, n)

    @rule()
    def reset(self):
        self._call(self.m.reset_prefix_cache)

    @invariant()
    def holds(self):
        self.m.check_invariants()


ManagerMisuse.TestCase.settings = settings(max_examples=profile_examples(30, 150), stateful_step_count=25,
                                           deadline=None)
test_manager_misuse_sequences = ManagerMisuse.TestCase


class SchedulerMisuse(RuleBasedStateMachine):
    """The scheduler driven in any order — steps scheduled beyond the in-flight limit, outputs
    updated twice, out of order or never, aborts of unknown or finished requests, duplicate ids —
    with valid calls in between: ValueError with the state unchanged, or success; invariants hold."""

    def __init__(self) -> None:
        super().__init__()
        self.async_ = False
        self.s = None
        self.outputs: list = []  # every output ever returned (stale ones included)
        self.next_id = 0

    @rule(async_=st.booleans())
    def start(self, async_):
        if self.s is None:
            cfg = SchedulerConfig(max_num_batched_tokens=8, async_scheduling=async_)
            self.s = Scheduler(pool_config(max_in_flight_tokens=cfg.max_in_flight_tokens), cfg)

    def _call(self, fn, *args):
        before = snapshot(self.s)
        try:
            return fn(*args)
        except ValueError as exc:
            assert str(exc)
            assert snapshot(self.s) == before, f"{fn.__name__} raised after changing state"
            return None

    @rule(n=st.integers(1, 40), dup=st.booleans())
    def add(self, n, dup):
        if self.s is None:
            return
        rid = f"q{self.next_id - 1 if dup and self.next_id else self.next_id}"
        self.next_id += not dup
        self._call(self.s.add_request, Request(rid, [n % 5] * n, max_tokens=3))

    @rule()
    def schedule(self):
        if self.s is not None:
            out = self._call(self.s.schedule)
            if out is not None:
                self.outputs.append(out)

    @rule(which=st.integers(0, 5), token=st.integers(-1, 9))
    def update(self, which, token):
        if self.s is None or not self.outputs:
            return
        out = self.outputs[which % len(self.outputs)]
        self._call(self.s.update_from_output, out, ModelOutput({r.request_id: [token] for r in out.scheduled}))

    @rule(ids=st.one_of(st.lists(st.sampled_from(["q0", "q1", "q2", "zz"]), max_size=3), st.just("q0"), st.just(7)))
    def abort(self, ids):
        if self.s is not None:
            self._call(self.s.finish_requests, ids)

    @invariant()
    def holds(self):
        if self.s is not None:
            self.s.check_invariants()


SchedulerMisuse.TestCase.settings = settings(max_examples=profile_examples(30, 150), stateful_step_count=30,
                                             deadline=None)
test_scheduler_misuse_sequences = SchedulerMisuse.TestCase


def test_a_scope_too_deep_to_copy_is_an_input_error_not_a_violation(monkeypatch):
    """A pool of a few hundred blocks overflows the explorer's pickled state copies: that is the
    tool's limit (``InvalidFieldError``), where it used to be reported as a violation of the system."""
    from dataclasses import replace

    import kvref.models.explorer.kv as explorer_kv
    from kvref.models.explorer.engine import explore

    with pytest.raises(ValueError, match="scope"):
        replace(explorer_kv.SCOPES["default"], num_blocks=400)  # the scope refuses it up front
    monkeypatch.setattr(explorer_kv, "MAX_SCOPE_BLOCKS", 10**6)
    scope = replace(explorer_kv.SCOPES["default"], num_blocks=400)
    with pytest.raises(ValueError, match="too large for the explorer"):
        explore(explorer_kv.KVSystem(scope), max_states=50)


@pytest.mark.parametrize("kind", ["reference", "torch"])
@pytest.mark.parametrize("hit", [((1,), ()), ((0,), (0,)), (None, None), "uncached"],
                         ids=["group-missing", "null", "none", "in-use-uncached"])
def test_fake_prefix_hit_by_block_ids_is_rejected(kind, hit):
    """The id-based adapters (``make_manager``): a hit must name cached blocks. The torch manager
    took blocks another request was writing (uncached) or only null placeholders as a hit; the
    reference adapter raised ``TypeError`` on a group that was None (found by Hypothesis)."""
    from tests.hardening.api_targets import _make

    m = _make(kind)
    r0 = Request("r0", list(range(9)), max_tokens=4)
    assert m.allocate_slots(r0, 9) is not None
    r1 = Request("r1", list(range(9)), max_tokens=4)
    if hit == "uncached":  # r0's third block in each group: allocated, written, never published
        hit = tuple((ids[2],) for ids in m.get_block_ids("r0"))
    _rejected_without_change(m, m.check_invariants, lambda: m.allocate_slots(r1, 5, 4, hit))


def test_simple_offload_rebinding_another_gpu_pool_is_rejected():
    """Found by the SimpleCPU misuse machine: a second ``bind_gpu_block_pool`` was accepted while
    a store held blocks of the first pool, and ``check_invariants()`` then failed."""
    from kvref.impl.reference.block_pool import BlockPool
    from kvref.models.offload.simple_cpu_world import SimpleOffloadConfig, SimpleOffloadWorld

    w = SimpleOffloadWorld(SimpleOffloadConfig(block_size=4, num_gpu_blocks=12, num_cpu_blocks=24), "reference")
    w.add_request(list(range(100, 113)))
    w.add_request(list(range(100, 113)))
    w.step(8)
    conn = w.b.conn
    _rejected_without_change(w.b, w.b.check_invariants, lambda: conn.bind_gpu_block_pool(BlockPool(12, True, 4)))
    conn.bind_gpu_block_pool(w.b.mgr.block_pool)  # the same pool again: nothing changes
    w.b.check_invariants()
