"""The SWA bounded-replay part of ``conform-scheduler`` (DeepSeek-V4.1, issue #22): the reference
scheduler in lock step with vLLM 0.33.0's on full attention + ``SlidingWindowMLASpec(bounded_replay
=True)`` pools (``scheduler_prefix_replay``).

The planted faults show that the comparison watches the replay: a reference that rewinds a hit by
one token less than the window, a reference that keeps hits no longer than the window, and a vLLM
scheduler that reports the wrong ``replay_start`` must each diverge."""

from __future__ import annotations

import pytest

from tests.conftest import profile_examples
from tests.conformance.scheduler_targets import vllm_scheduler  # noqa: F401 - the module-scoped fixture

pytestmark = pytest.mark.vllm


def test_the_adapter_builds_vllms_bounded_replay_spec(vllm_scheduler):
    from vllm.v1.kv_cache_interface import SlidingWindowMLASpec as VllmSpec

    from kvref.impl.vllm.specs import to_vllm_spec
    from kvref.spec.kv_cache_interface import SlidingWindowMLASpec

    for replay in (True, False):
        ours = SlidingWindowMLASpec(block_size=4, num_kv_heads=1, head_size=16, dtype="float16", sliding_window=6,
                                    bounded_replay=replay, alignment=100)
        theirs = to_vllm_spec(ours)
        assert type(theirs) is VllmSpec and theirs.bounded_replay is replay
        assert (theirs.prefix_cacheable, theirs.prefix_replay_tokens, theirs.page_size_bytes) == \
            (ours.prefix_cacheable, ours.prefix_replay_tokens, ours.page_size_bytes)


def test_replay_traces_match_vllm_and_reach_the_replay_and_the_dropped_hits(vllm_scheduler):
    from kvref.models.machines.scheduler_prefix_replay import run_prefix_replay_machine

    run = run_prefix_replay_machine(profile_examples(8, 12), reproducible=True)
    assert run.ok, run.failure
    c = run.coverage
    assert c["replay_admissions"] > 0 and c["replay_hits_dropped"] > 0, c
    assert c.get("prefix_hits", 0) > 0 and c.get("follow_ups", 0) > 0, c


def _run_with(monkeypatch, module, name, fake):
    from kvref.models.machines.scheduler_prefix_replay import run_prefix_replay_machine

    monkeypatch.setattr(module, name, fake)
    return run_prefix_replay_machine(profile_examples(8, 12), reproducible=True, shrink=False)


def test_a_reference_rewinding_one_token_short_is_a_divergence(vllm_scheduler, monkeypatch):
    from kvref.impl.reference import scheduler_prefix_replay as m

    original = m.replay_admission
    run = _run_with(monkeypatch, m, "replay_admission", lambda w, n: original(w - 1, n) if n > w > 1 else original(w, n))
    assert not run.ok, "a replay one token short went unnoticed"
    assert run.failure.startswith("Divergence"), run.failure


def test_a_reference_keeping_short_hits_is_a_divergence(vllm_scheduler, monkeypatch):
    from kvref.impl.reference import scheduler_prefix_replay as m

    run = _run_with(monkeypatch, m, "drop_short_hit", lambda window, num_hit: False)
    assert not run.ok, "a kept hit within the window went unnoticed"
    assert run.failure.startswith("Divergence"), run.failure


def test_a_vllm_replay_start_off_by_one_is_a_divergence(vllm_scheduler, monkeypatch):
    """vLLM's ``_mark_prefix_replay`` rewinds right but records ``replay_start`` one token late:
    only the ``replay_start`` comparison can see it (the scheduled tokens are unchanged)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler._mark_prefix_replay

    def late(self, request, num_hit_tokens, window_loaded):
        n = original(self, request, num_hit_tokens, window_loaded)
        if n:
            request.replay_start += 1
        return n

    run = _run_with(monkeypatch, Scheduler, "_mark_prefix_replay", late)
    assert not run.ok, "a wrong replay_start went unnoticed"
    assert "replay_start" in run.failure, run.failure
