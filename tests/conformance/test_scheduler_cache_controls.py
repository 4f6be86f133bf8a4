"""The second half of ``conform-scheduler`` (issue #22): salted and cache-skipping arrivals,
multi-turn follow-ups, ``reset_prefix_cache`` through the scheduler and FA + Mamba "align" pools,
the reference scheduler in lock step with vLLM 0.33.0's (``scheduler_cache_controls``).

The planted faults show the comparison sees each control: vLLM handed a request without its salt
(or without its skip flag) must diverge from the reference that keeps it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.conftest import profile_examples
from tests.conformance.scheduler_targets import vllm_scheduler  # noqa: F401 - the module-scoped fixture

pytestmark = pytest.mark.vllm


def test_cache_control_traces_match_vllm_and_reach_every_control(vllm_scheduler):
    from kvref.models.machines.scheduler_cache_controls import run_cache_controls_machine

    run = run_cache_controls_machine(profile_examples(12, 40), reproducible=True)
    assert run.ok, run.failure
    c = run.coverage
    assert run.traces >= 10
    for path in ("salted_arrivals", "skip_reading_arrivals", "follow_ups", "reset_prefix_cache_done",
                 "prefix_hits", "prefill_chunks", "spec_draft_updates", "urgent_arrivals"):
        assert c.get(path, 0) > 0, (path, c)


@pytest.mark.parametrize("dropped", ["cache_salt", "skip_reading_prefix_cache"])
def test_a_control_vllm_is_not_handed_is_a_divergence(vllm_scheduler, monkeypatch, dropped):
    """vLLM's scheduler sees the request without the control, the reference with it: a follow-up
    under another salt (or one that must skip the cache) hits on vLLM only."""
    from kvref.models.machines.scheduler_cache_controls import run_cache_controls_machine

    original = vllm_scheduler.VllmScheduler.add_request
    default = {"cache_salt": None, "skip_reading_prefix_cache": False}[dropped]

    def without_control(self, request):
        original(self, replace(request, **{dropped: default}))

    monkeypatch.setattr(vllm_scheduler.VllmScheduler, "add_request", without_control)
    run = run_cache_controls_machine(profile_examples(12, 40), reproducible=True, shrink=False)
    assert not run.ok
    assert "schedule" in run.failure or "differ" in run.failure, run.failure


def test_a_diffusion_scheduler_that_cuts_drafts_short_is_a_divergence(vllm_scheduler, monkeypatch):
    """With speculative decoding the run drives vLLM's diffusion-LM scheduler, which must keep
    ``num_speculative_tokens`` drafts for a request without a canvas of its own: a canvas one
    token narrower drops drafts the reference schedules."""
    from vllm.v1.core.sched import diffusion_scheduler

    from kvref.models.machines.scheduler_cache_controls import run_cache_controls_machine

    monkeypatch.setattr(diffusion_scheduler, "diffusion_canvas_width",
                        lambda request, canvas_length: max(1, canvas_length - 1))
    run = run_cache_controls_machine(profile_examples(12, 40), reproducible=True, shrink=False)
    assert not run.ok, "a narrower canvas went unnoticed"
