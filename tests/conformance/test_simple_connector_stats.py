"""vLLM's ``SimpleCPUOffloadConnector`` stats as the engine and the logger process see them
(issue #22): the interval stats rebuilt from their serialized data by the class
(``build_kv_connector_stats``) and the cumulative boundary hand-off counters
(``get_boundary_store_stats``) must agree with the reference op by op; planted faults in either are
found by the same generated traces (the clean traces agree: tests/conformance/test_offload_worker.py). Also
the finish through a MultiConnector beside a child without HMA support."""

from __future__ import annotations

import pytest

from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def traces():
    require_vllm()
    from kvref.models.machines.simple_offload_connector import run_simple_connector_traces
    from kvref.verify_offload_worker import simple_connector_cases

    return lambda: run_simple_connector_traces(simple_connector_cases(0, 2))


def test_a_rebuild_that_loses_the_stats_is_found(traces, monkeypatch):
    """Planted: the logger's rebuild of the serialized stats returns empty stats."""
    from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import SimpleCPUOffloadConnector
    from vllm.v1.simple_kv_offload.metrics import SimpleCPUOffloadStats

    from kvref.models.offload.world_common import OffloadInvariantError

    monkeypatch.setattr(SimpleCPUOffloadConnector, "build_kv_connector_stats",
                        classmethod(lambda cls, data=None: SimpleCPUOffloadStats()))
    with pytest.raises(OffloadInvariantError, match="differ"):
        traces()


def test_a_boundary_counter_counting_nothing_is_found(traces, monkeypatch):
    """Planted: the cumulative boundary counters report a hand-off published where none was."""
    from dataclasses import replace

    from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import SimpleCPUOffloadConnector

    from kvref.models.offload.world_common import OffloadInvariantError

    real = SimpleCPUOffloadConnector.get_boundary_store_stats

    def inflated(self):
        got = real(self)
        return replace(got, published=got.published + 1)

    monkeypatch.setattr(SimpleCPUOffloadConnector, "get_boundary_store_stats", inflated)
    with pytest.raises(OffloadInvariantError, match="differ"):
        traces()


def test_a_multi_connector_flushing_beside_a_non_hma_child_is_found(monkeypatch):
    """Beside a child without HMA support vLLM's MultiConnector falls back to each child's
    ``request_finished``, which does not flush the confirmed blocks the eager cursors have not
    reached (the reference finishes with no table then). Planted: the fallback is skipped, so the
    SimpleCPU child flushes at finish; generated traces with such a sibling find it."""
    from dataclasses import replace

    require_vllm()
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    from kvref.models.machines.simple_offload_connector import run_simple_connector_traces
    from kvref.models.offload.world_common import OffloadInvariantError
    from kvref.verify_offload_worker import simple_connector_cases

    cases = [(replace(c, non_hma_sibling=True, sliding_window=None, local_chunk=None, lazy=False), ops)
             for c, ops in simple_connector_cases(0, 6)]
    assert run_simple_connector_traces(cases[:2])["ops"] > 50  # clean: they agree

    def flushing(self, request, block_ids):
        for c in self._connectors:
            if hasattr(c, "request_finished_all_groups"):
                c.request_finished_all_groups(request, block_ids)
            else:
                c.request_finished(request, block_ids[0])
        return False, None

    monkeypatch.setattr(MultiConnector, "request_finished_all_groups", flushing)
    with pytest.raises(OffloadInvariantError, match="differ"):
        run_simple_connector_traces(cases)
