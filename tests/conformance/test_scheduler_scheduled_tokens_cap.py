"""An explicit ``max_num_scheduled_tokens`` (vLLM's ``--max-num-scheduled-tokens``), compared with
vLLM 0.33.0's ``Scheduler`` (#22, #28).

vLLM keeps two step budgets: ``token_budget`` (``max_num_scheduled_tokens``) and ``input_budget``
(``max_num_batched_tokens``), takes both down by every scheduled chunk and stops a loop when either
runs out; its Mamba ``align`` split caps a chunk by ``max_num_scheduled_tokens`` alone. kvref's
scheduler took one budget, ``max_num_batched_tokens``, and check-run declined every trace recorded
with the field set. These tests drive both schedulers in lock step on setups with the cap below
and above the input budget, and show that a reference which ignores the cap is caught.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from kvref.impl.interface import PoolConfig
from kvref.impl.reference.scheduler import Scheduler
from kvref.impl.request import Request
from kvref.impl.scheduler_types import SchedulerConfig
from kvref.models.machines.scheduler import (COVERAGE, Divergence, machine_with, scheduler_setups,
                                             with_scheduled_tokens_cap)
from kvref.models.run_check.setup import setup_from_header
from kvref.spec.errors import InvalidFieldError
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from tests.conftest import profile_examples
from tests.conformance.scheduler_targets import scheduler_targets as _targets
from tests.conformance.scheduler_targets import vllm_env  # noqa: F401 - the module-scoped fixture

pytestmark = pytest.mark.vllm


def _capped_setups():
    return scheduler_setups().filter(lambda s: s[1].max_num_scheduled_tokens is not None)


def _pool(num_blocks: int = 40, max_model_len: int = 64) -> PoolConfig:
    spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16")
    return PoolConfig.off_plan("a hand-built pool for one budget comparison", num_blocks=num_blocks,
                               groups=(KVCacheGroupSpec(("full",), spec),), max_model_len=max_model_len,
                               scheduler_block_size=4, hash_block_size=4, max_in_flight_tokens=16,
                               enable_caching=True)


def test_the_config_field_is_checked_and_the_step_takes_the_smaller_budget():
    with pytest.raises(InvalidFieldError, match="max_num_scheduled_tokens"):
        SchedulerConfig(max_num_batched_tokens=16, max_num_scheduled_tokens=0)
    assert SchedulerConfig(max_num_batched_tokens=16).step_token_budget == 16
    assert SchedulerConfig(max_num_batched_tokens=16, max_num_scheduled_tokens=6).step_token_budget == 6
    wide = SchedulerConfig(max_num_batched_tokens=16, max_num_scheduled_tokens=40)
    assert (wide.step_token_budget, wide.scheduled_tokens_cap) == (16, 40)


@pytest.mark.parametrize("cap,expected", [(6, 6), (40, 16), (None, 16)])
def test_a_prompt_is_chunked_by_the_smaller_budget_on_both(vllm_env, cap, expected):
    targets = _targets(vllm_env, shim=False)
    cfg = SchedulerConfig(max_num_batched_tokens=16, max_num_scheduled_tokens=cap, max_num_seqs=2)
    for name, make in targets.items():
        sched = make(_pool(), cfg)
        sched.add_request(Request("r0", list(range(1, 31)), max_tokens=2))
        out = sched.schedule()
        assert [(s.request_id, s.num_scheduled_tokens) for s in out.scheduled] == [("r0", expected)], name


def test_generated_capped_setups_match_vllm(vllm_env):
    """Setups of the main machine with the cap drawn (half below, half above the input budget)."""
    COVERAGE.clear()
    machine = machine_with(_targets(vllm_env, shim=False), setups=_capped_setups(), name="ScheduledTokensCap")
    run_state_machine_as_test(machine, _min_steps=21,
                              settings=settings(max_examples=profile_examples(4, 12), stateful_step_count=30))
    assert COVERAGE["prefill_chunks"] > 0, dict(COVERAGE)


def test_a_reference_that_ignores_the_cap_is_caught(vllm_env, monkeypatch):
    """The planted fault: the reference schedules up to the input budget, as before this change."""
    monkeypatch.setattr(SchedulerConfig, "step_token_budget", property(lambda self: self.max_num_batched_tokens))
    machine = machine_with(_targets(vllm_env, shim=False),
                           setups=_capped_setups().filter(lambda s: s[1].max_num_scheduled_tokens
                                                          < s[1].max_num_batched_tokens),
                           name="ScheduledTokensCapFault")
    with pytest.raises(Divergence) as caught:  # the lock step's report, the first one found, unshrunk
        run_state_machine_as_test(machine, _min_steps=11,
                                  settings=settings(max_examples=20, stateful_step_count=20, derandomize=True,
                                                    database=None, print_blob=False, report_multiple_bugs=False,
                                                    phases=(Phase.generate,)))
    assert "vllm" in str(caught.value) and "ref" in str(caught.value), str(caught.value)[:500]


def test_the_generator_draws_both_sides_of_the_input_budget_and_respects_the_drafts():
    chunked = SchedulerConfig(max_num_batched_tokens=16)
    picks = {with_scheduled_tokens_cap(chunked, salt).max_num_scheduled_tokens for salt in range(12)}
    assert {8, 32, None} <= picks
    spec = SchedulerConfig(max_num_batched_tokens=4, num_speculative_tokens=3)
    caps = {with_scheduled_tokens_cap(spec, salt).max_num_scheduled_tokens for salt in range(12)} - {None}
    assert caps and min(caps) >= 4  # one decode plus its drafts always fits
    whole = replace(chunked, enable_chunked_prefill=False)
    assert all(with_scheduled_tokens_cap(whole, salt) is whole for salt in range(12))


def test_check_run_replays_a_trace_recorded_with_the_cap():
    header = {"pool": {"num_blocks": 8, "max_model_len": 32, "scheduler_block_size": 4, "hash_block_size": 4,
                       "groups": [{"spec": {"type": "FullAttentionSpec", "block_size": 4, "num_kv_heads": 1,
                                            "head_size": 8, "dtype": "float16"}}]},
              "scheduler": {"max_num_batched_tokens": 16, "max_num_scheduled_tokens": 6, "max_num_seqs": 2}}
    setup = setup_from_header(header)
    assert setup.config is not None, setup.unmodelled
    assert setup.config.max_num_scheduled_tokens == 6 and setup.config.step_token_budget == 6
    assert not any("max_num_scheduled_tokens" in u for u in setup.unmodelled)
    same = setup_from_header({**header, "scheduler": {**header["scheduler"], "max_num_scheduled_tokens": 16}})
    assert same.config.max_num_scheduled_tokens is None


def test_the_reference_alone_keeps_both_budgets():
    cfg = SchedulerConfig(max_num_batched_tokens=16, max_num_scheduled_tokens=5, max_num_seqs=3)
    sched = Scheduler(_pool(), cfg)
    for i in range(3):
        sched.add_request(Request(f"r{i}", list(range(10 * i + 1, 10 * i + 9)), max_tokens=2))
    out = sched.schedule()
    assert sum(s.num_scheduled_tokens for s in out.scheduled) == 5
