"""Admissions padded to ``1 + num_spec_tokens`` rows in ``conform-spec-decode`` (#22): arrivals
repeating an earlier prompt to one token past a block, reference in lock step with vLLM 0.33.0
(``models/machines/scheduler_spec_padding.py``).

A planted fault in vLLM's own waiting loop (the padding dropped) must diverge: the padded rows are
scheduled tokens and KV slots the reference counts."""

from __future__ import annotations

import pytest

from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


def _run(examples: int):
    from kvref.models.machines.scheduler_spec_padding import run_spec_padding_machine

    return run_spec_padding_machine(examples, reproducible=True, shrink=False)


def test_padded_admissions_match_vllm():
    require_vllm()
    run = _run(profile_examples(4, 20))
    assert run.ok, run.failure
    assert run.traces >= 3
    for path in ("spec_repeated_prompts", "spec_padded", "spec_padded_prefix_hit", "spec_verify_steps"):
        assert run.coverage.get(path, 0) > 0, (path, run.coverage)


def test_vllm_without_admission_padding_diverges(monkeypatch):
    """vLLM's scheduler told it runs dynamic speculative decoding with a lookup that always picks
    ``num_spec_tokens`` (the same drafts as before), which only switches the admission padding
    off: arrivals with one token left are admitted un-padded."""
    require_vllm()
    from vllm.v1.core.sched.scheduler import Scheduler

    class SameK:
        def __init__(self, k: int) -> None:
            self.k = k

        def __getitem__(self, num_reqs: int) -> int:
            return self.k

    real = Scheduler.schedule

    def unpadded(self):
        if self.num_spec_tokens and self.dynamic_sd_lookup is None:
            self.dynamic_sd_lookup = SameK(self.num_spec_tokens)
        return real(self)

    monkeypatch.setattr(Scheduler, "schedule", unpadded)
    run = _run(profile_examples(4, 10))
    assert not run.ok, "admissions without spec-decode padding went unnoticed"
    # the un-padded admission shows at its schedule() or, since session 12's MTP setups moved the
    # draws, first as the fewer KV blocks it holds once the step's output is processed
    assert "schedule" in run.failure or ("blocks r" in run.failure and "num_free_blocks" in run.failure), \
        run.failure[:500]
