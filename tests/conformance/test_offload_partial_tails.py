"""conform-offload on pools with partial tails: request hashes finer than the blocks beside a Mamba
"align" group, where vLLM's OffloadingConnector stores the prompt's last hash boundary inside a block
(``_build_partial_tail_store_jobs``: the COW-ed state + the attention block holding it), looks it up
past the complete chunks (``_lookup``, ``_lookup_partial_tail``, the bridge chunk) and loads it
(``update_state_after_alloc``), with self-describing KV events for it (``record_partial_store`` /
``record_partial_lookup``). The reference must agree step by step; faults of that class, planted in
vLLM's own source for one test, must be flagged by the cases ``kvref verify`` draws at the ``fast``
profile (seed 0), while the clean vLLM passes them.

The derandomized reach test counts, on the reference, that those cases take the paths the faults
sit on.
"""

from __future__ import annotations

import os
import random
from collections import Counter

import pytest

from tests.conformance.offloading_faults import offloading_scheduler_class, planted_edit
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def tail_cases():
    """What conform-offload runs at the fast profile, seed 0: its partial-tail traces, and the
    general traces' configurations with partial tails."""
    require_vllm()
    from kvref.models.offload.offloading_connector_world import OffloadingConfig
    from kvref.models.offload.offloading_partial_tails import partial_tail_cases
    from kvref.verify import _offload_cases

    general = [c for c in _offload_cases(random.Random(0), 80)
               if isinstance(c[0], OffloadingConfig) and c[0].hash_block_size]
    return partial_tail_cases(0, 8) + general


def conform_tails(cases) -> str | None:
    """conform-offload's partial-tail comparison (reference vs vLLM after every operation): the
    first finding, or None."""
    from kvref.models.offload.offloading_partial_tails import run_partial_tail_traces
    from kvref.models.offload.world_common import OffloadInvariantError

    try:
        run_partial_tail_traces(cases)
    except OffloadInvariantError as exc:
        return str(exc)[:400]
    return None


FAULTS = {
    # a partial tail whose key is still being written is taken as a hit (loads a chunk not yet stored)
    "partial_lookup_ignores_pending": ("_lookup_partial_tail", "    if pending:\n        return False, True\n",
                                       ""),
    # the load reads the complete chunk of the tail's block as well as the tail's own key
    "partial_load_keeps_last_chunk": ("update_state_after_alloc",
                                      "end_chunk_idx = num_chunks - (partial_tail_boundary is not None)",
                                      "end_chunk_idx = num_chunks"),
    # a partial hit may cover the last prompt token (nothing left to compute)
    "partial_hit_covers_last_prompt_token": ("_lookup", "min(req_status.req.num_prompt_tokens - 1, block_end - 1)",
                                             "min(req_status.req.num_prompt_tokens, block_end - 1)"),
    # the partial tail's sources are not fenced: a re-allocated COW block is not waited for
    "partial_store_unfenced": ("_build_partial_tail_store_jobs",
                               "self._block_id_to_pending_jobs.setdefault(block_id, set()).add(job_id)", "pass"),
    # the attention source is the block before the boundary's
    "partial_store_block_off_by_one": ("_build_partial_tail_store_jobs",
                                       "block_idx = boundary // self._partial_tail_block_size\n",
                                       "block_idx = boundary // self._partial_tail_block_size - 1\n"),
}


def test_partial_tail_cases_agree_on_clean_vllm(tail_cases):
    assert len(tail_cases) >= 3
    assert conform_tails(tail_cases) is None


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_planted_partial_tail_fault_is_flagged(tail_cases, fault):
    name, old, new = FAULTS[fault]
    with planted_edit(offloading_scheduler_class(), name, old, new):
        finding = conform_tails(tail_cases)
    assert finding is not None, f"{fault} survived the fast partial-tail cases"


def test_fast_cases_reach_the_partial_tail_paths(tail_cases):
    """On the reference (derandomized: the cases are seeded), the fast partial-tail cases store
    partial tails (flushed when their COW block is re-allocated), hit them past the complete chunks,
    defer a lookup on a tail still being stored, load them, and snapshot them for self-describing
    events. (The bridge chunk of ``_lookup`` needs EAGLE proof margins: a hit presented block-aligned
    cannot reach the next block without them.)"""
    from kvref.impl.reference.offload import offload_event_tracker
    from kvref.impl.reference.offload.partial_tails import PartialTails
    from kvref.models.offload import offloading_partial_tails as tails

    counts: Counter = Counter()
    real_lookup = PartialTails._lookup_with_partial_tail
    real_snapshot = offload_event_tracker.OffloadingEventsTracker.snapshot_partial_tail

    def lookup(sched, st, hit, ends):
        out = real_lookup(sched, st, hit, ends)
        counts["tail_hits"] += st.partial_tail_boundary is not None
        counts["tail_deferred"] += hit == 0 and out is None
        return out

    def snapshot(self, *args):
        out = real_snapshot(self, *args)
        counts["partial_snapshots"] += out is not None
        return out

    tails.COVERAGE.clear()
    PartialTails._lookup_with_partial_tail = lookup
    offload_event_tracker.OffloadingEventsTracker.snapshot_partial_tail = snapshot
    try:
        tails.run_partial_tail_traces(tail_cases, backends=("reference",))
    finally:
        PartialTails._lookup_with_partial_tail = real_lookup
        offload_event_tracker.OffloadingEventsTracker.snapshot_partial_tail = real_snapshot
    counts.update(tails.COVERAGE)
    assert counts["tail_stores"] >= 20 and counts["tail_flushes"] >= 1 and counts["tail_loads"] >= 1, counts
    assert counts["tail_hits"] >= 5 and counts["tail_deferred"] >= 1 and counts["partial_snapshots"] >= 1, counts


def test_vllm_asserts_on_a_store_cap_below_a_partial_tail():
    """vLLM 0.33.0: a request whose ``max_offload_tokens`` ends before its prompt's partial tail
    makes ``_build_partial_tail_store_jobs`` assert ``boundary <= max_boundary`` (the engine dies);
    the reference skips that tail, as the aligned boundary stores skip states past the window
    (docs/differences.md). The generated traces leave such caps out (``_without_store_cap``)."""
    require_vllm()
    from kvref.models.offload.offloading_connector_world import OffloadingConfig, OffloadingWorld

    cfg = OffloadingConfig(block_size=8, hash_block_size=4, blocks_per_chunk=1, mamba_align=True, max_model_len=64,
                           num_gpu_blocks=40, num_cpu_chunks=24, kv_transfer_params=({"max_offload_tokens": 8},))
    ref, vll = (OffloadingWorld(cfg, b, strict=False) for b in ("reference", "vllm"))
    for w in (ref, vll):
        w.add_request(list(range(100, 120)))  # even arrival: no params
        w.add_request(list(range(200, 222)))  # max_offload_tokens 8, its prompt's tail at 20
    for _ in range(4):
        ref.step(64)
    with pytest.raises(AssertionError):
        for _ in range(4):
            vll.step(64)
    tails = [keys for m in ref.metas for _, rid, keys, _, _ in m[1] if rid == "r1" and len(keys) > 1]
    assert tails == [], "the reference stored r1's tail past its max_offload_tokens"
    assert any(len(keys) > 1 for m in ref.metas for _, rid, keys, _, _ in m[1] if rid == "r0"), \
        "r0 (no cap) stores its partial tail"


def test_partial_tail_sub_run_is_reproducible_across_hash_seeds(monkeypatch):
    """conform-offload's partial-tail sub-run gives one trace per seed whatever the caller's
    PYTHONHASHSEED (which salts the set order vLLM's complete_store walks, and NONE_HASH): its
    traces run in a child process pinned to the seed (kvref.verify_offload_tails), so two runs
    from an environment with PYTHONHASHSEED 1 and then 2 get the same stats, counts and trace
    digest (a child that inherited the caller's value would differ: NONE_HASH and the set order
    follow it). One trace per run; two spawned interpreters, ~20 s at CI=true under load."""
    require_vllm()
    from kvref.verify_offload_tails import run_pinned_partial_tails

    outs = []
    for hash_seed in ("1", "2"):
        monkeypatch.setenv("PYTHONHASHSEED", hash_seed)
        outs.append(run_pinned_partial_tails(0, 1))
        assert os.environ["PYTHONHASHSEED"] == hash_seed  # the caller's value is restored
    assert outs[0] == outs[1]
    assert outs[0][0]["traces"] == 1 and outs[0][0]["ops"] > 0


def test_pinned_partial_tails_rejects_bad_arguments():
    from kvref.verify_offload_tails import run_pinned_partial_tails

    with pytest.raises(ValueError, match="seed"):
        run_pinned_partial_tails("0", 2)
    with pytest.raises(ValueError, match="n"):
        run_pinned_partial_tails(0, -1)


def test_a_divergence_in_the_pinned_child_fails_conform_offload(monkeypatch):
    """The child's OffloadInvariantError comes back as conform-offload's failed row naming the
    partial tails, with the child's message as the details; no later sub-run runs (<0.1 s)."""
    from kvref import verify_offload_tails as vot
    from kvref.check_context import VerifyContext
    from kvref.models.offload.world_common import OffloadInvariantError
    from kvref.report import FAILED, PASSED, CheckResult

    def diverge(seed, n, n_eagle=0):
        raise OffloadInvariantError("partial-tail trace 0 op 4: the step outputs differ")

    def not_reached(*_args, **_kwargs):
        raise AssertionError("the retention sub-run ran after the failing one")

    monkeypatch.setattr(vot, "run_pinned_partial_tails", diverge)
    monkeypatch.setattr(vot, "with_retention", not_reached)
    res = vot.with_partial_tails(VerifyContext(), CheckResult("conform-offload", PASSED, "main", examined=10))
    assert res.status == FAILED and "partial tails" in res.summary
    assert res.details == ["partial-tail trace 0 op 4: the step outputs differ"]
