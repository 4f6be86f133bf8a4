"""vLLM's ``MultiConnector`` on both sides of the step vs the reference (issue #22): clean vLLM
agrees on generated traces that take the paths that matter (requests saved by several children,
children failing at shutdown, disagreeing finished counts, key clashes), and each planted fault in
vLLM's own class is caught — by the reference comparison or by the independent send oracle."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def M():
    require_vllm()
    from vllm.distributed.kv_transfer.kv_connector.v1 import multi_connector

    from kvref.models.machines import multi_connector_worker

    return multi_connector, multi_connector_worker


def test_clean_vllm_agrees_and_the_paths_are_taken(M):
    _, mw = M
    stats = mw.run_multi_worker_traces(mw.random_multi_worker_cases(0, 40))
    assert stats["traces"] == 40
    assert stats["extra_saves"] > 0  # requests saved by more than one child
    assert stats["sends_finished"] > 0
    assert stats["raised"] > 0  # shutdown failures, pool clashes, finished-count mismatches, key clashes


@settings(max_examples=profile_examples(15, 60), deadline=None)
@given(children=st.integers(1, 3), world=st.integers(1, 2), layers=st.integers(1, 2), steps=st.integers(1, 10),
       seed=st.integers(0, 2**31 - 1))
def test_generated_traces_agree(M, children, world, layers, steps, seed):
    _, mw = M
    case = mw.MultiWorkerCase(num_children=children, world_size=world, num_layers=layers, steps=steps, seed=seed)
    stats = mw.run_multi_worker_trace(case)
    assert stats["calls"] >= 0


def _sends_every_child_report(self, finished_req_ids):
    """Planted: a request any child finished sending is reported at once (extra saves ignored), the
    behaviour before MultiConnector counted the children that save a request."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

    out = KVConnectorTransferResults()
    for c in self._connectors:
        r = c.get_transfer_results(finished_req_ids)
        out.finished_sending |= r.finished_sending
        out.finished_recving |= r.finished_recving
        out.failed_recving |= r.failed_recving
    return out


def _meta_without_extra_saves(original):
    def build(self, scheduler_output):
        meta = original(self, scheduler_output)
        meta.extra_async_saves = None
        return meta
    return build


def _worker_meta_packed(self):
    """Planted: only the children that have worker metadata, packed (indices shift)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiKVConnectorWorkerMetadata

    metas = [m for m in (c.build_connector_worker_meta() for c in self._connectors) if m is not None]
    return MultiKVConnectorWorkerMetadata(metadata=tuple(metas)) if metas else None


def _load_errors_first_child(self):
    return self._connectors[0].get_block_ids_with_load_errors()


def _shutdown_stops_at_failure(self):
    for c in self._connectors:
        c.shutdown()


def _stats_first_child(self):
    """Planted: the first child's stats stand for all of them (the others' dropped)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiKVConnectorStats

    for c in self._connectors:
        stats = c.get_kv_connector_stats()
        if stats is not None:
            return MultiKVConnectorStats(data={type(c).__name__: stats})
    return None


def _first_layout(cls, vllm_config):
    """Planted: the first child's layout wins (a mismatch between children goes unnoticed)."""
    for child_cls, temp_config in cls._get_connector_classes_and_configs(vllm_config):
        layout = child_cls.get_required_kvcache_layout(temp_config)
        if layout is not None:
            return layout
    return None


@pytest.mark.parametrize("fault", ["sends", "extra_meta", "worker_meta", "load_errors", "shutdown", "stats",
                                   "layout"])
def test_planted_faults_are_caught(M, monkeypatch, fault):
    multi_connector, mw = M
    cls = multi_connector.MultiConnector
    plant = {"sends": ("get_transfer_results", _sends_every_child_report),
             "extra_meta": ("build_connector_meta", _meta_without_extra_saves(cls.build_connector_meta)),
             "worker_meta": ("build_connector_worker_meta", _worker_meta_packed),
             "load_errors": ("get_block_ids_with_load_errors", _load_errors_first_child),
             "shutdown": ("shutdown", _shutdown_stops_at_failure),
             "stats": ("get_kv_connector_stats", _stats_first_child),
             "layout": ("get_required_kvcache_layout", classmethod(_first_layout))}[fault]
    monkeypatch.setattr(cls, *plant)
    with pytest.raises(mw.MultiWorkerDivergence):
        mw.run_multi_worker_traces(mw.random_multi_worker_cases(0, 40))
