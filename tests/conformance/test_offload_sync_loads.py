"""conform-offload with synchronous loads (``sync_load_budget_bytes``): vLLM's
``_reserve_sync_load`` and the sync path of ``update_state_after_alloc`` against the reference, on the
cases ``kvref verify`` draws at the ``fast`` profile (seed 0). Faults of that class planted in vLLM's
own source for one test must be flagged while the clean vLLM passes; the derandomized reach test
counts, on the reference, that the cases take the paths the faults sit on."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from tests.conformance.offloading_faults import conform_offloading, offloading_scheduler_class, planted_edit
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

FAULTS = {
    # the budget admits one load too many
    "budget_overrun": ("_reserve_sync_load", "if self._current_batch_sync_load_bytes + num_bytes > budget:",
                       "if self._current_batch_sync_load_bytes + num_bytes > budget + num_bytes:"),
    # a hit covering the whole request loads synchronously: nothing left to compute
    "whole_request_sync": ("_reserve_sync_load", "or num_computed_tokens + num_hit_tokens >= req_status.req.num_tokens",
                           "or num_computed_tokens + num_hit_tokens > req_status.req.num_tokens"),
    # a sync load's first block found by a missing hash (its blocks are hashed at allocation)
    "sync_load_by_hash": ("update_state_after_alloc", "(sync_load or block.block_hash is None)",
                          "(block.block_hash is None)"),
    # a sync load's keys kept "being loaded": other requests wait for a copy already done
    "sync_keys_pending": ("update_state_after_alloc", "if self._chunks_being_loaded is not None and not sync_load:",
                          "if self._chunks_being_loaded is not None:"),
}


@pytest.fixture(scope="module")
def sync_cases():
    require_vllm()
    from kvref.models.offload.offloading_connector_world import OffloadingConfig
    from kvref.verify import _offload_cases

    return [c for c in _offload_cases(random.Random(0), 80)
            if isinstance(c[0], OffloadingConfig) and c[0].sync_load_budget_bytes]


def test_sync_cases_agree_on_clean_vllm(sync_cases):
    assert len(sync_cases) >= 8
    assert conform_offloading(sync_cases) is None


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_planted_sync_load_fault_is_flagged(sync_cases, fault):
    name, old, new = FAULTS[fault]
    with planted_edit(offloading_scheduler_class(), name, old, new):
        finding = conform_offloading(sync_cases)
    assert finding is not None, f"{fault} survived the fast sync-load cases"


def test_fast_cases_reach_the_sync_load_paths(sync_cases):
    """Seeded cases (no Hypothesis draw): synchronous loads, hits the budget or a whole-request hit
    leaves asynchronous, and sync answers whose allocation then failed (the reservation stays
    spent for the step)."""
    from kvref.models.offload.offloading_connector_world import OffloadingWorld
    from kvref.models.offload.traces import apply_offloading_op

    counts: Counter = Counter()
    for cfg, ops in sync_cases:
        w = OffloadingWorld(cfg, "reference", strict=False)
        for op in ops:
            apply_offloading_op(w, op)
        sync = sum(allocated for _, _, allocated in w.sync_loads)
        counts["sync_loads"] += sync
        counts["sync_answers_not_allocated"] += len(w.sync_loads) - sync
        counts["async_loads"] += sum(len(m[0]) for m in w.metas) - sync
        counts["sync_loads_ending_a_prompt"] += sum(n == len(w.prompts[rid]) - 1 for rid, n, _ in w.sync_loads)
    assert counts["sync_loads"] >= 5 and counts["async_loads"] >= 1, counts  # 11, 2 when written
    assert counts["sync_answers_not_allocated"] >= 1, counts  # 9
