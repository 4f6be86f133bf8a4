"""The offloading connector's stats over an interval: vLLM's ``OffloadingConnectorStats.aggregate``
and ``reduce`` vs the reference fold (``reduce_steps``) on generated step sequences, and merge
faults planted in vLLM's class (monkeypatched) that the comparison finds (#22)."""

from __future__ import annotations

import random

import pytest

from kvref.impl.reference.offload.offload_stats import METRIC_KINDS, PREFIX, reduce_steps
from kvref.spec.errors import InvalidFieldError
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm


def _steps(rng: random.Random, n: int) -> list[dict]:
    steps = []
    for _ in range(n):
        step = {}
        for name, kind in METRIC_KINDS.items():
            if rng.random() < 0.4:
                continue
            if kind == "gauge":
                step[name] = rng.choice((0.0, 0.25, 0.5, 1.0))
            elif kind == "counter" or name.endswith("_seconds"):
                step[name] = rng.randint(1, 4)
            else:
                step[name] = [rng.randint(1, 6) for _ in range(rng.randint(1, 3))]
        steps.append(step)
    return steps


def _payload(step: dict, info) -> dict:
    """The vLLM payload a step's reference stats stand for (delay histograms: that many samples)."""
    types, data = {}, {}
    for name, value in step.items():
        kind = METRIC_KINDS[name]
        types[PREFIX + name] = kind
        data[PREFIX + name] = {(): [0.001] * value if name.endswith("_seconds") else value}
    return {"types": types, "data": data, "info": info}


def test_reduce_steps_folds_like_the_metrics_endpoint():
    steps = [{"allocation_failure": 2, "cpu_cache_usage_perc": 0.5, "cpu_allocation_size": [3, 4],
              "lookup_sync_delay_seconds": 2, "info": [{}]},
             {"allocation_failure": 1, "cpu_cache_usage_perc": 0.25, "cpu_allocation_size": [5]}]
    assert reduce_steps(steps) == {PREFIX + "allocation_failure": 3, PREFIX + "cpu_cache_usage_perc": 0.25,
                                   PREFIX + "cpu_allocation_size_count": 3, PREFIX + "cpu_allocation_size_sum": 12,
                                   PREFIX + "lookup_sync_delay_seconds_count": 2}
    with pytest.raises(InvalidFieldError):
        reduce_steps([3])


@pytest.mark.vllm
def test_vllm_interval_matches_reference_fold():
    require_vllm()
    from kvref.models.machines.offload_stats import compare_interval

    rng = random.Random(0)
    for i in range(profile_examples(30, 60)):
        steps = _steps(rng, rng.randint(1, 8))
        payloads = [_payload(s, [{"cpu_bytes": str(i)}] if j == 0 else None) for j, s in enumerate(steps)]
        assert compare_interval(steps, payloads, set(METRIC_KINDS), random.Random(i)) is None


@pytest.mark.vllm
@pytest.mark.parametrize("fault", ["gauge_summed", "counter_last", "hist_sum_counts", "untyped_accepted"])
def test_planted_merge_faults_are_found(monkeypatch, fault):
    require_vllm()
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import metrics

    from kvref.models.machines.offload_stats import compare_interval

    cls = metrics.OffloadingConnectorStats
    aggregate, reduce = cls.aggregate, cls.reduce
    if fault in ("gauge_summed", "counter_last"):
        def bad_aggregate(self, other):
            before = {k: dict(v) for k, v in self._values.items()}
            out = aggregate(self, other)
            for key, by_labels in other._values.items():
                kind = other._types[key]
                if (kind == "gauge") == (fault == "gauge_summed") and kind != "histogram":
                    for labels, value in by_labels.items():
                        if fault == "gauge_summed":
                            self._values[key][labels] = before.get(key, {}).get(labels, 0) + value
                        else:
                            self._values[key][labels] = value
            return out
        monkeypatch.setattr(cls, "aggregate", bad_aggregate)
    elif fault == "hist_sum_counts":
        def bad_reduce(self):
            out = reduce(self)
            return {k: (out[k[:-4] + "_count"] if k.endswith("_sum") else v) for k, v in out.items()}
        monkeypatch.setattr(cls, "reduce", bad_reduce)
    else:
        def lenient_reduce(self):
            for key in self._values:
                self._types.setdefault(key, "counter")
            return reduce(self)
        monkeypatch.setattr(cls, "reduce", lenient_reduce)
    rng = random.Random(1)
    found = 0
    for i in range(20):
        steps = _steps(rng, rng.randint(2, 8))
        payloads = [_payload(s, None) for s in steps]
        found += compare_interval(steps, payloads, set(METRIC_KINDS), random.Random(i)) is not None
    assert found > 0
