"""Speculative decoding in the reference scheduler: the rules one by one, bad input, and the
reference-alone machine with its liveness drain (issue #22).

The facts are vLLM 0.33.0's (``Scheduler.schedule`` / ``update_from_output`` /
``update_draft_token_ids`` / ``_drafts_unused``, ``AsyncScheduler._update_after_schedule``);
tests/conformance/test_scheduler_spec_decode.py compares them with vLLM on generated traces.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from kvref.impl.interface import PoolConfig
from kvref.impl.reference.scheduler import Scheduler
from kvref.impl.reference.scheduler_spec_decode import drafts_unused
from kvref.impl.request import Request
from kvref.impl.scheduler_types import EAGLE, DraftTokenIds, ModelOutput, SchedulerConfig, SpecDecodingStats
from kvref.models.machines.scheduler import COVERAGE, machine_with, scheduler_setups
from kvref.spec.errors import InvalidFieldError
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from tests.conftest import profile_examples


def _sched(cfg: SchedulerConfig, num_blocks: int = 64, max_model_len: int = 64, caching: bool = True) -> Scheduler:
    fa = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16")
    pool = PoolConfig(num_blocks=num_blocks, groups=(KVCacheGroupSpec(("full",), fa),), max_model_len=max_model_len,
                      scheduler_block_size=4, hash_block_size=4, max_in_flight_tokens=cfg.max_in_flight_tokens,
                      enable_caching=caching, use_eagle=cfg.use_eagle)
    return Scheduler(pool, cfg)


def _step(s: Scheduler, sampled: dict[str, list[int]] | None = None, drafts: dict[str, tuple] | None = None):
    out = s.schedule()
    default = {x.request_id: [7] for x in out.scheduled if not x.is_prefill_chunk}
    s.update_from_output(out, ModelOutput(default if sampled is None else sampled))
    if drafts:
        s.update_draft_token_ids(DraftTokenIds(tuple(drafts), tuple(drafts.values())))
    s.check_invariants()
    return out


def test_rejected_drafts_roll_back_computed_tokens_and_are_counted():
    s = _sched(SchedulerConfig(num_speculative_tokens=3))
    s.add_request(Request("a", [1, 2, 3, 4], max_tokens=10))
    _step(s, drafts={"a": (5, 6, 7)})
    a = s.requests["a"]
    out = s.schedule()
    (x,) = out.scheduled
    assert (x.num_scheduled_tokens, x.spec_token_ids) == (4, (5, 6, 7))  # the sampled token + 3 drafts
    assert a.num_computed_tokens == 8
    s.update_from_output(out, ModelOutput({"a": [5, 9]}))  # first draft accepted, then the bonus token
    assert a.output_token_ids == [7, 5, 9]
    assert a.num_computed_tokens == a.num_tokens - 1 == 6  # 2 rejected positions rolled back
    assert s.spec_decoding_stats == SpecDecodingStats(3, 1, 3, 1, (1, 0, 0), (1, 1, 1))
    s.check_invariants()


def test_drafts_proposed_after_a_prefill_chunk_are_dropped():
    s = _sched(SchedulerConfig(max_num_batched_tokens=8, num_speculative_tokens=2))
    s.add_request(Request("a", list(range(1, 13)), max_tokens=4))
    out = _step(s, drafts={"a": (1, 2)})
    assert out.scheduled[0].is_prefill_chunk
    assert s.snapshot().requests["a"].spec_token_ids == ()
    out = _step(s)
    assert out.scheduled[0].num_scheduled_tokens == 4 and out.scheduled[0].spec_token_ids == ()


def test_drafts_are_cut_by_the_budget_and_max_model_len():
    s = _sched(SchedulerConfig(num_speculative_tokens=4), max_model_len=8)
    s.add_request(Request("a", [1, 2, 3, 4, 5], max_tokens=10))
    _step(s, drafts={"a": (1, 2, 3, 4)})
    out = s.schedule()
    # 5 computed, 6 known tokens: room for 8 - 5 - 1 = 2 positions, the sampled one and one draft
    assert out.scheduled[0].num_scheduled_tokens == 2 and out.scheduled[0].spec_token_ids == (1,)


def test_a_one_token_admission_beside_a_decode_is_padded_with_placeholder_drafts():
    s = _sched(SchedulerConfig(num_speculative_tokens=3))
    prompt = list(range(1, 10))  # 9 tokens: two full blocks cached after the first request's prefill
    s.add_request(Request("a", prompt, max_tokens=10))
    _step(s, drafts={"a": (4, 4, 4)})
    s.add_request(Request("b", prompt[:8] + [99], max_tokens=10))  # hit: 8 of 9 tokens
    out = s.schedule()
    b = next(x for x in out.scheduled if x.request_id == "b")
    assert (b.num_computed_tokens, b.num_scheduled_tokens, b.spec_token_ids) == (8, 4, (-1, -1, -1))


def test_async_placeholders_cover_the_sampled_token_and_the_drafts():
    s = _sched(SchedulerConfig(num_speculative_tokens=2, async_scheduling=True))
    s.add_request(Request("a", [1, 2, 3], max_tokens=10))
    out1 = s.schedule()
    a = s.requests["a"]
    assert a.num_output_placeholders == 1
    assert s.snapshot().requests["a"].spec_token_ids == (-1, -1)  # placeholder drafts for the next step
    out2 = s.schedule()
    assert out2.scheduled[0].spec_token_ids == (-1, -1) and out2.scheduled[0].num_scheduled_tokens == 3
    assert a.num_output_placeholders == 4
    s.update_from_output(out1, ModelOutput({"a": [7]}))
    s.update_from_output(out2, ModelOutput({"a": [8]}))  # no draft accepted
    assert a.num_output_placeholders == 0 and a.num_computed_tokens == a.num_tokens - 1 == 4
    s.check_invariants()


def test_drafts_the_runner_left_empty_are_left_out_of_the_stats():
    s = _sched(SchedulerConfig(num_speculative_tokens=3, async_scheduling=True))
    s.add_request(Request("a", [1, 2, 3], max_tokens=10))
    out1, out2 = s.schedule(), s.schedule()
    assert out2.scheduled[0].spec_token_ids == (-1, -1, -1)
    s.update_draft_token_ids_in_output(DraftTokenIds(("a",), ((5,),)), out2)  # one of three filled
    s.update_from_output(out1, ModelOutput({"a": [7]}))
    s.update_from_output(out2, ModelOutput({"a": [5, 8]}))
    assert s.spec_decoding_stats == SpecDecodingStats(3, 1, 1, 1, (1, 0, 0), (1, 0, 0))
    a = s.requests["a"]
    assert a.num_computed_tokens == a.num_tokens - 1  # the rollback counts all three scheduled drafts
    with pytest.raises(InvalidFieldError, match="output"):
        s.update_draft_token_ids_in_output(DraftTokenIds(("a",), ((5,),)), out2)  # already settled


def test_skip_drafts_when_no_scheduled_request_can_use_them():
    cfg = SchedulerConfig(max_num_batched_tokens=8, num_speculative_tokens=2, speculative_method=EAGLE,
                          skip_unused_drafts=True)
    s = _sched(cfg)
    s.add_request(Request("a", list(range(1, 13)), max_tokens=1))
    assert _step(s).skip_drafts  # a non-final chunk
    assert _step(s).skip_drafts  # the final chunk samples the only output token
    s.add_request(Request("b", [1, 2], max_tokens=3))
    assert not _step(s).skip_drafts


def test_drafts_unused_counts_an_in_flight_sample():
    r = Request("a", list(range(16)), max_tokens=3)
    assert drafts_unused(r, 0, 8) and not drafts_unused(r, 0, 16)
    r.num_output_placeholders = 2
    assert not drafts_unused(r, 17, 3)
    r.output_token_ids.append(5)
    assert drafts_unused(r, 18, 3)


def test_eagle_reserves_lookahead_slots():
    base = _sched(SchedulerConfig(num_speculative_tokens=3))
    eagle = _sched(SchedulerConfig(num_speculative_tokens=3, speculative_method=EAGLE))
    for s in (base, eagle):
        s.add_request(Request("a", [1, 2, 3, 4], max_tokens=4))
        s.schedule()
    # 4 tokens fill one block of 4; 3 lookahead slots need a second
    assert [len(s.snapshot().block_ids["a"][0]) for s in (base, eagle)] == [1, 2]


def test_bad_spec_decode_input_is_refused_naming_the_field():
    with pytest.raises(InvalidFieldError, match="num_speculative_tokens"):
        SchedulerConfig(num_speculative_tokens=-1)
    with pytest.raises(InvalidFieldError, match="speculative_method"):
        SchedulerConfig(num_speculative_tokens=1, speculative_method="medusa")
    with pytest.raises(InvalidFieldError, match="num_speculative_tokens"):
        SchedulerConfig(max_num_batched_tokens=4, num_speculative_tokens=4, speculative_method=EAGLE)
    with pytest.raises(InvalidFieldError, match="draft_token_ids"):
        DraftTokenIds(("a",), ())
    cfg = SchedulerConfig(num_speculative_tokens=2, speculative_method=EAGLE)
    fa = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16")
    pool = PoolConfig(num_blocks=8, groups=(KVCacheGroupSpec(("full",), fa),), max_model_len=16,
                      scheduler_block_size=4, hash_block_size=4, max_in_flight_tokens=cfg.max_in_flight_tokens)
    with pytest.raises(InvalidFieldError, match="pool.use_eagle"):
        Scheduler(pool, cfg)
    s = _sched(SchedulerConfig(num_speculative_tokens=2))
    s.add_request(Request("a", [1, 2], max_tokens=4))
    _step(s)
    with pytest.raises(InvalidFieldError, match="at most num_speculative_tokens"):
        s.update_draft_token_ids(DraftTokenIds(("a",), ((1, 2, 3),)))
    with pytest.raises(InvalidFieldError, match="draft_token_ids"):
        s.update_draft_token_ids({"a": [1]})
    assert s.snapshot().requests["a"].spec_token_ids == ()  # nothing half-updated
    s.update_draft_token_ids(DraftTokenIds(("a",), ((1, 2),)))
    out = s.schedule()
    with pytest.raises(InvalidFieldError, match="sampled_token_ids"):
        s.update_from_output(out, ModelOutput({"a": [1, 2, 3, 4]}))  # 2 drafts: at most 3 tokens


def test_reference_spec_decode_machine_keeps_invariants_and_drains():
    """The reference alone on spec-decode setups: invariants after every operation, liveness drain
    at teardown on startup-consistent ones."""
    machine = machine_with({"ref": lambda p, c: Scheduler(p, c)}, setups=scheduler_setups(spec=True),
                           name="ReferenceSpecDecodeMachine", spec=True)
    COVERAGE.clear()
    run_state_machine_as_test(machine, _min_steps=31,
                              settings=settings(max_examples=profile_examples(20, 150), stateful_step_count=45))
    assert COVERAGE["spec_verify_steps"] > 0, dict(COVERAGE)
