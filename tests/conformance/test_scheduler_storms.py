"""The scheduler machine reaches preemption storms: victims chosen while other requests run.

Issue #13 measured faults in vLLM's victim choice (``running.pop()`` vs the oldest) and in where a
preempted request goes back (front of the waiting queue) surviving ``kvref verify``'s default
profile: one-at-a-time arrivals on roomy pools almost never preempt with several requests running.
The setups now include storms (several requests allowed to run, no spare block) and a burst rule
(three arrivals at once); this test asserts, with a counter that can stay zero, that the
lock-step run against vLLM's ``Scheduler`` preempts while others run, and that vLLM and the
reference agree throughout.
"""

from __future__ import annotations

import pytest

from kvref.models.machines.scheduler import run_scheduler_machine
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


def test_preemption_storms_reach_victim_choice_and_match_vllm():
    require_vllm()
    run = run_scheduler_machine(with_vllm=True, examples=profile_examples(25, 60), reproducible=True, shrink=False)
    assert run.ok, run.failure
    assert run.coverage.get("preempted_while_others_run", 0) > 0, run.coverage
    assert run.coverage.get("scheduled_resumed", 0) > 0, run.coverage  # preempted requests came back
