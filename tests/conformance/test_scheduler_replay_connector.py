"""SWA bounded replay beside a KV connector, a part of ``conform-connector`` (DeepSeek-V4.1, issue
#22): the reference scheduler and vLLM 0.33.0's, a scripted connector each, in lock step on full
attention + ``SlidingWindowMLASpec(bounded_replay=True)`` pools (``scheduler_replay_connector``).

The planted faults show that the comparison watches each rule of the connector path: a reference
that ignores a load carrying the window, a reference that never cuts a load without the window to
whole blocks, a vLLM ``_mark_prefix_replay`` that ignores ``window_loaded``, a vLLM that promotes a
landed async load without its replay, a vLLM whose connector loads never count as carrying the
window, and a vLLM recording a wrong ``replay_start`` for a load with the window must each diverge.
About 18 s for the file at CI=true (vLLM's import included; 8 reproducible examples a run)."""

from __future__ import annotations

import pytest

from tests.conformance.scheduler_targets import vllm_scheduler  # noqa: F401 - the module-scoped fixture

pytestmark = pytest.mark.vllm

#: enough reproducible examples to reach every rule (8: each planted fault below diverges)
EXAMPLES = 8


def _run():
    from kvref.models.machines.scheduler_replay_connector import run_replay_connector_machine

    return run_replay_connector_machine(EXAMPLES, reproducible=True, shrink=False)


def test_replay_connector_traces_match_vllm_and_reach_every_rule(vllm_scheduler):
    run = _run()
    assert run.ok, run.failure
    c = run.coverage
    for key in ("replay_external_hits_cut", "replay_window_loaded", "replay_connector_hits_dropped",
                "replay_connector_rewound", "replay_after_async_load", "multi_connector_loads"):
        assert c.get(key, 0) > 0, (key, c)


def _diverges(run, what: str) -> None:
    assert not run.ok, f"{what} went unnoticed"
    assert run.failure.startswith("Divergence"), run.failure


def test_a_reference_ignoring_a_load_with_the_window_is_a_divergence(vllm_scheduler, monkeypatch):
    from kvref.impl.reference import scheduler_prefix_replay as m

    original = m.mark_prefix_replay
    monkeypatch.setattr(m, "mark_prefix_replay", lambda window, num_hit, loaded: original(window, num_hit, False))
    _diverges(_run(), "a replayed load that carried the window")


def test_a_reference_not_cutting_external_hits_is_a_divergence(vllm_scheduler, monkeypatch):
    from kvref.impl.reference import scheduler_prefix_replay as m

    monkeypatch.setattr(m, "trim_external_hit", lambda block_size, num_external, load_async, loaded:
                        (num_external, load_async))
    _diverges(_run(), "an external hit left with a partial block")


def test_a_vllm_mark_prefix_replay_ignoring_window_loaded_is_a_divergence(vllm_scheduler, monkeypatch):
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler._mark_prefix_replay
    monkeypatch.setattr(Scheduler, "_mark_prefix_replay",
                        lambda self, request, num_hit_tokens, window_loaded: original(self, request, num_hit_tokens,
                                                                                      False))
    _diverges(_run(), "vLLM replaying a load that carried the window")


def test_a_vllm_promoting_a_load_without_its_replay_is_a_divergence(vllm_scheduler, monkeypatch):
    """vLLM's ``_update_waiting_for_remote_kv`` records the replay but does not rewind the computed
    tokens by it (the ``num_computed_tokens -= num_replay_tokens`` after an async load lost)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler._update_waiting_for_remote_kv

    def no_rewind(self, request):
        mark = Scheduler._mark_prefix_replay
        self._mark_prefix_replay = lambda r, n, window_loaded: (mark(self, r, n, window_loaded), 0)[1]
        try:
            return original(self, request)
        finally:
            del self._mark_prefix_replay

    monkeypatch.setattr(Scheduler, "_update_waiting_for_remote_kv", no_rewind)
    _diverges(_run(), "a landed load promoted without its replay")


def test_a_vllm_whose_loads_never_carry_the_window_is_a_divergence(vllm_scheduler, monkeypatch):
    from vllm.v1.core.sched.scheduler import Scheduler

    monkeypatch.setattr(Scheduler, "_load_restores_replay_window", lambda self, request: False)
    _diverges(_run(), "a P/D load's window ignored")


def test_a_vllm_replay_start_wrong_after_a_load_with_the_window_is_a_divergence(vllm_scheduler, monkeypatch):
    """vLLM takes a load carrying the window whole but records ``replay_start`` at the hit's end
    instead of 0: only the ``replay_start`` comparison can see it (the scheduled tokens are unchanged)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler._mark_prefix_replay

    def late(self, request, num_hit_tokens, window_loaded):
        n = original(self, request, num_hit_tokens, window_loaded)
        if window_loaded:
            request.replay_start = num_hit_tokens
        return n

    monkeypatch.setattr(Scheduler, "_mark_prefix_replay", late)
    run = _run()
    _diverges(run, "a wrong replay_start after a load with the window")
    assert "replay_start" in run.failure, run.failure
