"""Pause states in ``conform-scheduler`` (issue #22): vLLM 0.33.0's ``Scheduler.set_pause_state``
and the counts the engine polls, the reference scheduler in lock step with vLLM's
(``scheduler_pause``).

Planted faults show the comparison sees each pause state and the pause-aware count: a vLLM that
treats a pause as a lighter one, or counts parked requests as unfinished, must diverge."""

from __future__ import annotations

import pytest

from kvref.impl.reference.scheduler_pause import PauseState
from kvref.spec.errors import InvalidFieldError
from tests.conftest import profile_examples
from tests.conformance.scheduler_targets import vllm_scheduler  # noqa: F401 - the module-scoped fixture


def _reference_scheduler():
    """A small FCFS reference scheduler: 16 blocks of 4 tokens, a 16-token budget."""
    from kvref.impl.interface import PoolConfig
    from kvref.impl.reference.scheduler import Scheduler
    from kvref.impl.scheduler_types import SchedulerConfig
    from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    config = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4)
    fa = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16")
    pool = PoolConfig(num_blocks=16, groups=(KVCacheGroupSpec(("full",), fa),), max_model_len=32,
                      scheduler_block_size=4, hash_block_size=4, max_in_flight_tokens=config.max_in_flight_tokens)
    return Scheduler(pool, config)


@pytest.mark.vllm
def test_pause_traces_match_vllm_and_reach_every_pause(vllm_scheduler):
    from kvref.models.machines.scheduler_pause import run_pause_machine

    run = run_pause_machine(profile_examples(10, 30), reproducible=True)
    assert run.ok, run.failure
    c = run.coverage
    assert run.traces >= 8
    for path in ("pause_set_paused_all", "pause_set_paused_new", "paused_all_held_running",
                 "paused_new_held_waiting", "paused_new_scheduled_running", "stats_admissions_recorded",
                 "stats_preempted_recorded", "stats_hits_recorded"):
        assert c.get(path, 0) > 0, (path, c)


@pytest.mark.vllm
@pytest.mark.parametrize("planted, lighter", [(PauseState.PAUSED_NEW, PauseState.UNPAUSED),
                                              (PauseState.PAUSED_ALL, PauseState.PAUSED_NEW)])
def test_a_lighter_pause_in_vllm_is_a_divergence(vllm_scheduler, monkeypatch, planted, lighter):
    """vLLM's scheduler set to a lighter state than the reference: it admits (or schedules)
    what the reference holds."""
    from kvref.models.machines.scheduler_pause import run_pause_machine

    original = vllm_scheduler.VllmScheduler.set_pause_state

    def lighter_pause(self, state):
        original(self, lighter if state == planted else state)

    monkeypatch.setattr(vllm_scheduler.VllmScheduler, "set_pause_state", lighter_pause)
    run = run_pause_machine(profile_examples(10, 30), reproducible=True, shrink=False)
    assert not run.ok
    assert "differ" in run.failure, run.failure


@pytest.mark.vllm
def test_unfinished_count_that_ignores_the_pause_is_a_divergence(vllm_scheduler, monkeypatch):
    """vLLM's ``get_num_unfinished_requests`` counting queued requests under a pause (the engine
    loop would spin on work it may not schedule)."""
    from vllm.v1.core.sched.scheduler import Scheduler as VScheduler

    from kvref.models.machines.scheduler_pause import run_pause_machine

    monkeypatch.setattr(VScheduler, "get_num_unfinished_requests", lambda self: sum(self.get_request_counts()))
    run = run_pause_machine(profile_examples(10, 30), reproducible=True, shrink=False)
    assert not run.ok
    assert "differ" in run.failure, run.failure


@pytest.mark.vllm
@pytest.mark.parametrize("fault", ["no_record", "hits_as_misses"])
def test_prefix_cache_stats_vllm_records_wrongly_are_a_divergence(vllm_scheduler, monkeypatch, fault):
    """vLLM's ``KVCacheManager.record_prefix_cache_stats`` planted to skip admissions, or to
    count every hit as a miss: ``make_stats``' prefix-cache stats differ from the reference's."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from kvref.models.machines.scheduler_pause import run_pause_machine

    original = KVCacheManager.record_prefix_cache_stats

    def planted(self, request, num_hits):
        if fault == "hits_as_misses":
            original(self, request, 0)

    monkeypatch.setattr(KVCacheManager, "record_prefix_cache_stats", planted)
    # 30 traces under every profile: hits are recorded mostly when resumed requests come back
    run = run_pause_machine(30, reproducible=True, shrink=False)
    assert not run.ok
    assert "polled counts differ" in run.failure, run.failure


@pytest.mark.parametrize("bad", [3, -1, True, "PAUSED_ALL", None, 1.0])
def test_set_pause_state_rejects_bad_input_and_changes_nothing(bad):
    sched = _reference_scheduler()
    sched.set_pause_state(PauseState.PAUSED_NEW)
    with pytest.raises(InvalidFieldError, match="pause_state"):
        sched.set_pause_state(bad)
    assert sched.pause_state == PauseState.PAUSED_NEW


def test_a_pause_keeps_every_block_and_resuming_runs_on():
    """Reference alone: PAUSED_ALL schedules nothing and frees nothing; PAUSED_NEW grows running
    requests but admits no waiting one; the counts the engine polls follow the state."""
    from kvref.impl.request import Request
    from kvref.impl.scheduler_types import ModelOutput

    sched = _reference_scheduler()
    sched.add_request(Request("a", prompt_token_ids=list(range(6)), max_tokens=8))
    out = sched.schedule()
    sched.update_from_output(out, ModelOutput(sampled_token_ids={"a": [7]}))
    blocks = sched.kv_cache_manager.get_block_ids("a")
    sched.add_request(Request("b", prompt_token_ids=list(range(5)), max_tokens=8))

    sched.set_pause_state(PauseState.PAUSED_ALL)
    assert sched.get_request_counts() == (1, 1) and sched.get_num_unfinished_requests() == 0
    out = sched.schedule()
    assert out.scheduled == ()
    sched.update_from_output(out, ModelOutput(sampled_token_ids={}))
    assert sched.kv_cache_manager.get_block_ids("a") == blocks and not sched.has_finished_requests()

    sched.set_pause_state(PauseState.PAUSED_NEW)
    assert sched.get_num_unfinished_requests() == 1
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["a"]
    sched.update_from_output(out, ModelOutput(sampled_token_ids={"a": [8]}))

    sched.set_pause_state(PauseState.UNPAUSED)
    assert sched.get_num_unfinished_requests() == 2
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["a", "b"]
    sched.check_invariants()


@pytest.mark.parametrize("record", [True, False])
def test_make_stats_counts_admissions_only_when_the_scheduler_records(record):
    """Reference alone: with ``record_prefix_cache_stats`` an admission's lookup is counted once
    (a second request hits the first one's full blocks), and ``make_stats`` resets the counts."""
    from dataclasses import replace

    from kvref.impl.reference.scheduler import Scheduler
    from kvref.impl.request import Request
    from kvref.impl.scheduler_types import ModelOutput

    base = _reference_scheduler()
    sched = Scheduler(replace(base.pool, log_stats=True), base.config, record_prefix_cache_stats=record)
    sched.add_request(Request("a", prompt_token_ids=list(range(9)), max_tokens=1))
    out = sched.schedule()
    sched.update_from_output(out, ModelOutput(sampled_token_ids={"a": [7]}))  # finishes: blocks cached
    sched.add_request(Request("b", prompt_token_ids=list(range(9)), max_tokens=1))
    sched.schedule()
    stats = sched.make_stats()
    assert stats["num_running_reqs"] == 1 and stats["num_waiting_reqs"] == 0
    want = (2, 18, 8) if record else (0, 0, 0)
    got = stats["prefix_cache_stats"]
    assert (got["requests"], got["queries"], got["hits"]) == want, got
    assert sched.make_stats()["prefix_cache_stats"]["requests"] == 0  # taken: reset
    with pytest.raises(InvalidFieldError, match="record_prefix_cache_stats"):
        Scheduler(base.pool, base.config, record_prefix_cache_stats="yes")


@pytest.mark.vllm
def test_connector_pause_traces_match_vllm_and_admit_kv_holding_requests(vllm_scheduler):
    """With a KV connector, PAUSED_NEW still admits requests holding KV blocks (finished async
    loads): reached, and vLLM agrees step by step."""
    from kvref.models.machines.scheduler_pause import run_connector_pause_machine

    run = run_connector_pause_machine(profile_examples(10, 20), reproducible=True)
    assert run.ok, run.failure
    c = run.coverage
    for path in ("pause_set_paused_new", "paused_new_held_waiting", "paused_new_admitted", "load_ok"):
        assert c.get(path, 0) > 0, (path, c)


@pytest.mark.vllm
def test_unfinished_count_without_kv_holding_requests_is_a_divergence(vllm_scheduler, monkeypatch):
    """vLLM's ``get_num_unfinished_requests`` planted to forget KV-holding requests under
    PAUSED_NEW (the engine would idle while loaded requests may still run)."""
    from vllm.v1.core.sched.interface import PauseState as VPauseState
    from vllm.v1.core.sched.scheduler import Scheduler as VScheduler

    from kvref.models.machines.scheduler_pause import run_connector_pause_machine

    original = VScheduler.get_num_unfinished_requests

    def planted(self):
        return len(self.running) if self.pause_state == VPauseState.PAUSED_NEW else original(self)

    monkeypatch.setattr(VScheduler, "get_num_unfinished_requests", planted)
    run = run_connector_pause_machine(20, reproducible=True, shrink=False)
    assert not run.ok
    assert "polled counts differ" in run.failure or "differ" in run.failure, run.failure
