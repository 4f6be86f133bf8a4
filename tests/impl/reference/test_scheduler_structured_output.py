"""Structured output in the reference scheduler, case by case (vLLM 0.33.0's rules; generated
traces against vLLM itself: tests/conformance/test_scheduler_structured_output.py)."""

from __future__ import annotations

import pytest

from kvref.impl.interface import PoolConfig
from kvref.impl.reference.scheduler import Scheduler
from kvref.impl.reference.scheduler_structured_output import ScriptedGrammarOracle, strip_padding
from kvref.impl.request import Request, RequestStatus
from kvref.impl.scheduler_types import DraftTokenIds, ModelOutput, SchedulerConfig
from kvref.spec.errors import InvalidFieldError
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec


def _sched(cfg: SchedulerConfig | None = None, oracle=None, log_stats: bool = False) -> Scheduler:
    cfg = cfg or SchedulerConfig()
    pool = PoolConfig(num_blocks=40, groups=(KVCacheGroupSpec(("full",), FullAttentionSpec(
        block_size=4, num_kv_heads=1, head_size=8, dtype="float16")),), max_model_len=64, scheduler_block_size=4,
        hash_block_size=4, max_in_flight_tokens=cfg.max_in_flight_tokens, log_stats=log_stats)
    return Scheduler(pool, cfg, grammar_oracle=oracle if oracle is not None else ScriptedGrammarOracle())


def _step(s: Scheduler, sampled: dict[str, list[int]] | None = None):
    out = s.schedule()
    s.update_from_output(out, ModelOutput({x.request_id: (sampled or {}).get(x.request_id, [7])
                                           for x in out.scheduled if not x.is_prefill_chunk}))
    s.check_invariants()
    return out


def test_pending_grammar_is_skipped_without_blocking_the_queue_then_admitted():
    s = _sched()
    s.add_request(Request("a", [1, 2, 3], use_structured_output=True))
    s.add_request(Request("b", [4, 5, 6]))
    out = _step(s)
    assert [x.request_id for x in out.scheduled] == ["b"]  # a skipped, b admitted past it
    assert s.snapshot().waiting_for_grammar == ("a",) and s.requests["a"].status == RequestStatus.WAITING
    s.structured.oracle.set_state("a", "ready")
    out = _step(s)
    assert {x.request_id: x.kind for x in out.scheduled}["a"] == "new"
    assert s.snapshot().waiting_for_grammar == ()


def test_a_request_waiting_for_its_grammar_counts_as_deferred_from_arrival():
    """vLLM's _enqueue_waiting_request puts a blocked status in deferred_waiting at arrival: the
    metrics count it skipped before any step (generated runs' replays found this)."""
    s = _sched(log_stats=True)
    s.add_request(Request("a", [1, 2, 3], use_structured_output=True))
    s.add_request(Request("b", [1, 2, 3]))
    stats = s.make_stats()
    assert stats["num_skipped_waiting_reqs"] == 1 and stats["num_waiting_reqs"] == 1


def test_failed_grammar_finishes_as_error_in_the_next_update_without_blocks():
    s = _sched()
    req = Request("a", [1, 2, 3], use_structured_output=True)
    s.add_request(req)
    s.structured.oracle.set_state("a", "error")
    free = s.kv_cache_manager.get_num_free_blocks()
    out = s.schedule()
    assert not out.scheduled and "a" in s.requests  # found at schedule, finished at the update
    s.update_from_output(out, ModelOutput({}))
    assert "a" not in s.requests and req.status == RequestStatus.FINISHED and req.finish_reason == "error"
    assert s.kv_cache_manager.get_num_free_blocks() == free


def test_rejected_sampled_tokens_finish_the_request_and_free_its_blocks():
    s = _sched()
    req = Request("a", [1, 2, 3], max_tokens=8, use_structured_output=True)
    s.add_request(req)
    s.structured.oracle.set_state("a", "ready")
    _step(s)
    assert req.status == RequestStatus.RUNNING
    s.structured.oracle.reject_sampled("a")
    _step(s)
    assert req.status == RequestStatus.FINISHED and req.finish_reason == "error"
    assert "a" not in s.requests and s.kv_cache_manager.get_num_free_blocks() == 40 - 1


def test_drafts_are_cut_to_the_grammar_prefix_and_padding_stripped():
    cfg = SchedulerConfig(num_speculative_tokens=3)
    s = _sched(cfg)
    s.add_request(Request("a", [1, 2, 3], max_tokens=8, use_structured_output=True))
    s.add_request(Request("b", [1, 2, 3], max_tokens=8))
    s.structured.oracle.set_state("a", "ready")
    _step(s)
    s.structured.oracle.limit_drafts("a", 1)
    s.update_draft_token_ids(DraftTokenIds(("a", "b"), ((5, 6, 7), (5, -1, -1))))
    assert s.spec_decode.spec_token_ids == {"a": [5], "b": [5, -1, -1]}  # no grammar, no change for b
    assert strip_padding([3, 4, -1, 5]) == [3, 4]


def test_bad_input_is_refused_with_the_field_named():
    cfg = SchedulerConfig()
    plain = Scheduler(_sched().pool, cfg)  # no grammar oracle
    with pytest.raises(InvalidFieldError, match="use_structured_output"):
        plain.add_request(Request("r", [1, 2], use_structured_output=True))
    with pytest.raises(InvalidFieldError, match="use_structured_output"):
        Request("r", [1], use_structured_output=1)
    with pytest.raises(InvalidFieldError, match="grammar_oracle"):
        Scheduler(_sched().pool, cfg, grammar_oracle=object())
    with pytest.raises(InvalidFieldError, match="state"):
        ScriptedGrammarOracle().set_state("r", "compiling")
    with pytest.raises(InvalidFieldError, match="num_accepted"):
        ScriptedGrammarOracle().limit_drafts("r", -1)
    with pytest.raises(InvalidFieldError, match="use_structured_output"):
        _sched().add_request(Request("r", [1, 2], use_structured_output=True, resumable=True))
    s = _sched(oracle=type("Odd", (ScriptedGrammarOracle,), {"grammar_state": lambda self, rid: "maybe"})())
    s.add_request(Request("r", [1, 2], use_structured_output=True))
    with pytest.raises(InvalidFieldError, match="grammar_state"):
        s.schedule()
