"""Startup's word holds at runtime, on vLLM 0.33.0 itself, and a re-introduced #39734 is caught."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvref.models.conformance.startup_liveness import LivenessCase, check_startup_liveness, random_case, run_case
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm


@pytest.fixture(scope="module")
def vllm():
    return require_vllm()


@pytest.mark.vllm
@settings(max_examples=profile_examples(40, 150))
@given(st.randoms(use_true_random=False))
def test_vllm_admits_and_serves_one_max_length_request_in_the_smallest_accepted_pool(vllm, rng):
    case = random_case(rng)
    failure = run_case("vllm", case)
    assert failure is None, failure.render()


def test_chunk_multiple_of_block_size_is_generated():
    rng = random.Random(5)
    for _ in range(200):
        case = random_case(rng)
        assert case.attention_chunk_size % case.block_size == 0


def uncapped_sliding_window_admission(monkeypatch, vllm):
    """Re-introduce #39734 in the installed vLLM: managers get no admission cap, so the
    full-sequence gate charges sliding-window groups for the whole sequence while startup still
    sizes them by the recycling bound (what vLLM did before PR #40946)."""
    from vllm.v1.core import single_type_kv_cache_manager as stm

    original = stm.SingleTypeKVCacheManager.__init__

    def patched(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.max_admission_blocks_per_request = None

    monkeypatch.setattr(stm.SingleTypeKVCacheManager, "__init__", patched)


@pytest.mark.vllm
def test_reintroduced_39734_in_installed_vllm_is_reported(vllm, monkeypatch):
    uncapped_sliding_window_admission(monkeypatch, vllm)
    # A long request and a short window: startup sizes SWA at cdiv(w-1+F, bs)+1 blocks, the
    # patched gate charges cdiv(max_model_len, bs).
    case = LivenessCase(block_size=4, kinds=("full", "sliding_window"), max_model_len=256,
                        max_num_batched_tokens=16, max_concurrent_batches=1, sliding_window=8,
                        attention_chunk_size=8, prompt_len=256)
    failure = run_case("vllm", case)
    assert failure is not None and failure.phase == "admission", "the patched gate must reject"
    assert "full-sequence admission gate rejected" in failure.render()
    ran, failures = check_startup_liveness("vllm", 60, seed=3)
    assert ran == 60 and failures, "random cases must also expose the re-introduced bug"
    assert all(f.phase == "admission" for f in failures)
    assert all({"sliding_window", "chunked_local"} & set(f.case.kinds) for f in failures)


@settings(max_examples=profile_examples(60, 300))
@given(st.randoms(use_true_random=False))
def test_reference_admits_and_serves_one_max_length_request_in_the_smallest_accepted_pool(rng):
    case = random_case(rng)
    failure = run_case("reference", case)
    assert failure is None, failure.render()


@pytest.mark.vllm
def test_mamba_sized_without_its_speculative_blocks_is_reported(vllm):
    """PR 28176's class: startup sizes a Mamba group at one state block per request while the
    manager keeps ``1 + num_speculative_blocks`` (speculative decoding on a hybrid, e.g. MTP on
    Qwen3-Next). Re-planted in the installed vLLM, the random cases catch it on a fixed seed; the
    clean vLLM serves the same cases."""
    from tests.vllm_faults import planted_vllm_fault

    assert check_startup_liveness("vllm", 60, seed=0)[1] == []
    with planted_vllm_fault("iface.pr28176_mamba_ignores_spec_blocks"):
        ran, failures = check_startup_liveness("vllm", 60, seed=0)
    assert ran == 60 and failures
    assert all("mamba" in f.case.kinds and f.case.mamba_speculative_blocks for f in failures)


def test_mamba_cases_draw_speculative_blocks():
    rng = random.Random(0)
    cases = [random_case(rng) for _ in range(300)]
    drawn = {c.mamba_speculative_blocks for c in cases if "mamba" in c.kinds}
    assert drawn == {0, 1, 2}
    assert all(c.mamba_speculative_blocks == 0 for c in cases if "mamba" not in c.kinds)
