"""conform-offload on FA + Mamba "align" pools: vLLM's OffloadingConnector stores the boundary states
the GPU cache hands over (``_build_aligned_boundary_store_jobs``, ``_make_boundary_key``), rounds hits
to the Mamba chunk and loads the state; the reference must agree step by step. Faults of that class,
and of ``has_pending_push_work``, planted in vLLM's own source for one test, must be flagged by the
cases ``kvref verify`` draws at the ``fast`` profile (seed 0), while the clean vLLM passes them.

The derandomized reach test counts, on the reference, that those cases take the paths the faults
sit on: boundary stores, their fences flushed by a re-allocated state block, states skipped past
the offload window or between chunk ends, Mamba loads.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from tests.conformance.offloading_faults import conform_offloading, offloading_scheduler_class, planted_edit
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def cases():
    require_vllm()
    from kvref.models.offload.offloading_connector_world import OffloadingConfig
    from kvref.verify import _offload_cases

    return [c for c in _offload_cases(random.Random(0), 80) if isinstance(c[0], OffloadingConfig)]


@pytest.fixture(scope="module")
def mamba_cases(cases):
    return [c for c in cases if c[0].mamba_align]


FAULTS = {
    # the state block is not fenced: its re-allocation no longer flushes the copy (stale CPU state)
    "boundary_store_unfenced": ("_build_aligned_boundary_store_jobs",
                                "self._block_id_to_pending_jobs.setdefault(block_id, set()).add(job_id)", "pass"),
    # decode states past the prompt are stored under offload_prompt_only
    "boundary_store_ignores_offload_window": ("_build_aligned_boundary_store_jobs",
                                              "or boundary > max_boundary\n", "\n"),
    # a state between two chunk ends is stored under a key of the chunk it does not end
    "boundary_store_off_chunk": ("_build_aligned_boundary_store_jobs",
                                 "or boundary % group_config.tokens_per_chunk != 0\n", "\n"),
    # the key of the state one hash block early
    "boundary_key_off_by_one": ("_make_boundary_key", "boundary_tokens // self.config.tokens_per_hash - 1",
                                "boundary_tokens // self.config.tokens_per_hash - 2"),
}


def test_mamba_cases_agree_on_clean_vllm(mamba_cases):
    assert len(mamba_cases) >= 8
    assert conform_offloading(mamba_cases) is None


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_planted_boundary_store_fault_is_flagged(mamba_cases, fault):
    name, old, new = FAULTS[fault]
    with planted_edit(offloading_scheduler_class(), name, old, new):
        finding = conform_offloading(mamba_cases)
    assert finding is not None, f"{fault} survived the fast Mamba 'align' cases"


def test_engine_told_to_stop_with_jobs_in_flight_is_flagged(cases):
    with planted_edit(offloading_scheduler_class(), "has_pending_push_work", "if self._jobs or self._reset_fence:", "if False:"):
        finding = conform_offloading(cases[:8])
    assert finding is not None


def test_fast_cases_reach_the_boundary_store_paths(mamba_cases):
    """On the reference (derandomized: the cases are seeded), the fast Mamba cases store boundary
    states, flush one whose block was re-allocated, skip states past the offload window and between
    chunk ends, and load states on hits."""
    from kvref.impl.reference.offload.keys import get_offload_group_idx
    from kvref.models.offload.offloading_connector_world import OffloadingWorld
    from kvref.models.offload.traces import apply_offloading_op

    counts: Counter = Counter()
    for cfg, ops in mamba_cases:
        w = OffloadingWorld(cfg, "reference", strict=False)
        mamba = len(cfg.kvref_groups()) - 1
        tpc = cfg.block_size * cfg.blocks_per_chunk
        seen = []
        real = w.b.take_boundary_state_offloads

        def take(real=real, seen=seen):
            out = real()
            seen.append(out)
            return out
        w.b.take_boundary_state_offloads = take
        for op in ops:
            apply_offloading_op(w, op)
        mamba_jobs = {j for m in w.metas for j, _, keys, _, _ in m[1] if any(get_offload_group_idx(k) == mamba
                                                                             for k in keys)}
        counts["boundary_stores"] += len(mamba_jobs)
        counts["boundary_stores_flushed"] += sum(j in mamba_jobs for m in w.metas for j in m[2])
        counts["mamba_loads"] += sum(any(get_offload_group_idx(k) == mamba for k in keys)
                                     for m in w.metas for _, _, keys, _, _ in m[0])
        entries = [e for h in seen for es in h.values() for e in es]
        counts["off_chunk_states"] += sum(b % tpc != 0 for _, _, b in entries)
        counts["decode_states"] += cfg.offload_prompt_only and sum(
            b > len(w.prompts[rid]) for h in seen for rid, es in h.items() for _, _, b in es)
        counts["mamba_only_loads"] += cfg.mamba_only and sum(len(m[0]) for m in w.metas)
        assert not w.violations, w.violations
    assert counts["boundary_stores"] >= 30 and counts["boundary_stores_flushed"] >= 1, counts
    assert counts["mamba_only_loads"] >= 1, counts
    assert counts["mamba_loads"] >= 2 and counts["off_chunk_states"] >= 1 and counts["decode_states"] >= 1, counts
