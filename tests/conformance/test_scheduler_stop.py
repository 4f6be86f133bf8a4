"""The scheduler's stop rules (issue #22): EOS tokens, ``min_tokens`` and repetition detection,
modelled in :mod:`kvref.impl.reference.scheduler_stop` and compared with vLLM 0.33.0's own
``check_stop`` inside whole scheduler steps (``scheduler_stop`` machine, part of
``conform-scheduler``); the vLLM source faults of the catalogue's ``stop`` class must diverge."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvref.impl.reference.scheduler_stop import ends_in_repetition, stop_reason
from kvref.impl.request import RepetitionDetectionParams, Request
from kvref.spec.errors import InvalidFieldError
from tests.conftest import profile_examples
from tests.conformance.scheduler_targets import vllm_scheduler  # noqa: F401 - the module-scoped fixture

#: the derandomized traces the tests run (the check draws 8 at fast, 30 at ci)
EXAMPLES = 8
STOP_FAULTS = ("sched.stop_eos_held_by_min_tokens", "sched.stop_min_tokens_off_by_one",
               "sched.repetition_pattern_filling_output_missed", "sched.repetition_one_copy_short",
               "sched.repetition_reported_as_stop")


def _req(outputs, **kw) -> Request:
    r = Request("r", [1, 2, 3], **{"max_tokens": 16, **kw})
    r.output_token_ids = list(outputs)
    return r


def test_rules_apply_in_vllms_order():
    rep = RepetitionDetectionParams(1, 1, 2)
    # EOS and stop tokens finish even before min_tokens; repetition waits for it
    assert stop_reason(_req([5, 9], eos_token_id=9, min_tokens=8), 64) == "stop"
    assert stop_reason(_req([5, 7], stop_token_ids=(7,), min_tokens=8), 64) == "stop"
    assert stop_reason(_req([5, 5], min_tokens=3, repetition_detection=rep), 64) is None
    assert stop_reason(_req([5, 5, 5], min_tokens=3, repetition_detection=rep), 64) == "repetition"
    # the length caps come before repetition (and after the stop tokens)
    assert stop_reason(_req([5, 5], max_tokens=2, repetition_detection=rep), 64) == "length"
    assert stop_reason(_req([5, 7], max_tokens=2, stop_token_ids=(7,)), 64) == "stop"
    assert stop_reason(_req([5, 6]), 5) == "length"  # 3 prompt + 2 outputs reach max_model_len
    assert stop_reason(_req([5, 6], eos_token_id=None), 64) is None


def test_repetition_pattern_sizes_and_counts():
    # "ab ab ab": a 2-gram three times
    out = [1, 2, 1, 2, 1, 2]
    assert ends_in_repetition(out, RepetitionDetectionParams(2, 2, 3))
    assert not ends_in_repetition(out, RepetitionDetectionParams(1, 1, 2))  # no 1-gram twice at the end
    assert not ends_in_repetition(out, RepetitionDetectionParams(2, 2, 4))  # four copies need 8 tokens
    assert ends_in_repetition(out, RepetitionDetectionParams(3, 0, 2))  # min 0 means 1; n=2 matches
    assert not ends_in_repetition(out, RepetitionDetectionParams(0, 0, 0))  # detection off
    assert not ends_in_repetition([1, 2, 1, 2, 1, 3], RepetitionDetectionParams(3, 1, 2))


@settings(max_examples=profile_examples(60, 300), deadline=None)
@given(st.lists(st.integers(0, 2), max_size=10), st.integers(0, 3), st.integers(0, 3), st.integers(2, 4))
def test_repetition_matches_a_brute_force_reading(tokens, max_size, min_size, count):
    """An independent oracle: some n in the sizes where the last ``n * count`` tokens are ``count``
    copies of the last ``n``."""
    if min_size > max_size:
        min_size, max_size = max_size, min_size
    params = RepetitionDetectionParams(max_size, min_size, count if max_size else 0)
    want = max_size > 0 and any(
        n * count <= len(tokens) and tokens[len(tokens) - n * count:] == tokens[len(tokens) - n:] * count
        for n in range(max(1, min_size), max_size + 1))
    assert ends_in_repetition(tokens, params) == want


@pytest.mark.parametrize("kwargs, field", [
    ({"min_tokens": 17}, "min_tokens"), ({"min_tokens": -1}, "min_tokens"), ({"eos_token_id": -2}, "eos_token_id"),
    ({"eos_token_id": "9"}, "eos_token_id"), ({"repetition_detection": (1, 1, 2)}, "repetition_detection")])
def test_bad_stop_fields_are_rejected(kwargs, field):
    with pytest.raises(InvalidFieldError, match=field):
        Request("r", [1], max_tokens=16, **kwargs)


@pytest.mark.parametrize("args, field", [((1, 2, 2), "min_pattern_size"), ((2, 0, 1), "min_count"),
                                         ((-1, 0, 0), "max_pattern_size"), ((1, 0, 2.0), "min_count")])
def test_bad_repetition_params_are_rejected(args, field):
    with pytest.raises(InvalidFieldError, match=field):
        RepetitionDetectionParams(*args)


def test_a_repetition_finish_frees_the_blocks_in_the_same_update():
    from kvref.impl.interface import PoolConfig
    from kvref.impl.reference.scheduler import Scheduler
    from kvref.impl.scheduler_types import ModelOutput, SchedulerConfig
    from kvref.models.machines.scheduler import _attn
    from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    cfg = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=2)
    pool = PoolConfig.off_plan("one request", num_blocks=8,
                               groups=(KVCacheGroupSpec(("full",), _attn(FullAttentionSpec, 4)),), max_model_len=32,
                               scheduler_block_size=4, hash_block_size=4,
                               max_in_flight_tokens=cfg.max_in_flight_tokens, enable_caching=True)
    s = Scheduler(pool, cfg)
    free = s.kv_cache_manager.get_num_free_blocks()
    r = Request("a", [1, 2, 3, 4, 5], max_tokens=10, min_tokens=2,
                repetition_detection=RepetitionDetectionParams(1, 1, 2))
    s.add_request(r)
    for token, finished in ((6, False), (6, True)):
        out = s.schedule()
        s.update_from_output(out, ModelOutput({"a": [token]}))
        assert (r.finish_reason == "repetition") is finished
    assert r.output_token_ids == [6, 6] and "a" not in s.requests
    assert s.kv_cache_manager.get_num_free_blocks() == free
    s.check_invariants()


@pytest.mark.vllm
def test_stop_rule_traces_match_vllm_and_reach_every_rule(vllm_scheduler):
    from kvref.models.machines.scheduler_stop import run_stop_machine

    run = run_stop_machine(EXAMPLES, reproducible=True)
    assert run.ok, run.failure
    assert run.traces >= 6
    for path in ("stop_eos", "finished_repetition", "repetition_held_by_min_tokens", "repetition_at_min_tokens",
                 "finished_length"):
        assert run.coverage.get(path, 0) > 0, (path, run.coverage)


@pytest.mark.vllm
@pytest.mark.parametrize("fault_id", STOP_FAULTS)
def test_planted_check_stop_fault_is_a_divergence(vllm_scheduler, fault_id, monkeypatch):
    import vllm.v1.core.sched.scheduler as vllm_sched
    import vllm.v1.core.sched.utils as vllm_utils

    from kvref.models.machines.scheduler_stop import run_stop_machine
    from tests.vllm_faults import planted_vllm_fault

    with planted_vllm_fault(fault_id, ("v1/core/sched/utils.py",)):
        # the scheduler imported check_stop by name: point it at the planted module function
        monkeypatch.setattr(vllm_sched, "check_stop", vllm_utils.check_stop)
        run = run_stop_machine(EXAMPLES, reproducible=True, shrink=False)
    assert not run.ok
    assert "Divergence" in run.failure, run.failure
