"""Store completions of several workers reach vLLM's SimpleCPU scheduler as the engine delivers
them: one ``SimpleCPUOffloadWorkerMetadata`` per rank, merged by its ``aggregate`` (as
``KVOutputAggregator`` merges the ranks' outputs), compared with the reference on generated
two-rank traces (issue #22); a merge that loses a rank's report is caught."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

CASES = 6


def _cases(seed: int):
    from kvref.models.offload.simple_cpu_world import SimpleOffloadConfig
    from kvref.models.offload.traces import random_ops

    rng = random.Random(f"simple-two-ranks-{seed}")
    return [(replace(SimpleOffloadConfig.random(rng), world_size=2), random_ops(rng, 40)) for _ in range(CASES)]


def _first_difference(cases) -> tuple | None:
    from kvref.models.offload.simple_cpu_world import SimpleOffloadWorld
    from kvref.models.offload.traces import apply_op

    for i, (cfg, ops) in enumerate(cases):
        worlds = [SimpleOffloadWorld(cfg, b, allow_duplicates_within_event=True) for b in ("reference", "vllm")]
        for j, op in enumerate(ops):
            outs = [apply_op(w, op) for w in worlds]
            if outs[0] != outs[1] or worlds[0].observe() != worlds[1].observe():
                return i, j, op
    return None


def test_two_rank_completions_agree():
    require_vllm()
    import kvref.impl.vllm.offload as vo

    merged = []
    real = vo.merged_worker_meta

    def counting(events):
        merged.append(max(events.values(), default=0))
        return real(events)

    vo.merged_worker_meta = counting
    try:
        assert _first_difference(_cases(0)) is None
    finally:
        vo.merged_worker_meta = real
    assert any(n == 2 for n in merged)  # both ranks reported a store in one step: aggregate() ran


def test_merge_losing_a_rank_is_caught(monkeypatch):
    require_vllm()
    from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata

    def keep_max(self, other):
        """Planted: counts merged by max instead of summed (a rank's report lost)."""
        merged = dict(self.completed_store_events)
        for k, v in other.completed_store_events.items():
            merged[k] = max(merged.get(k, 0), v)
        return SimpleCPUOffloadWorkerMetadata(completed_store_events=merged)

    monkeypatch.setattr(SimpleCPUOffloadWorkerMetadata, "aggregate", keep_max)
    assert _first_difference(_cases(0)) is not None
