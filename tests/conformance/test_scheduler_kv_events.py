"""The scheduler machine compares the KV cache events each scheduler *publishes*: vLLM's
``Scheduler.update_from_output`` takes the manager's queued events once per step and publishes
them as one ``KVEventBatch`` (issue #14). A router rebuilds its prefix-cache index from these
batches, so a scheduler that keeps the same blocks but publishes different events is a finding
even when every block table and free queue agree."""

from __future__ import annotations

import pytest

from kvref.models.machines.scheduler import run_scheduler_machine
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


def test_published_event_batches_match_vllm_step_by_step():
    require_vllm()
    run = run_scheduler_machine(with_vllm=True, examples=25, reproducible=True, shrink=False)
    assert run.ok, run.failure
    c = run.coverage
    assert c.get("kv_event_batches", 0) > 0, c
    assert c.get("kv_event_BlockStored", 0) > 0 and c.get("kv_event_BlockRemoved", 0) > 0, c


def test_a_dropped_removal_event_is_a_finding(monkeypatch):
    """vLLM's manager loses its BlockRemoved events (block tables, pools and queues unchanged):
    only the published batches show it."""
    require_vllm()
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    real = KVCacheManager.take_events

    def take_events(self):
        return [e for e in real(self) if type(e).__name__ != "BlockRemoved"]

    monkeypatch.setattr(KVCacheManager, "take_events", take_events)
    run = run_scheduler_machine(with_vllm=True, examples=25, reproducible=True, shrink=False)
    assert not run.ok
    assert "published KV events differ" in run.failure, run.failure
