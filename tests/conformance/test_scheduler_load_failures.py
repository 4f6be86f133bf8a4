"""Sync KV loads failing in blocks other requests share, the reference scheduler in lock step with
vLLM 0.33.0's (``models/machines/scheduler_load_failures.py``, in ``conform-scheduler``, #22).

The planted faults scan each request on its own (a block marked invalid by an earlier request is
truncated again by every later one), in the reference or in vLLM: the same cases must diverge."""

from __future__ import annotations

import pytest

from kvref.impl.reference import scheduler_connector as sc
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


def _run(examples: int):
    require_vllm()
    from kvref.models.machines.scheduler_load_failures import run_load_failure_cases

    return run_load_failure_cases(examples, reproducible=True, shrink=False)


def test_shared_sync_load_failures_match_vllm():
    """10 cases at fast, 30 at ci (about 4 s / 10 s): every one fails a sync load, most in a
    block a later request shares, under both failure policies."""
    run = _run(profile_examples(10, 30))
    assert run.ok, run.failure
    c = run.coverage
    assert c["sync_loads_failing"] == run.traces >= 10
    for path in ("invalid_block_shared_recompute", "invalid_block_shared_fail"):
        assert c.get(path, 0) > 0, (path, c)


def _each_request_alone(real):
    def scan(self_or_sched, requests, *a, **k):
        affected, total, evict = set(), 0, set()
        for r in list(requests):
            x, t, e = real(self_or_sched, [r], *a, **k)
            affected |= x
            total += t
            evict |= e
        return affected, total, evict
    return scan


def plant_in_reference(monkeypatch):
    monkeypatch.setattr(sc, "_update_requests_with_invalid_blocks", _each_request_alone(
        sc._update_requests_with_invalid_blocks))


def plant_in_vllm(monkeypatch):
    require_vllm()
    from vllm.v1.core.sched.scheduler import Scheduler

    monkeypatch.setattr(Scheduler, "_update_requests_with_invalid_blocks", _each_request_alone(
        Scheduler._update_requests_with_invalid_blocks))


@pytest.mark.parametrize("plant", [plant_in_reference, plant_in_vllm])
def test_planted_fault_diverges(monkeypatch, plant):
    """Every request recomputes the shared invalid block itself (about 2 s each)."""
    plant(monkeypatch)
    run = _run(10)
    assert not run.ok, f"{plant.__name__}: no divergence found"
    assert "vllm vs ref" in run.failure or "differ" in run.failure, run.failure  # a comparison, not a crash
