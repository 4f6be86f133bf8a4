"""The reference scheduler on FA + Mamba "align" pools (prefix caching on) in lock step with vLLM
0.33.0's own ``Scheduler``: its ``_mamba_block_aligned_split`` clips every prefill chunk to Mamba
state boundaries, the reference's scheduler_mamba_split must clip the same, and the Mamba prefix
caching behind them (hits on aligned states, the same-step guard) must agree (issue #23)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from kvref.impl.reference.scheduler import Scheduler
from kvref.models.machines.scheduler import COVERAGE, MAMBA_ALIGN_KINDS, machine_with, scheduler_setups
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


def test_generated_mamba_align_scheduler_traces_match_vllm():
    require_vllm()
    from kvref.impl.vllm import scheduler as vllm_scheduler

    env = vllm_scheduler.VllmEnv()
    targets = {"vllm": lambda p, c: vllm_scheduler.VllmScheduler(p, c, env), "ref": lambda p, c: Scheduler(p, c)}
    machine = machine_with(targets, setups=scheduler_setups(kinds=MAMBA_ALIGN_KINDS), name="MambaAlignScheduler")
    COVERAGE.clear()
    run_state_machine_as_test(machine, settings=settings(max_examples=profile_examples(15, 60),
                                                         stateful_step_count=30, deadline=None))
    assert COVERAGE["scheduled_running"] > 0 and COVERAGE["steps_sync"] > 0
