"""vLLM 0.33.0's SimpleCPU connector on FA + Mamba "align" pools vs the reference (#22): the
generated traces of ``conform-offload``'s Mamba part agree, reach the hand-off, partial-tail,
copy-on-write and CPU-load paths, and a planted fault in vLLM's code for each is found.

The traces come from a seeded ``random.Random`` (not Hypothesis), so the counts asserted here are
the same under every profile."""

from __future__ import annotations

import pytest

from kvref.models.offload.simple_cpu_mamba_world import MAMBA_COVERAGE, run_simple_mamba_traces, simple_mamba_cases
from kvref.models.offload.world_common import OffloadInvariantError
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def VSched():
    require_vllm()
    from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler

    return SimpleCPUOffloadScheduler


def test_generated_traces_agree_and_reach_every_path(VSched, monkeypatch):
    tails = []
    original = VSched._find_fa_partial_tail_source

    def counting(self, request, block_ids):
        found = original(self, request, block_ids)
        tails.append(found)
        return found

    monkeypatch.setattr(VSched, "_find_fa_partial_tail_source", counting)
    MAMBA_COVERAGE.clear()
    stats = run_simple_mamba_traces(simple_mamba_cases(0, profile_examples(12, 40)))
    assert stats["ops"] > 400
    for path in ("handoffs", "odd_handoffs", "finish_flush", "copies", "cpu_load", "gpu_forgotten",
                 "sub_block_local_hit"):
        assert MAMBA_COVERAGE[path] > 0, (path, dict(MAMBA_COVERAGE))
    assert any(t is not None for t in tails), "vLLM found no partial-tail source: the path was not taken"
    from kvref.impl.reference.offload.simple_cpu_boundary_stores import OUTCOMES

    for outcome in OUTCOMES:  # every reason a hand-off is stored or declined, counted alike
        assert MAMBA_COVERAGE[f"outcome:{outcome}"] > 0, (outcome, dict(MAMBA_COVERAGE))
    # KV events on (about half the configurations): a block's payload, a hash unit's payload under
    # a secondary key, and a hand-off published with no payload (its group's block size)
    for kind in ("block_payload", "hash_unit_payload", "no_payload_size_8"):
        assert MAMBA_COVERAGE[f"stored_event:{kind}"] > 0, (kind, dict(MAMBA_COVERAGE))


def _planted(monkeypatch, VSched, name, make, match=None):
    monkeypatch.setattr(VSched, name, make(getattr(VSched, name)))
    with pytest.raises(OffloadInvariantError, match=match):
        run_simple_mamba_traces(simple_mamba_cases(0, 12))


def test_a_lost_partial_tail_is_found(VSched, monkeypatch):
    _planted(monkeypatch, VSched, "_find_fa_partial_tail_source", lambda original: lambda self, r, b: None)


def test_hand_offs_stored_while_in_flight_are_found(VSched, monkeypatch):
    from vllm.v1.simple_kv_offload.manager import _StoreAdmission

    def make(original):
        def classify(self, block):
            out = original(self, block)
            return _StoreAdmission.READY if out is _StoreAdmission.IN_FLIGHT else out
        return classify

    _planted(monkeypatch, VSched, "_classify_store_candidate", make)


def test_hash_unit_payloads_dropped_by_vllm_are_found(VSched, monkeypatch):
    """vLLM publishing a wide block's secondary keys without the payloads captured for its hash
    units (``block_size`` 0, no tokens) is a difference the KV-event comparison finds."""
    def make(original):
        def select(self, state, block_ids):
            gpu_ids, advanced, metas = original(self, state, block_ids)
            for i, by_hash in enumerate(metas or ()):
                metas[i] = {k: m for k, m in by_hash.items() if m.block_size is None}
            return gpu_ids, advanced, metas
        return select

    _planted(monkeypatch, VSched, "_select_eager_blocks_to_store", make, match="kv_events")


def test_reference_without_hash_unit_payloads_is_found(VSched, monkeypatch):
    """The reference's own capture matters: without the hash-unit payloads it differs from vLLM."""
    import kvref.impl.reference.offload.simple_cpu_offload_scheduler as sched

    original = sched._capture_store_meta
    monkeypatch.setattr(sched, "_capture_store_meta", lambda *args, **kw: original(*args[:6]))
    with pytest.raises(OffloadInvariantError, match="kv_events"):
        run_simple_mamba_traces(simple_mamba_cases(0, 12))
