"""The reference scheduler on the reference KVCacheManager: rules one by one, and bad input.

Hand-picked cases with the block ids and orders vLLM 0.33.0 produces (checked against vLLM by
tests/conformance/test_scheduler_conformance.py on generated traces).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvref.impl.interface import PoolConfig
from kvref.impl.reference.scheduler import Scheduler
from kvref.impl.reference.scheduler_liveness import (align_split_stalls, drain_bound, liveness_guaranteed,
                                                     liveness_hazard, partial_hit_groups, startup_consistent,
                                                     steps_alone)
from kvref.impl.scheduler_types import ModelOutput, SchedulerConfig
from kvref.impl.request import Request, RequestStatus
from kvref.models.machines.scheduler import FakeModel, Lockstep, RequestSpec
from kvref.spec.errors import InvalidFieldError, KVRefError
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec, SlidingWindowSpec
from tests.conftest import profile_examples


def _pool(num_blocks: int = 40, max_model_len: int = 64, cfg: SchedulerConfig | None = None,
          swa: int | None = None, caching: bool = True, watermark: float = 0.0) -> PoolConfig:
    cfg = cfg or SchedulerConfig()
    groups = [KVCacheGroupSpec(("full",), FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8,
                                                            dtype="float16"))]
    if swa is not None:
        groups.append(KVCacheGroupSpec(("swa",), SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=8,
                                                                   dtype="float16", sliding_window=swa)))
    return PoolConfig(num_blocks=num_blocks, groups=tuple(groups), max_model_len=max_model_len,
                      scheduler_block_size=4, hash_block_size=4, max_in_flight_tokens=cfg.max_in_flight_tokens,
                      enable_caching=caching, watermark=watermark)


def _sched(cfg: SchedulerConfig | None = None, **pool_kw) -> Scheduler:
    cfg = cfg or SchedulerConfig()
    return Scheduler(_pool(cfg=cfg, **pool_kw), cfg)


class _Engine:
    """Sync engine: schedule, then settle with the fake model."""

    def __init__(self, s: Scheduler) -> None:
        self.s, self.model = s, FakeModel()

    def step(self):
        out = self.s.schedule()
        self.s.update_from_output(out, self.model.output(out))
        self.s.check_invariants()
        return out


def test_chunked_prefill_splits_a_prompt_by_the_token_budget():
    s = _sched(SchedulerConfig(max_num_batched_tokens=8))
    s.add_request(Request("a", list(range(20)), max_tokens=2))
    e = _Engine(s)
    steps = [(o.scheduled[0].num_scheduled_tokens, o.scheduled[0].is_prefill_chunk) for o in
             (e.step(), e.step(), e.step())]
    assert steps == [(8, True), (8, True), (4, False)]
    out = e.step()
    assert out.num_scheduled_tokens == {"a": 1} and out.finished_req_ids == frozenset()
    assert s.snapshot().requests == {}  # finished requests are dropped from the scheduler
    assert e.step().finished_req_ids == {"a"}  # reported by the next schedule, as in vLLM


def test_long_prefill_threshold_applies_only_when_another_request_is_eligible():
    cfg = SchedulerConfig(max_num_batched_tokens=32, long_prefill_token_threshold=6)
    s = _sched(cfg)
    s.add_request(Request("a", list(range(20))))
    assert s.schedule().num_scheduled_tokens == {"a": 20}
    s2 = _sched(cfg)
    s2.add_request(Request("a", list(range(20))))
    s2.add_request(Request("b", list(range(50, 70))))
    assert s2.schedule().num_scheduled_tokens == {"a": 6, "b": 6}


def test_without_chunked_prefill_a_prompt_over_the_remaining_budget_stops_admission():
    cfg = SchedulerConfig(max_num_batched_tokens=16, enable_chunked_prefill=False)
    s = _sched(cfg, max_model_len=16)
    s.add_request(Request("a", list(range(10))))
    s.add_request(Request("b", list(range(20, 30))))
    s.add_request(Request("c", [1, 2]))
    assert s.schedule().num_scheduled_tokens == {"a": 10}  # b does not fit the 6 left; c waits behind it


def test_prefix_hit_on_admission_reuses_blocks_and_counts_computed_tokens():
    s = _sched()
    e = _Engine(s)
    s.add_request(Request("a", list(range(12)), max_tokens=4))
    first = e.step().scheduled[0]
    s.add_request(Request("b", list(range(8)) + [99, 98], max_tokens=4))
    out = e.step()
    b = next(x for x in out.scheduled if x.request_id == "b")
    assert (b.kind, b.num_computed_tokens, b.num_scheduled_tokens) == ("new", 8, 2)
    assert b.block_ids[0][:2] == first.block_ids[0][:2]  # the two shared full blocks


def test_fcfs_preempts_the_last_running_request_and_requeues_it_at_the_head():
    # 8 usable blocks of 4 tokens; a and b each take 4 blocks with their prompt.
    cfg = SchedulerConfig(max_num_batched_tokens=64)
    s = _sched(cfg, num_blocks=9, max_model_len=32, caching=False)
    e = _Engine(s)
    s.add_request(Request("a", list(range(16)), max_tokens=2))
    s.add_request(Request("b", list(range(100, 116)), max_tokens=8))
    s.add_request(Request("c", [1, 2, 3], max_tokens=2))
    assert e.step().num_scheduled_tokens == {"a": 16, "b": 16}  # c: no block left, head-of-line
    out = e.step()  # a needs a 5th block: b (the last running) is preempted, nobody is admitted
    assert out.num_scheduled_tokens == {"a": 1} and out.preempted_req_ids == {"b"}
    snap = s.snapshot()
    assert snap.waiting == ("b", "c") and snap.running == ()  # a finished (max_tokens=2)
    b = snap.requests["b"]
    assert (b.status, b.num_computed_tokens, b.num_preemptions, len(b.output_token_ids)) == ("preempted", 0, 1, 1)
    out = e.step()
    assert [(x.request_id, x.kind, x.num_scheduled_tokens) for x in out.scheduled] == \
        [("b", "resumed", 17), ("c", "new", 3)]  # b recomputes its prompt and its one output


def test_priority_preempts_the_largest_priority_key_even_when_it_runs_first():
    cfg = SchedulerConfig(max_num_batched_tokens=64, policy="priority")
    s = _sched(cfg, num_blocks=9, max_model_len=32, caching=False)
    e = _Engine(s)
    s.add_request(Request("low", list(range(15)), max_tokens=8, priority=5, arrival_time=0.0))
    e.step()
    s.add_request(Request("high", list(range(100, 115)), max_tokens=8, priority=0, arrival_time=1.0))
    assert list(e.step().num_scheduled_tokens) == ["low", "high"]  # pool now full (4 + 4 blocks)
    out = e.step()
    # low (running[0]) needs a 5th block; the victim is the largest key: low itself. FCFS would
    # have preempted high (the last one). high then still decodes.
    assert out.num_scheduled_tokens == {"high": 1} and out.preempted_req_ids == {"low"}
    assert s.snapshot().waiting == ("low",) and s.snapshot().running == ("high",)


def test_head_of_line_hang_with_an_inconsistent_pool_and_not_with_a_consistent_one():
    """vLLM #39734: the full-sequence gate never passes, the queue never moves."""
    cfg = SchedulerConfig(max_num_batched_tokens=16)
    bad = _pool(num_blocks=12, max_model_len=64, cfg=cfg)
    assert not startup_consistent(bad, cfg)
    s = Scheduler(bad, cfg)
    s.add_request(Request("big", list(range(60)), max_tokens=2))
    s.add_request(Request("small", [1, 2], max_tokens=2))
    e = _Engine(s)
    for _ in range(30):
        assert e.step().scheduled == ()
    assert s.snapshot().waiting == ("big", "small")
    good = _pool(num_blocks=17, max_model_len=64, cfg=cfg)
    assert startup_consistent(good, cfg)
    d = Lockstep(good, cfg, {"ref": lambda p, c: Scheduler(p, c)})
    d.add(RequestSpec("big", tuple(range(60)), 2, 0, 0.0))
    d.add(RequestSpec("small", (1, 2), 2, 0, 1.0))
    d.drain()
    assert all(r.is_finished for r in d.requests["ref"].values())


def test_without_the_full_sequence_gate_the_big_request_is_chunk_prefilled_then_stalls():
    """``--no-scheduler-reserve-full-isl``: admitted chunk by chunk, it preempts itself when the pool
    runs out, is re-admitted from scratch, and so on — it never finishes either."""
    cfg = SchedulerConfig(max_num_batched_tokens=16, scheduler_reserve_full_isl=False)
    s = Scheduler(_pool(num_blocks=12, max_model_len=64, cfg=cfg, caching=False), cfg)
    s.add_request(Request("big", list(range(60)), max_tokens=2))
    e = _Engine(s)
    preemptions = sum(len(e.step().preempted_req_ids) for _ in range(40))
    assert preemptions >= 5 and "big" in s.requests


def test_async_two_steps_in_flight_placeholders_and_stale_output():
    cfg = SchedulerConfig(max_num_batched_tokens=16, async_scheduling=True)
    s = _sched(cfg, num_blocks=9, max_model_len=32, caching=False)
    model = FakeModel()
    s.add_request(Request("a", list(range(10)), max_tokens=3))
    o1, o2 = s.schedule(), s.schedule()
    a = s.requests["a"]
    assert [o.num_scheduled_tokens for o in (o1, o2)] == [{"a": 10}, {"a": 1}]
    assert (a.num_computed_tokens, a.num_in_flight_tokens, a.num_output_placeholders) == (11, 11, 2)
    with pytest.raises(InvalidFieldError, match="oldest"):
        s.update_from_output(o2, model.output(o2))
    s.update_from_output(o1, model.output(o1))
    assert (a.num_in_flight_tokens, a.num_output_placeholders, len(a.output_token_ids)) == (1, 1, 1)
    o3 = s.schedule()  # o2 and o3 in flight now
    assert o3.num_scheduled_tokens == {"a": 1}
    s.update_from_output(o2, model.output(o2))
    # the step still in flight (o3) samples the 3rd and last token: no step past max_tokens
    assert s.schedule().num_scheduled_tokens == {}
    s.check_invariants()


def test_async_preemption_marks_in_flight_output_stale_and_skips_the_request_until_it_drains():
    cfg = SchedulerConfig(max_num_batched_tokens=64, async_scheduling=True)
    s = _sched(cfg, num_blocks=9, max_model_len=32, caching=False)
    model = FakeModel()
    s.add_request(Request("a", list(range(16)), max_tokens=8))
    s.add_request(Request("b", list(range(100, 116)), max_tokens=8))
    o1 = s.schedule()
    o2 = s.schedule()  # both decode one token; a needs its 5th block: b is preempted
    assert o2.preempted_req_ids == {"b"}
    b = s.requests["b"]
    assert (b.num_stale_output_tokens, b.drop_stale_output, b.num_output_placeholders) == (16, False, 0)
    s.update_from_output(o1, model.output(o1))
    assert len(b.output_token_ids) == 1 and b.num_stale_output_tokens == 0  # stale output still delivered
    s.check_invariants()


def test_finishing_by_stop_token_max_model_len_and_abort():
    s = _sched(max_model_len=12)
    e = _Engine(s)
    model = e.model
    from kvref.models.machines.scheduler import fake_token

    s.add_request(Request("stop", [1, 2, 3], max_tokens=10, stop_token_ids=(fake_token("stop", 1),)))
    s.add_request(Request("cap", list(range(10)), max_tokens=100))
    s.add_request(Request("gone", [5, 6], max_tokens=100))
    reqs = dict(s.requests)
    for _ in range(4):
        e.step()
    assert (reqs["stop"].finish_reason, len(reqs["stop"].output_token_ids)) == ("stop", 2)
    assert (reqs["cap"].finish_reason, reqs["cap"].num_tokens) == ("length", 12)
    assert s.finish_requests(["gone", "nope", "stop"]) == [reqs["gone"]]
    assert reqs["gone"].status == RequestStatus.FINISHED and reqs["gone"].finish_reason == "abort"
    assert s.snapshot().num_free_blocks == 39 and model.num_sampled["gone"] >= 1


def test_watermark_applies_only_when_something_is_running():
    cfg = SchedulerConfig(max_num_batched_tokens=64)
    s = _sched(cfg, num_blocks=11, max_model_len=40, watermark=0.5, caching=False)  # 5 blocks kept free
    s.add_request(Request("a", list(range(32)), max_tokens=1))
    s.add_request(Request("b", [1, 2, 3, 4], max_tokens=1))
    assert s.schedule().num_scheduled_tokens == {"a": 32}  # 8 of 10 blocks: allowed, nothing ran


# ---- liveness bound ------------------------------------------------------------------------------
def test_drain_bound_fcfs_and_priority():
    cfg = SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=2)
    pool = _pool(cfg=cfg)
    reqs = [Request("a", list(range(20)), max_tokens=3), Request("b", [1], max_tokens=1)]
    # T_a = cdiv(23, 8) + 3 = 6, T_b = cdiv(2, 8) + 1 = 2 -> (6+1) + (2+1) + depth 1
    assert drain_bound(reqs, pool, cfg) == 11
    prio = SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=2, policy="priority")
    assert drain_bound(reqs, pool, prio) == 2 * (2 * 2 * 6 + 1) + 1


def test_startup_consistency_counts_sliding_window_caps_and_the_null_block():
    cfg = SchedulerConfig(max_num_batched_tokens=8)
    # full: cdiv(64, 4) = 16; SWA(8): min(8 - 1 + 8, 64) -> cdiv(15, 4) + 1 = 5; + null block = 22
    assert not startup_consistent(_pool(num_blocks=21, max_model_len=64, cfg=cfg, swa=8), cfg)
    assert startup_consistent(_pool(num_blocks=22, max_model_len=64, cfg=cfg, swa=8), cfg)
    no_chunk = SchedulerConfig(max_num_batched_tokens=8, enable_chunked_prefill=False)
    assert not startup_consistent(_pool(num_blocks=100, max_model_len=64, cfg=no_chunk), no_chunk)


def test_startup_consistency_rejects_a_mamba_block_smaller_than_the_context():
    cfg = SchedulerConfig()
    fa = KVCacheGroupSpec(("full",), FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16"))
    for mamba_bs, ok in ((4, False), (64, True)):
        mamba = KVCacheGroupSpec(("m",), MambaSpec(block_size=mamba_bs, shapes=((2, 8),), dtypes=("float16",)))
        pool = PoolConfig(num_blocks=100, groups=(fa, mamba), max_model_len=64, scheduler_block_size=64,
                          hash_block_size=64, max_in_flight_tokens=cfg.max_in_flight_tokens, enable_caching=False)
        assert startup_consistent(pool, cfg) is ok


def test_liveness_needs_a_copy_on_write_block_per_group_that_can_take_a_partial_hit():
    """docs/proofs.md Findings 3: hits end inside a block only when the block is larger than the
    hash block and caching is on; each such group needs one block beyond the startup count."""
    cfg = SchedulerConfig(max_num_batched_tokens=8)
    fa = KVCacheGroupSpec(("full",), FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16"))

    def pool(num_blocks, hash_bs, caching=True):
        return PoolConfig(num_blocks=num_blocks, groups=(fa,), max_model_len=64, scheduler_block_size=4,
                          hash_block_size=hash_bs, max_in_flight_tokens=cfg.max_in_flight_tokens,
                          enable_caching=caching)

    # cdiv(64, 4) = 16 blocks + the null block
    assert partial_hit_groups(pool(17, 4)) == 0 and liveness_guaranteed(pool(17, 4), cfg)
    assert partial_hit_groups(pool(17, 2)) == 1
    assert startup_consistent(pool(17, 2), cfg) and not liveness_guaranteed(pool(17, 2), cfg)
    assert liveness_guaranteed(pool(18, 2), cfg)
    assert partial_hit_groups(pool(17, 2, caching=False)) == 0 and liveness_guaranteed(pool(17, 2, False), cfg)


def test_an_align_split_capped_above_the_input_budget_is_no_liveness_guarantee():
    """docs/proofs.md Findings 4: vLLM floors a non-final align chunk to a block when the block
    fits max_num_scheduled_tokens (and long_prefill_token_threshold), though the chunk is bounded
    by max_num_batched_tokens too; a block between the two budgets stalls every chunk."""
    fa = KVCacheGroupSpec(("full",), FullAttentionSpec(block_size=8, num_kv_heads=1, head_size=8, dtype="float16"))

    def pool(mode="align", mamba_bs=8):
        mamba = KVCacheGroupSpec(("m",), MambaSpec(block_size=mamba_bs, shapes=((2, 8),), dtypes=("float16",),
                                                   mamba_cache_mode=mode))
        return PoolConfig(num_blocks=64, groups=(fa, mamba), max_model_len=61, scheduler_block_size=8,
                          hash_block_size=8, max_in_flight_tokens=4, enable_caching=True)

    def cfg(cap, threshold=0):
        return SchedulerConfig(max_num_batched_tokens=4, max_num_scheduled_tokens=cap,
                               long_prefill_token_threshold=threshold)

    assert align_split_stalls(pool(), cfg(8)) and liveness_hazard(pool(), cfg(8)) == "align-split-stall"
    assert align_split_stalls(pool(), cfg(100)) and not liveness_guaranteed(pool(), cfg(100))
    for ok in (cfg(None), cfg(7), cfg(2), cfg(8, threshold=6)):  # the block never fits the prefill cap
        assert not align_split_stalls(pool(), ok) and liveness_guaranteed(pool(), ok)
    assert align_split_stalls(pool(), cfg(8, threshold=8))  # the threshold reaches the block: floored
    assert not align_split_stalls(pool(mode="none"), cfg(8))  # no split outside align
    # the drain bound counts the sub-block advance: cdiv(8, 4) steps per 8-token block
    assert steps_alone(Request("r", list(range(20)), max_tokens=1), pool(), cfg(None)) == 3 * 2 + 8 + 1
    wide = SchedulerConfig(max_num_batched_tokens=20)  # floored to 16-token chunks
    assert steps_alone(Request("r", list(range(40)), max_tokens=1), pool(), wide) == 3 + 8 + 1


# ---- bad input -----------------------------------------------------------------------------------
@settings(max_examples=profile_examples(50, 200))
@given(field=st.sampled_from(["max_num_batched_tokens", "max_num_seqs", "long_prefill_token_threshold",
                              "policy", "enable_chunked_prefill", "async_scheduling"]),
       value=st.one_of(st.integers(-5, 0), st.text(max_size=3), st.none(), st.floats(), st.booleans()))
def test_scheduler_config_rejects_bad_values_naming_the_field(field, value):
    good = {"max_num_batched_tokens": 1, "max_num_seqs": 1, "long_prefill_token_threshold": 0, "policy": "fcfs",
            "enable_chunked_prefill": True, "async_scheduling": False}
    if field in ("enable_chunked_prefill", "async_scheduling") and isinstance(value, bool):
        return
    if value == good[field] and type(value) is type(good[field]):
        return
    if field == "long_prefill_token_threshold" and type(value) is int and value == 0:
        return
    try:
        SchedulerConfig(**{field: value})
    except InvalidFieldError as e:
        assert e.field == field
    else:
        pytest.fail(f"SchedulerConfig({field}={value!r}) accepted")


def test_bad_calls_raise_value_errors_and_change_nothing():
    cfg = SchedulerConfig()
    with pytest.raises(InvalidFieldError, match="max_in_flight_tokens"):
        Scheduler(_pool(cfg=SchedulerConfig(async_scheduling=True)), cfg)
    with pytest.raises(InvalidFieldError):
        Scheduler("pool", cfg)  # type: ignore[arg-type]
    s = _sched(cfg, max_model_len=16)
    s.add_request(Request("a", [1, 2]))
    before = s.snapshot()
    for bad in (Request("a", [3]), Request("b", list(range(16))), "c"):
        with pytest.raises(KVRefError):
            s.add_request(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidFieldError):
        s.finish_requests([3])  # type: ignore[list-item]
    with pytest.raises(InvalidFieldError):
        s.finish_requests(7)  # type: ignore[arg-type]
    out = s.schedule()
    for bad_output in ({"a": [1]}, ModelOutput({"a": [-1]}), ModelOutput({"a": 1}), ModelOutput({"a": [True]})):
        with pytest.raises(InvalidFieldError):
            s.update_from_output(out, bad_output)  # type: ignore[arg-type]
    assert s.requests["a"].num_in_flight_tokens == 2  # nothing half-applied
    s.update_from_output(out, ModelOutput({"a": [1]}))
    with pytest.raises(InvalidFieldError):
        s.update_from_output(out, ModelOutput())  # settled already
    assert before.waiting == ("a",) and s.snapshot().running == ("a",)
    s.check_invariants()
