"""vLLM's ``MultiConnector`` stats on their way to the logger and the metrics endpoint vs the
reference (issue #22): ``MultiKVConnectorStats.to_dict`` / ``aggregate``,
``MultiConnector.build_kv_connector_stats`` from serialized payloads, ``build_prom_metrics`` and
``MultiKVConnectorPromMetrics.observe``, ``all_children_support_hma``,
``get_external_cache_hit_sources`` without a chosen child. Clean vLLM agrees on the
generated traces and takes the paths; each planted fault is caught."""

from __future__ import annotations

import pytest

from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

CASES = 12


@pytest.fixture(scope="module")
def M():
    require_vllm()
    from vllm.distributed.kv_transfer.kv_connector.v1 import multi_connector

    from kvref.models.machines import multi_connector_worker

    return multi_connector, multi_connector_worker


def test_logging_side_agrees_and_its_paths_are_taken(M):
    _, mw = M
    stats = mw.run_multi_worker_traces(mw.random_multi_worker_cases(1, CASES))
    assert stats["traces"] == CASES
    assert stats["logged"] > 0  # intervals with jobs reached the log line
    assert stats["prom_observed"] > 0  # payloads reached the child's metrics object


def _to_dict_empty(self):
    return {}


def _aggregate_replacing(self, other):
    """Planted: a later interval replaces a connector's accumulated stats instead of adding to them."""
    for connector_id, stats in other.data.items():
        self[connector_id] = stats
    return self


def _rebuild_objects_only(cls, data=None):
    """Planted: serialized payloads (the cross-process case) are dropped instead of rebuilt by name."""
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiKVConnectorStats

    if data is None:
        return MultiKVConnectorStats()
    return MultiKVConnectorStats(data={k: v for k, v in data.items() if isinstance(v, KVConnectorStats)})


def _prom_per_child(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
    """Planted: one metrics object per child, not per child class (series registered twice)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiKVConnectorPromMetrics

    prom = {}
    for i, (connector_cls, temp_config) in enumerate(cls._get_connector_classes_and_configs(vllm_config)):
        built = connector_cls.build_prom_metrics(temp_config, metric_types, labelnames, per_engine_labelvalues)
        if built is not None:
            prom[connector_cls.__name__ if i == 0 else f"{connector_cls.__name__}-{i}"] = built
    return MultiKVConnectorPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues, prom)


def _observe_whole_payload(self, transfer_stats_data, engine_idx=0):
    """Planted: every child's metrics get the whole payload instead of their own part."""
    for prom_metrics in self._prom_metrics.values():
        prom_metrics.observe(transfer_stats_data, engine_idx)


def _hma_any_child(cls, kv_transfer_config):
    """Planted: HMA allowed when any child (not every child) supports it."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    kids = kv_transfer_config.kv_connector_extra_config.get("connectors", [])
    return any(KVConnectorFactory.supports_hma_config(KVTransferConfig(**{"engine_id": kv_transfer_config.engine_id,
                                                                          **c})) for c in kids)


def _no_hit_sources(self, request, num_external_tokens):
    """Planted: a request no child was chosen for reports no hit source at all."""
    return {}


@pytest.mark.parametrize("fault", ["to_dict", "aggregate", "rebuild", "prom_per_child", "observe", "hma",
                                   "hit_sources"])
def test_planted_logging_faults_are_caught(M, monkeypatch, fault):
    multi_connector, mw = M
    cls = multi_connector.MultiConnector
    stats_cls = multi_connector.MultiKVConnectorStats
    target, name, fn = {
        "to_dict": (stats_cls, "to_dict", _to_dict_empty),
        "aggregate": (stats_cls, "aggregate", _aggregate_replacing),
        "rebuild": (cls, "build_kv_connector_stats", classmethod(_rebuild_objects_only)),
        "prom_per_child": (cls, "build_prom_metrics", classmethod(_prom_per_child)),
        "observe": (multi_connector.MultiKVConnectorPromMetrics, "observe", _observe_whole_payload),
        "hma": (cls, "all_children_support_hma", classmethod(_hma_any_child)),
        "hit_sources": (cls, "get_external_cache_hit_sources", _no_hit_sources),
    }[fault]
    monkeypatch.setattr(target, name, fn)
    with pytest.raises(mw.MultiWorkerDivergence):
        mw.run_multi_worker_traces(mw.random_multi_worker_cases(1, CASES))
