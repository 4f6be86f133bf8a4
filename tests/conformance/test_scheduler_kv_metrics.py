"""vLLM's ``--kv-cache-metrics`` collector built by its own scheduler, compared with the reference
collector after every operation of whole scheduler traces (``models/machines/scheduler_kv_metrics.py``,
in ``conform-scheduler``, #22). Planted faults in vLLM (monkeypatched for the test) must diverge."""

from __future__ import annotations

import pytest

from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


def _run(examples: int):
    require_vllm()
    from kvref.models.machines.scheduler_kv_metrics import run_kv_metrics_machine

    return run_kv_metrics_machine(examples, reproducible=True, shrink=False)


def test_kv_metrics_traces_match_vllm():
    """8 traces at fast, 12 at ci: followed blocks hit and evicted."""
    run = _run(profile_examples(8, 12))
    assert run.ok, run.failure
    assert run.traces >= 8
    for path in ("followed_blocks_hit", "eviction_events"):
        assert run.coverage.get(path, 0) > 0, (path, run.coverage)


def hits_not_recorded(monkeypatch):
    """vLLM's collector forgets prefix-cache hits."""
    from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector

    monkeypatch.setattr(KVCacheMetricsCollector, "on_block_accessed", lambda self, block: None)


def collector_not_handed_to_the_manager(monkeypatch):
    """The scheduler builds its collector but its KVCacheManager never gets it."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    real = KVCacheManager.__init__

    def patched(self, *a, **k):
        k["metrics_collector"] = None
        real(self, *a, **k)

    monkeypatch.setattr(KVCacheManager, "__init__", patched)


@pytest.mark.parametrize("plant", [hits_not_recorded, collector_not_handed_to_the_manager])
def test_planted_fault_diverges(monkeypatch, plant):
    require_vllm()
    plant(monkeypatch)
    run = _run(8)
    assert not run.ok, f"{plant.__name__}: no divergence found"
    assert "KV cache metrics" in run.failure, run.failure


@pytest.mark.parametrize("rate", [0, 1.5, True, "1"])
def test_bad_sample_rate_is_refused(rate):
    require_vllm()
    from kvref.impl.interface import PoolConfig
    from kvref.impl.scheduler_types import SchedulerConfig
    from kvref.impl.vllm.scheduler import VllmScheduler
    from kvref.spec.errors import InvalidFieldError
    from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    cfg = SchedulerConfig(max_num_batched_tokens=16)
    pool = PoolConfig(num_blocks=8, groups=(KVCacheGroupSpec(("full",), FullAttentionSpec(
        block_size=4, num_kv_heads=1, head_size=8, dtype="float16")),), max_model_len=16, scheduler_block_size=4,
        hash_block_size=4, max_in_flight_tokens=cfg.max_in_flight_tokens)
    with pytest.raises(InvalidFieldError, match="kv_cache_metrics_sample"):
        VllmScheduler(pool, cfg, kv_cache_metrics_sample=rate)
