"""The R-SWA and ring part of ``conform-scheduler`` (issues #22/#28): the reference scheduler in
lock step with vLLM 0.33.0's on pools of one R-SWA group and of full attention beside a
``CircularBufferSpec`` ring (``scheduler_layouts``).

The planted faults show that the comparison watches each manager through the scheduler: a reference
R-SWA manager that never frees its gap, one whose window is one token longer, and a ring that grows
with its request as full attention does must each diverge."""

from __future__ import annotations

import pytest

from tests.conftest import profile_examples
from tests.conformance.scheduler_targets import vllm_scheduler  # noqa: F401 - the module-scoped fixture

pytestmark = pytest.mark.vllm


def test_the_adapter_builds_vllms_rswa_and_ring_specs(vllm_scheduler):
    from vllm.v1.kv_cache_interface import CircularBufferSpec as VllmRing, RSWASpec as VllmRSWA

    from kvref.impl.vllm.specs import to_vllm_spec
    from kvref.spec.kv_cache_interface import CircularBufferSpec, RSWASpec

    rswa = to_vllm_spec(RSWASpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16", rswa_window=5))
    ring = to_vllm_spec(CircularBufferSpec(block_size=2, num_kv_heads=1, head_size=8, head_size_v=0, dtype="float16"))
    assert type(rswa) is VllmRSWA and rswa.rswa_window == 5
    assert type(ring) is VllmRing and ring.block_size == 2 and not ring.prefix_cacheable


def _run(examples=None):
    from kvref.models.machines.scheduler_layouts import run_layouts_machine

    return run_layouts_machine(examples or profile_examples(12, 20), reproducible=True, shrink=False)


def test_layout_traces_match_vllm_and_reach_gaps_and_rings(vllm_scheduler):
    run = _run()
    assert run.ok, run.failure
    c = run.coverage
    assert c["rswa_gap_blocks_freed"] > 0 and c["ring_blocks_claimed"] > 0, c
    assert c.get("prefix_hits", 0) > 0 and c.get("preemptions", 0) > 0, c


def test_a_reference_rswa_that_keeps_its_gap_is_a_divergence(vllm_scheduler, monkeypatch):
    from kvref.impl.reference.rswa_manager import RSWAManager

    monkeypatch.setattr(RSWAManager, "remove_skipped_blocks", lambda self, *a, **k: None)
    run = _run()
    assert not run.ok, "an R-SWA gap never freed went unnoticed"
    assert run.failure.startswith("Divergence"), run.failure


def test_a_reference_rswa_window_one_token_long_is_a_divergence(vllm_scheduler, monkeypatch):
    from kvref.impl.reference.rswa_manager import RSWAManager

    original = RSWAManager.remove_skipped_blocks

    def long_window(self, request_id, processed_computed_tokens, num_prompt_tokens=None):
        original(self, request_id, max(0, processed_computed_tokens - 1), num_prompt_tokens)

    monkeypatch.setattr(RSWAManager, "remove_skipped_blocks", long_window)
    run = _run()
    assert not run.ok, "an R-SWA window one token long went unnoticed"
    assert run.failure.startswith("Divergence"), run.failure


def test_a_reference_ring_sized_like_full_attention_is_a_divergence(vllm_scheduler, monkeypatch):
    """The ring's manager allocating as full attention does (a block per ``block_size`` tokens)
    instead of one block for the request's life."""
    from kvref.impl.reference.circular_buffer_manager import CircularBufferManager
    from kvref.impl.reference.full_attention_manager import FullAttentionManager

    monkeypatch.setattr(CircularBufferManager, "get_num_blocks_to_allocate", FullAttentionManager.get_num_blocks_to_allocate)
    monkeypatch.setattr(CircularBufferManager, "allocate_new_blocks", FullAttentionManager.allocate_new_blocks)
    run = _run()
    assert not run.ok, "a ring growing with the request went unnoticed"
    assert run.failure.startswith("Divergence"), run.failure
