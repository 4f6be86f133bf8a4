"""The Mamba "align" part of ``conform-scheduler`` (issue #22): the reference scheduler in lock
step with vLLM 0.33.0's on FA + Mamba "align" pools alone (``scheduler_mamba``).

The planted faults show that the comparison sees the chunk split and the Mamba manager's cache
hits: vLLM's scheduler without its split, or its Mamba manager that never finds a hit, must diverge
from the reference."""

from __future__ import annotations

import pytest

from tests.conftest import profile_examples
from tests.conformance.scheduler_targets import vllm_scheduler  # noqa: F401 - the module-scoped fixture

pytestmark = pytest.mark.vllm


def test_mamba_align_traces_match_vllm_and_reach_the_split_and_hits(vllm_scheduler):
    from kvref.models.machines.scheduler_mamba import run_mamba_align_machine

    run = run_mamba_align_machine(profile_examples(15, 40), reproducible=True)
    assert run.ok, run.failure
    c = run.coverage
    assert c["mamba_traces"] >= 3, c
    assert c["mamba_checkpoint_traces"] > 0 and c["mamba_sparse_retention_traces"] > 0, c
    assert c["sparse_window_traces"] > 0, c
    for path in ("mamba_clipped_chunks", "prefix_hits", "follow_ups", "prefill_chunks", "preemptions"):
        assert c.get(path, 0) > 0, (path, c)


def test_a_vllm_scheduler_that_does_not_split_is_a_divergence(vllm_scheduler, monkeypatch):
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvref.models.machines.scheduler_mamba import run_mamba_align_machine

    monkeypatch.setattr(Scheduler, "_mamba_block_aligned_split",
                        lambda self, request, num_new_tokens, *a, **k: num_new_tokens)
    run = run_mamba_align_machine(profile_examples(10, 40), reproducible=True, shrink=False)
    assert not run.ok, "an unclipped chunk went unnoticed"
    assert run.failure.startswith("Divergence"), run.failure


def test_a_mamba_manager_that_finds_no_hit_is_a_divergence(vllm_scheduler, monkeypatch):
    """vLLM's Mamba manager reports no cached state (the attention group's hit then reconciles
    to nothing): a follow-up the reference admits with a hit is admitted cold on vLLM."""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    from kvref.models.machines.scheduler_mamba import run_mamba_align_machine

    def no_hit(cls, block_hashes, max_length, kv_cache_group_ids, *args, **kwargs):
        return tuple([] for _ in kv_cache_group_ids), 0

    monkeypatch.setattr(MambaManager, "find_longest_cache_hit", classmethod(no_hit))
    run = run_mamba_align_machine(profile_examples(10, 40), reproducible=True, shrink=False)
    assert not run.ok, "a lost Mamba hit went unnoticed"


def test_sparse_window_traces_record_the_junction_as_vllm_does(vllm_scheduler):
    """vLLM's ``schedule()`` stores ``get_computed_blocks``' shared-prefix junction on every admitted
    request; sparse retention then keeps the sliding-window tail ending there. The reference stored
    it only on Mamba "align" pools, so on FA+SWA pools under ``prefix_cache_retention_interval`` it
    dropped a tail vLLM caches: the published ``BlockStored`` and the block ids differed (seed 1
    diverged within 40 traces before the fix)."""
    from kvref.models.machines.scheduler_mamba import run_mamba_align_machine, sparse_window_setups

    run = run_mamba_align_machine(40, seed=1, shrink=False, setups=sparse_window_setups())
    assert run.ok, run.failure
    assert run.coverage["sparse_window_traces"] >= 20, run.coverage
