"""Streaming-input sessions (issue #22): kvref's session rules
(:mod:`kvref.impl.reference.scheduler_streaming`) against vLLM 0.33.0's own ``Scheduler.add_request``,
``_handle_stopped_request`` and ``_update_request_as_session`` on generated session histories.

Each history is a list of operations on one session: a turn generates tokens (with placeholders and
in-flight tokens left by async scheduling), a turn stops, an update arrives (queued while the
session runs, applied at once while it waits for input), a finishing update arrives, the session is
aborted. After every operation every observable is compared (prompt, outputs, computed tokens,
placeholders, stale output, ``max_tokens``, ``arrival_time``, waiting-for-input, queued updates,
``num_waiting_for_streaming_input``, liveness), and vLLM's block hashes must equal the hashes of
a fresh request over the same tokens (an independent oracle: a dropped token's hash must not
survive). Planted faults in vLLM must diverge."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm


@pytest.fixture(scope="module")
def vs_factory():
    require_vllm()
    from kvref.models.machines.scheduler_streaming import streaming_scheduler_factory  # noqa: PLC0415 - vLLM

    return streaming_scheduler_factory()


def run_history(vs, ops):
    from kvref.models.machines.scheduler_streaming import run_history as run

    run(vs, ops)


@pytest.mark.vllm
def test_generated_session_histories_match_vllm(vs_factory):
    from kvref.models.machines.scheduler_streaming import run_streaming_sessions

    run = run_streaming_sessions(profile_examples(40, 120))
    assert run.ok, run.failure
    assert run.traces >= 40 and run.ops > run.traces


@pytest.mark.vllm
def test_derandomized_histories_reach_every_session_path(vs_factory):
    from kvref.models.machines.scheduler_streaming import run_streaming_sessions

    # derandomized under every profile: the rare paths asserted below are reached by these 200
    run = run_streaming_sessions(200, reproducible=True)
    assert run.ok, run.failure
    for path in ("update_queued", "update_applied_at_once", "stop_applied_queued_update", "stop_waits_for_input",
                 "stop_finished_by_queued_none", "finish_queued", "finish_while_waiting", "abort_while_waiting",
                 "update_drops_a_full_blocks_hash"):
        assert run.coverage.get(path), f"path {path} not reached: {run.coverage}"


class _KeepAll(list):
    """A block-hash list whose deletions do nothing (a planted fault)."""

    def __delitem__(self, key):
        return None


@contextmanager
def _patched(cls, name, wrapper):
    orig = getattr(cls, name)
    setattr(cls, name, wrapper(orig))
    try:
        yield
    finally:
        setattr(cls, name, orig)


# a history that stops a turn whose final sampled token completes a hash block, then updates
FAULT_HISTORY = [("gen", 1, 0, 0), ("stop",), ("update", [5, 6], 2, 1)]


@pytest.mark.vllm
def test_fault_update_keeps_the_dropped_tokens_hashes_diverges(vs_factory):
    from vllm.v1.core.sched.scheduler import Scheduler

    run_history(vs_factory(), FAULT_HISTORY)  # the healthy vLLM agrees

    def wrapper(orig):
        def fault(self, session, update):
            session.block_hashes = _KeepAll(session.block_hashes)
            try:
                return orig(self, session, update)
            finally:
                session.block_hashes = list(session.block_hashes)
        return fault

    with _patched(Scheduler, "_update_request_as_session", wrapper), pytest.raises(AssertionError, match="hash"):
        run_history(vs_factory(), FAULT_HISTORY)
    # the generated runner conform-scheduler uses finds it too (derandomized: the same histories)
    from kvref.models.machines.scheduler_streaming import run_streaming_sessions

    with _patched(Scheduler, "_update_request_as_session", wrapper):
        run = run_streaming_sessions(200, reproducible=True, shrink=False)
    assert not run.ok and "stale block hashes" in run.failure and run.signature


@pytest.mark.vllm
def test_fault_stop_keeps_the_placeholders_diverges(vs_factory):
    from vllm.v1.core.sched.scheduler import Scheduler

    history = [("gen", 2, 1, 2), ("stop",)]
    run_history(vs_factory(), history)

    def wrapper(orig):
        def fault(self, request):
            placeholders = request.num_output_placeholders
            finished = orig(self, request)
            request.num_computed_tokens += placeholders  # forgets to drop the in-flight frontier
            return finished
        return fault

    with _patched(Scheduler, "_handle_stopped_request", wrapper), pytest.raises(AssertionError, match="op 1 stop: session differs: num_computed_tokens"):
        run_history(vs_factory(), history)
