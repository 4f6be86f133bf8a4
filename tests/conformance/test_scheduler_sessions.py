"""Streaming-input sessions inside whole scheduler steps (issue #22): the reference scheduler
(:mod:`kvref.impl.reference.scheduler_sessions`) in lock step with vLLM 0.33.0's (``scheduler_sessions``
machine, part of ``conform-scheduler``); the vLLM source faults of the catalogue's ``sessions``
class must diverge."""

from __future__ import annotations

import pytest

from kvref.impl.interface import PoolConfig
from kvref.impl.reference.scheduler import Scheduler
from kvref.impl.request import Request
from kvref.impl.scheduler_types import PRIORITY, ModelOutput, SchedulerConfig
from kvref.models.machines.scheduler import _attn
from kvref.spec.errors import InvalidFieldError
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from tests.conformance.scheduler_targets import vllm_scheduler  # noqa: F401 - the module-scoped fixture

#: the traces the tests run (the check draws 10 at fast, 40 at ci)
EXAMPLES = 10
SESSION_FAULTS = ("sched.session_waiting_for_input_scheduled", "sched.session_kv_holding_to_waiting",
                  "sched.session_slot_not_counted", "sched.session_counted_unfinished",
                  "sched.session_stale_block_hash_kept", "sched.session_keeps_in_flight_tokens",
                  "sched.finished_set_not_cleared", "sched.abort_all_aborts_none")


def _scheduler(**cfg) -> Scheduler:
    config = SchedulerConfig(**{"max_num_batched_tokens": 32, "max_num_seqs": 2, **cfg})
    pool = PoolConfig.off_plan("two short sessions", num_blocks=12,
                               groups=(KVCacheGroupSpec(("full",), _attn(FullAttentionSpec, 4)),), max_model_len=64,
                               scheduler_block_size=4, hash_block_size=4,
                               max_in_flight_tokens=config.max_in_flight_tokens, enable_caching=True)
    return Scheduler(pool, config)


def _step(s: Scheduler, token: int = 7):
    out = s.schedule()
    s.update_from_output(out, ModelOutput({x.request_id: [token] for x in out.scheduled if not x.is_prefill_chunk}))
    s.check_invariants()
    return out


def test_a_stopped_turn_keeps_its_blocks_and_the_update_resumes_on_them():
    s = _scheduler()
    a = Request("a", [1, 2, 3, 4, 5], max_tokens=1, resumable=True)
    s.add_request(a)
    _step(s)
    blocks = s.kv_cache_manager.get_block_ids("a")
    # the turn stopped (max_tokens): the session waits for input holding its blocks, uncounted
    assert a.finish_reason is None and [r.request_id for r in s.sessions.kv_holding_waiting] == ["a"]
    assert s.get_request_counts() == (0, 1) and s.get_num_unfinished_requests() == 0
    assert not _step(s).scheduled  # skipped while it waits for input
    s.add_request(Request("a", [8, 9], max_tokens=2, resumable=True))
    out = _step(s)
    # the sampled 7 was dropped: 5 prompt tokens + 2 new ones, 5 of them already computed
    assert a.prompt_token_ids == [1, 2, 3, 4, 5, 8, 9]
    assert [(x.kind, x.num_computed_tokens, x.num_scheduled_tokens) for x in out.scheduled] == [("new", 5, 2)]
    assert s.kv_cache_manager.get_block_ids("a")[0][:len(blocks[0])] == blocks[0]
    s.add_request(Request("a", [0], max_tokens=1))  # the finishing update, queued while it runs
    _step(s)
    assert "a" not in s.requests and a.finish_reason == "length"


def test_a_session_waiting_for_input_keeps_a_model_runner_slot():
    s = _scheduler(max_num_seqs=1)
    s.add_request(Request("a", [1, 2, 3], max_tokens=1, resumable=True))
    _step(s)
    s.add_request(Request("b", [4, 5, 6], max_tokens=1))
    assert not _step(s).scheduled  # max_num_seqs=1: the waiting session holds the only slot
    s.add_request(Request("a", [0], max_tokens=1))  # finishing update of a waiting session: aborted
    assert "a" not in s.requests and s.sessions.num_waiting_for_streaming_input == 0
    assert [x.request_id for x in _step(s).scheduled] == ["b"]


def test_sessions_kvref_does_not_model_are_refused():
    from kvref.impl.reference.scheduler_connector import ScriptedConnector

    with pytest.raises(InvalidFieldError, match="resumable"):
        _scheduler(policy=PRIORITY).add_request(Request("a", [1, 2], resumable=True))
    config = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=2)
    pool = PoolConfig.off_plan("a pool", num_blocks=12,
                               groups=(KVCacheGroupSpec(("full",), _attn(FullAttentionSpec, 4)),), max_model_len=64,
                               scheduler_block_size=4, hash_block_size=4,
                               max_in_flight_tokens=config.max_in_flight_tokens, enable_caching=True)
    with pytest.raises(InvalidFieldError, match="resumable"):
        Scheduler(pool, config, connector=ScriptedConnector()).add_request(Request("a", [1, 2], resumable=True))
    with pytest.raises(InvalidFieldError, match="resumable"):
        Request("a", [1], resumable="yes")
    s = _scheduler()
    s.add_request(Request("a", [1, 2, 3], max_tokens=1, resumable=True))
    _step(s)
    with pytest.raises(InvalidFieldError, match="prompt_token_ids"):  # the session would outgrow the model
        s.add_request(Request("a", list(range(1, 62)), max_tokens=1, resumable=True))
    assert s.sessions.num_waiting_for_streaming_input == 1  # nothing half-updated


def test_the_finished_set_and_abort_all():
    """include_finished_set: each update reports the requests freed since the previous one
    (aborts in between too), then forgets them; finish_requests(None) aborts every request."""
    s = Scheduler(_scheduler().pool, _scheduler().config, include_finished_set=True)
    s.add_request(Request("a", [1, 2, 3], max_tokens=1))
    s.add_request(Request("b", [4, 5, 6], max_tokens=4, resumable=True))
    s.add_request(Request("c", [7, 8, 9], max_tokens=4))
    out = s.schedule()
    s.finish_requests("c")
    s.update_from_output(out, ModelOutput({"a": [1], "b": [2]}))
    assert s.finished_requests == {"a", "c"}
    s.update_from_output(s.schedule(), ModelOutput({"b": [3]}))
    assert s.finished_requests is None
    s.finish_requests(None)
    assert not s.requests and s.get_request_counts() == (0, 0)
    assert s.kv_cache_manager.get_num_free_blocks() == _scheduler().kv_cache_manager.get_num_free_blocks()
    s.update_from_output(s.schedule(), ModelOutput({}))
    assert s.finished_requests == {"b"}
    with pytest.raises(InvalidFieldError, match="include_finished_set"):
        Scheduler(_scheduler().pool, _scheduler().config, include_finished_set=1)


@pytest.mark.vllm
def test_session_traces_match_vllm_and_reach_every_path(vllm_scheduler):
    from kvref.models.machines.scheduler_sessions import run_session_machine

    run = run_session_machine(EXAMPLES, seed=0)  # seeded: the same traces in every process and profile
    assert run.ok, run.failure
    assert run.traces >= 8
    for path in ("session_turn_stopped_kept", "session_kept_kv_blocks", "session_resumed_on_its_blocks",
                 "session_update_applied_at_once", "session_update_queued", "session_finish_while_waiting",
                 "session_steps_with_one_waiting_for_input", "session_teardown_drained", "finished_set_reported",
                 "session_stopped_with_placeholders", "session_abort_all"):
        assert run.coverage.get(path, 0) > 0, (path, run.coverage)


@pytest.mark.vllm
@pytest.mark.parametrize("fault_id", SESSION_FAULTS)
def test_planted_session_fault_is_a_divergence(vllm_scheduler, fault_id):
    from kvref.models.machines.scheduler_sessions import run_session_machine
    from tests.vllm_faults import planted_vllm_fault

    with planted_vllm_fault(fault_id, ("v1/core/sched/scheduler.py",)):
        run = run_session_machine(EXAMPLES, seed=0, shrink=False)  # seeded: the same traces every run
    assert not run.ok
    # a divergence from the reference, or vLLM's own assertion tripping on the state the fault left
    assert "Divergence" in run.failure or "scheduler.py" in run.failure, run.failure
