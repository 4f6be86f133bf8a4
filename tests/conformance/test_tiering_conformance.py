"""vLLM 0.33.0's multi-tier offloading (``TieringOffloadingManager`` with real fs and example tiers,
built through ``TieringOffloadingSpec``) against kvref's reference, every observable compared after
every operation (#22); and faults planted in vLLM's tiering code (monkeypatched for the test) that
the same traces must find."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


def _traces(seed: int, n: int) -> dict:
    require_vllm()
    from kvref.models.machines.tiering import run_traces

    return run_traces(seed, n)


def test_generated_traces_agree_and_reach_the_tiering_paths():
    """Seeded traces (the check's generator): every answer and state agrees, and the rare paths are
    reached — RETRY answers from async lookups, promotions from disk whose bytes are checked,
    evictions, refused stores, injected I/O errors."""
    n = profile_examples(10, 40)
    stats = _traces(0, n)
    assert stats["traces"] == n
    assert stats["retries"] > 0 and stats["promotions"] > 0
    assert stats["fs_promotions"] > 0 and stats["fs_promotions_checked"] > 0
    assert stats["evictions"] > 0 and stats["stores_refused"] > 0
    assert stats["io_errors"] > 0
    assert stats["request_level_cascades"] > 0  # kvref's out-of-tree request-level tier


@settings(max_examples=profile_examples(8, 30), deadline=None, suppress_health_check=list(HealthCheck),
          database=None)
@given(rng=st.randoms(use_true_random=False), cfg_seed=st.integers(0, 2**32 - 1))
def test_hypothesis_traces_agree(rng, cfg_seed):
    """Hypothesis draws the configuration and every operation (its ``Random`` records the draws, so
    a divergence shrinks to a short trace)."""
    require_vllm()
    import random

    from kvref.models.machines.tiering import TieringConfig, run_trace

    cfg = TieringConfig.random(random.Random(cfg_seed))
    stats, trace = run_trace(cfg, rng, rng.randint(10, 50))
    assert stats["ops"] == len(trace)


def test_backpressure_decays_before_a_completion_lands():
    """Found by the Hypothesis traces: vLLM asks the detector whether it is under pressure before
    applying a completed store (to log a change), and that question applies the idle decay up to
    now, so the EMA differs (4e-7 relative here) unless the model asks too."""
    require_vllm()
    from kvref.models.machines.tiering import TieringConfig, run_ops

    cfg = TieringConfig(num_chunks=4, tiers=("example", "fs"), backpressure="ThrottledDropPolicy", warmup=1,
                        num_keys=7)
    ops = [("new_request",)]
    for k, dt in zip(range(5), (0.0, 0.001, 3.0, 0.0001, 0.0)):
        ops += [("prepare_store", 0, (k,)), ("complete_store", 0, True), ("advance", dt), ("drain", False, False)]
    stats = run_ops(cfg, ops)
    assert stats["ops"] == len(ops)


def _finds(monkeypatch, target: str, replacement, seeds=range(3), n: int = 8) -> str:
    """Plant ``replacement`` at ``target`` (module:attribute path) in vLLM and return the divergence."""
    require_vllm()
    import importlib

    from kvref.models.machines.tiering import TieringDivergence, run_traces

    mod_name, attr = target.split(":")
    obj = importlib.import_module(mod_name)
    *owners, name = attr.split(".")
    for o in owners:
        obj = getattr(obj, o)
    monkeypatch.setattr(obj, name, replacement(getattr(obj, name)))
    for seed in seeds:
        try:
            run_traces(seed, n)
        except TieringDivergence as exc:
            return str(exc)
    raise AssertionError(f"the planted fault at {target} was not found")


M = "vllm.v1.kv_offload.tiering.manager"


def test_finds_a_cascade_that_ignores_backpressure(monkeypatch):
    msg = _finds(monkeypatch, f"{M}:TieringOffloadingManager._should_store_to_tier",
                 lambda orig: lambda self, tier, n: True)
    assert "vLLM" in msg


def test_finds_a_cascade_that_does_not_pin_its_chunks(monkeypatch):
    def unpinned(orig):
        def create_store_job(self, keys, req_context, tier_idx=0):
            job = orig(self, keys, req_context, tier_idx)
            self.primary_tier.complete_load(keys, req_context)  # the pin released at once
            return job
        return create_store_job

    msg = _finds(monkeypatch, f"{M}:TieringOffloadingManager.create_store_job", unpinned)
    assert "vLLM" in msg


def test_finds_a_failed_promotion_that_keeps_nothing(monkeypatch):
    """A partial failure must keep the keys that did load (``successful_keys``)."""
    def all_or_nothing(orig):
        def complete(self, job_metadata, completed_job):
            from vllm.v1.kv_offload.tiering.base import JobResult

            if not completed_job.success:
                completed_job = JobResult(completed_job.job_id, False, None, completed_job.transfer_time,
                                          completed_job.transfer_bytes)
            return orig(self, job_metadata, completed_job)
        return complete

    msg = _finds(monkeypatch, f"{M}:TieringOffloadingManager._complete_promotion", all_or_nothing,
                 seeds=range(20))
    assert "vLLM" in msg


def test_finds_a_finalization_that_ignores_pending_stores(monkeypatch):
    def early(orig):
        def maybe_finalize(self, req_id, exclude_tier_idx=None):
            state = self._req_state[req_id]
            pending, state.pending_primary_stores = state.pending_primary_stores, 0
            try:
                return orig(self, req_id, exclude_tier_idx)
            finally:
                if req_id in self._req_state:
                    state.pending_primary_stores = pending
        return maybe_finalize

    msg = _finds(monkeypatch, f"{M}:TieringOffloadingManager._maybe_finalize_request", early)
    assert "vLLM" in msg


def test_finds_a_failed_load_that_keeps_its_lookup_verdict(monkeypatch):
    """vLLM #49176: a failed promotion must mark its keys absent, or the lookup keeps promising them."""
    msg = _finds(monkeypatch, "vllm.v1.kv_offload.tiering.async_lookup:AsyncLookupManager.mark_miss",
                 lambda orig: lambda self, keys: None, seeds=range(20))
    assert "vLLM" in msg


def test_finds_request_level_cascades_that_skip_chunks_already_stored(monkeypatch):
    msg = _finds(monkeypatch, f"{M}:TieringOffloadingManager._cascade_existing_chunks_to_request_level_tiers",
                 lambda orig: lambda self, keys, req_context, tiers: None)
    assert "vLLM" in msg


def test_finds_a_promotion_held_too_long_after_reset(monkeypatch):
    msg = _finds(monkeypatch, f"{M}:TieringOffloadingManager.on_reset_flushed", lambda orig: lambda self: None)
    assert "vLLM" in msg
