"""A KV consumer's whole life under async scheduling in ``conform-connector`` (#22): deferred block
frees, the KV part of ``make_stats`` polled after every operation (skipped waiting requests,
KV-fetch stages, the connector's prefix-cache stats) and ``shutdown``, the reference scheduler in
lock step with vLLM 0.33.0's (``models/machines/scheduler_lifecycle.py``).

Planted faults in vLLM's own scheduler (monkeypatched for the test's duration) show each of these
observables is compared: the same machine that passes on pristine vLLM must diverge."""

from __future__ import annotations

import pytest

from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


def _sched_cls():
    require_vllm()
    from vllm.v1.core.sched.scheduler import Scheduler

    return Scheduler


def _run(examples: int, hisparse: bool | None = None):
    from kvref.models.machines.scheduler_lifecycle import run_lifecycle_machine

    return run_lifecycle_machine(examples, reproducible=True, shrink=False, hisparse=hisparse)


def test_lifecycle_traces_match_vllm_and_reach_every_path():
    _sched_cls()
    run = _run(profile_examples(10, 30))
    assert run.ok, run.failure
    assert run.traces >= 8
    c = run.coverage
    for path in ("steps_with_deferred_frees", "kv_fetch_waiting_to_start", "kv_fetch_in_progress",
                 "kv_fetch_completed_waiting", "skipped_waiting_polled", "connector_hits_recorded",
                 "connector_preempted_recorded", "connector_reset_flagged", "skip_reading_arrivals",
                 "remote_prefill_arrivals", "shutdowns"):
        assert c.get(path, 0) > 0, (path, c)


def stage_never_left(monkeypatch):
    """A request's previous KV-fetch stage is never taken out of the tally."""
    cls = _sched_cls()

    def patched(self, request, stage):
        if self._kv_fetch_stages is not None and stage is not None:
            self._kv_fetch_stages[request] = stage
            self._kv_fetch_counts[stage] += 1

    monkeypatch.setattr(cls, "_set_kv_fetch_stage", patched)


def frees_not_deferred(monkeypatch):
    """Deferred frees are drained before their fence step was processed."""
    cls = _sched_cls()

    def patched(self):
        while self.deferred_frees:
            _, blocks = self.deferred_frees.popleft()
            self.kv_cache_manager.block_pool.free_blocks(reversed(blocks))

    monkeypatch.setattr(cls, "_drain_deferred_frees", patched)
    real = cls._free_request_blocks

    def free_now(self, request):
        real(self, request)
        self._drain_deferred_frees()

    monkeypatch.setattr(cls, "_free_request_blocks", free_now)


def skipped_counted_as_waiting(monkeypatch):
    """``make_stats`` counts skipped (deferred) requests among the waiting ones."""
    cls = _sched_cls()
    real = cls.make_stats

    def patched(self, *a, **k):
        stats = real(self, *a, **k)
        if stats is not None:
            stats.num_waiting_reqs += stats.num_skipped_waiting_reqs
            stats.num_skipped_waiting_reqs = 0
        return stats

    monkeypatch.setattr(cls, "make_stats", patched)


def connector_hits_not_reset(monkeypatch):
    """The connector's prefix-cache stats keep accumulating across ``make_stats`` calls."""
    cls = _sched_cls()
    real = cls.make_stats

    def patched(self, *a, **k):
        kept = self.connector_prefix_cache_stats
        stats = real(self, *a, **k)
        if kept is not None:
            self.connector_prefix_cache_stats = kept
        return stats

    monkeypatch.setattr(cls, "make_stats", patched)


def shutdown_skips_connector(monkeypatch):
    """``shutdown`` forgets the KV connector."""
    cls = _sched_cls()
    monkeypatch.setattr(cls, "shutdown", lambda self: None)


def remote_prefill_not_counted_at_arrival(monkeypatch):
    """A P/D request (``kv_transfer_params`` ``do_remote_prefill``) is not counted as waiting to
    start a KV fetch until the scheduler looks it up."""
    cls = _sched_cls()
    real = cls.add_request

    def patched(self, request):
        params, request.kv_transfer_params = request.kv_transfer_params, None
        real(self, request)
        request.kv_transfer_params = params

    monkeypatch.setattr(cls, "add_request", patched)


@pytest.mark.parametrize("plant", [stage_never_left, frees_not_deferred, skipped_counted_as_waiting,
                                   connector_hits_not_reset, shutdown_skips_connector,
                                   remote_prefill_not_counted_at_arrival])
def test_planted_vllm_fault_diverges(monkeypatch, plant):
    plant(monkeypatch)
    run = _run(profile_examples(10, 20))
    assert not run.ok, f"{plant.__name__}: no divergence found"


# ---- deferred async loads under HiSparse (defer_async_loads, _drain_deferred_loads) ----------------
def test_deferred_loads_match_vllm_and_reach_every_path():
    """With a HiSparse host pool an async load admitted while a step is in flight reaches the
    connector only after that step was processed; the stats go out with that update's output."""
    _sched_cls()
    run = _run(profile_examples(20, 30), hisparse=True)
    assert run.ok, run.failure
    c = run.coverage
    for path in ("deferred_loads_pending", "deferred_loads_started", "connector_stats_in_output",
                 "steps_with_deferred_frees", "arrival_behind_a_step", "deferred_load_aborted"):
        assert c.get(path, 0) > 0, (path, c)


def loads_never_deferred(monkeypatch):
    """``defer_async_loads`` is never set: every async load goes to the connector at admission."""
    cls = _sched_cls()
    real = cls.__init__

    def patched(self, *a, **k):
        real(self, *a, **k)
        self.defer_async_loads = False

    monkeypatch.setattr(cls, "__init__", patched)


def deferred_load_not_recorded(monkeypatch):
    """A deferred load's connector query is lost: its external hit never reaches the stats."""
    cls = _sched_cls()
    real = cls._drain_deferred_loads

    def patched(self):
        self.deferred_loads = {rid: (fence, n, 0, h) for rid, (fence, n, _, h) in self.deferred_loads.items()}
        real(self)

    monkeypatch.setattr(cls, "_drain_deferred_loads", patched)


def deferred_load_hands_no_tokens(monkeypatch):
    """A deferred load starts with no external tokens (the connector loads nothing)."""
    cls = _sched_cls()
    real = cls._drain_deferred_loads

    def patched(self):
        self.deferred_loads = {rid: (fence, 0, q, h) for rid, (fence, _, q, h) in self.deferred_loads.items()}
        real(self)

    monkeypatch.setattr(cls, "_drain_deferred_loads", patched)


def deferred_load_unfenced(monkeypatch):
    """A deferred load's request keeps its old fence (``last_sched_seq`` not set at admission, the
    catalogue's ``sched.deferred_load_unfenced_free``): aborting it returns its blocks to the pool
    while the step in flight may still use them."""
    cls = _sched_cls()
    real = cls.schedule

    def patched(self, *a, **k):
        before = {rid: r.last_sched_seq for rid, r in self.requests.items()}
        deferred = set(self.deferred_loads)
        out = real(self, *a, **k)
        for rid in set(self.deferred_loads) - deferred:
            self.requests[rid].last_sched_seq = before.get(rid, 0)
        return out

    monkeypatch.setattr(cls, "schedule", patched)


@pytest.mark.parametrize("plant", [loads_never_deferred, deferred_load_not_recorded,
                                   deferred_load_hands_no_tokens, deferred_load_unfenced])
def test_planted_deferred_load_fault_diverges(monkeypatch, plant):
    plant(monkeypatch)
    run = _run(profile_examples(10, 20), hisparse=True)
    assert not run.ok, f"{plant.__name__}: no divergence found"


def _run_reload(examples: int):
    from kvref.models.machines.scheduler_lifecycle import run_lifecycle_machine

    return run_lifecycle_machine(examples, reproducible=True, shrink=False, hisparse=False, reload=True)


def test_preempted_reloads_match_vllm_and_are_promoted():
    """conform-connector's reload run: a preempted request's store holds its tokens, so it loads
    them asynchronously and vLLM promotes it back to PREEMPTED (scheduler.py 3530-3531), which the
    reference must match."""
    _sched_cls()
    run = _run_reload(profile_examples(4, 6))
    assert run.ok, run.failure
    assert run.coverage.get("preempted_stored", 0) > 0, run.coverage
    assert run.coverage.get("preempted_reload_promoted", 0) > 0, run.coverage


def reload_promoted_as_waiting(monkeypatch):
    """vLLM promotes a landed reload of a preempted request to WAITING (as a new request)."""
    cls = _sched_cls()
    from vllm.v1.request import RequestStatus

    orig = cls._handle_blocked_waiting_request

    def patched(self, request):
        was_loading = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        proceed = orig(self, request)
        if was_loading and request.status == RequestStatus.PREEMPTED:
            request.status = RequestStatus.WAITING
        return proceed

    monkeypatch.setattr(cls, "_handle_blocked_waiting_request", patched)


def reference_reload_promoted_as_waiting(monkeypatch):
    """The reference forgets the preemption when a reload lands (WAITING instead of PREEMPTED)."""
    from kvref.impl.reference import scheduler_connector as sc
    from kvref.impl.request import RequestStatus

    orig = sc.update_waiting_for_remote_kv

    def patched(sched, request):
        orig(sched, request)
        if request.status == RequestStatus.PREEMPTED:
            request.status = RequestStatus.WAITING

    monkeypatch.setattr(sc, "update_waiting_for_remote_kv", patched)


@pytest.mark.parametrize("plant", [reload_promoted_as_waiting, reference_reload_promoted_as_waiting])
def test_planted_reload_fault_diverges(monkeypatch, plant):
    plant(monkeypatch)
    run = _run_reload(profile_examples(4, 6))
    assert not run.ok
    assert "preempted" in run.failure or "resumed" in run.failure, run.failure
