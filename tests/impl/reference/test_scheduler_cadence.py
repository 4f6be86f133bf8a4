"""The reference scheduler's prefill cadence and adaptive long-prefill threshold
(:mod:`kvref.impl.reference.scheduler_cadence`, issue #22): the rules on small hand-made traces.
The same rules against vLLM 0.33.0 on generated traces: tests/conformance/test_scheduler_branches.py."""

from __future__ import annotations

import pytest

from kvref.impl.interface import PoolConfig
from kvref.impl.reference.scheduler import Scheduler
from kvref.impl.reference.scheduler_cadence import adaptive_long_prefill_threshold
from kvref.impl.reference.scheduler_connector import ScriptedConnector
from kvref.impl.request import Request
from kvref.impl.scheduler_types import ModelOutput, SchedulerConfig
from kvref.spec.errors import InvalidFieldError
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec


def _scheduler(**cfg) -> Scheduler:
    config = SchedulerConfig(**{"max_num_batched_tokens": 16, "max_num_seqs": 4, **cfg})
    fa = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16")
    pool = PoolConfig(num_blocks=32, groups=(KVCacheGroupSpec(("full",), fa),), max_model_len=64,
                      scheduler_block_size=4, hash_block_size=4, max_in_flight_tokens=config.max_in_flight_tokens)
    return Scheduler(pool, config)


def _step(s: Scheduler) -> dict[str, int]:
    """One synchronous step; every request that finished its prompt samples token 1."""
    out = s.schedule()
    s.update_from_output(out, ModelOutput({x.request_id: [1] for x in out.scheduled if not x.is_prefill_chunk}))
    s.check_invariants()
    return {x.request_id: x.num_scheduled_tokens for x in out.scheduled}


def test_adaptive_threshold_is_floored_at_a_fair_share_of_the_budget():
    adaptive = SchedulerConfig(max_num_batched_tokens=32, long_prefill_token_threshold=4,
                               long_prefill_token_threshold_adaptive=True)
    assert adaptive_long_prefill_threshold(adaptive, 4, 2) == 16
    assert adaptive_long_prefill_threshold(adaptive, 4, 16) == 4  # the share (2) is below the threshold
    plain = SchedulerConfig(max_num_batched_tokens=32, long_prefill_token_threshold=4)
    assert adaptive_long_prefill_threshold(plain, 4, 2) == 4
    assert adaptive_long_prefill_threshold(adaptive, 0, 2) == 0  # only a nonzero threshold is floored


def test_adaptive_threshold_cuts_the_chunk_to_the_fair_share():
    s = _scheduler(long_prefill_token_threshold=2, long_prefill_token_threshold_adaptive=True)
    s.add_request(Request("a", list(range(1, 31)), max_tokens=4))
    s.add_request(Request("b", list(range(40, 70)), max_tokens=4))
    assert _step(s) == {"a": 8, "b": 8}  # 16 // 2 requests, not the threshold's 2


@pytest.mark.parametrize("interval, admitted_at", [(1, 2), (2, 3), (3, 4)])
def test_an_arrival_waits_for_the_cadence_while_a_request_decodes(interval, admitted_at):
    s = _scheduler(prefill_schedule_interval=interval)
    s.add_request(Request("a", [1, 2, 3, 4], max_tokens=20))
    assert _step(s) == {"a": 4}  # the prefill-carrying step 1
    s.add_request(Request("b", list(range(10, 16)), max_tokens=4))
    steps = [_step(s) for _ in range(admitted_at - 1)]
    assert [("b" in x) for x in steps] == [False] * (admitted_at - 2) + [True]
    assert all(x.get("a") == 1 for x in steps)  # the decode runs every step


def test_a_running_prefill_chunk_is_held_too():
    s = _scheduler(prefill_schedule_interval=3)
    s.add_request(Request("a", [1, 2, 3, 4], max_tokens=30))
    _step(s)
    s.add_request(Request("b", list(range(10, 50)), max_tokens=4))
    steps = [_step(s) for _ in range(7)]
    # admitted on step 4 (15 tokens beside a's decode); its next chunks on steps 7 and 10
    assert [x.get("b", 0) for x in steps] == [0, 0, 15, 0, 0, 15, 0]


def test_a_step_that_leaves_requests_waiting_turns_the_cadence_off():
    """vLLM #44558's capacity escape: after a step that could not drain the waiting queue (here
    ``max_num_seqs``), prefill is not held, so the queue does not grow without bound."""
    s = _scheduler(prefill_schedule_interval=3, max_num_seqs=2)
    s.add_request(Request("a", [1, 2, 3, 4], max_tokens=2))
    s.add_request(Request("b", [5, 6, 7, 8], max_tokens=20))
    s.add_request(Request("c", [9, 10, 11, 12], max_tokens=4))
    assert _step(s) == {"a": 4, "b": 4}  # c waits for a slot
    assert _step(s) == {"a": 1, "b": 1}  # a finishes
    assert _step(s) == {"b": 1, "c": 4}  # within the interval, b decoding: admitted all the same


def test_cadence_config_is_checked():
    with pytest.raises(InvalidFieldError, match="prefill_schedule_interval"):
        SchedulerConfig(prefill_schedule_interval=0)
    with pytest.raises(InvalidFieldError, match="prefill_schedule_interval"):
        SchedulerConfig(prefill_schedule_interval=True)
    with pytest.raises(InvalidFieldError, match="long_prefill_token_threshold_adaptive"):
        SchedulerConfig(long_prefill_token_threshold_adaptive=1)
    config = SchedulerConfig(prefill_schedule_interval=2)
    fa = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16")
    pool = PoolConfig(num_blocks=8, groups=(KVCacheGroupSpec(("full",), fa),), max_model_len=16,
                      scheduler_block_size=4, hash_block_size=4, max_in_flight_tokens=config.max_in_flight_tokens)
    with pytest.raises(InvalidFieldError, match="prefill_schedule_interval"):
        Scheduler(pool, config, connector=ScriptedConnector())


def test_max_num_active_seqs_limits_admission_below_the_runner_slots():
    """vLLM's ``max_num_active_seqs``: the waiting loop stops at that many running requests."""
    s = _scheduler(max_num_seqs=4, max_num_active_seqs=2)
    for rid in "abc":
        s.add_request(Request(rid, [1, 2, 3], max_tokens=2))
    assert _step(s) == {"a": 3, "b": 3}
    assert _step(s) == {"a": 1, "b": 1}  # both finish
    assert _step(s) == {"c": 3}
    with pytest.raises(InvalidFieldError, match="max_num_active_seqs"):
        SchedulerConfig(max_num_seqs=2, max_num_active_seqs=3)
    with pytest.raises(InvalidFieldError, match="max_num_active_seqs"):
        SchedulerConfig(max_num_active_seqs=0)
