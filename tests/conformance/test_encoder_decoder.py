"""Encoder-decoder pools (FA + cross-attention, caching off): reference vs vLLM (#22).
~15 s at CI=true (vLLM import + 40 programs per test)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings

pytest.importorskip("vllm")

from kvref.impl.reference.adapter import ReferenceKVCacheManager  # noqa: E402
from kvref.impl.vllm.kv_cache_manager import VllmKVCacheManager  # noqa: E402
from kvref.models.conformance.encoder_decoder import (  # noqa: E402
    EncDecDivergence,
    encoder_decoder_cases,
    run_encoder_decoder,
)


def _managers(pool):
    return {"reference": ReferenceKVCacheManager(pool), "vllm": VllmKVCacheManager(pool)}


def _run_all(make, examples=40) -> Counter:
    seen = Counter()

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=encoder_decoder_cases())
    def run(case):
        seen.update(run_encoder_decoder(case, make))

    run()
    return seen


def test_vllm_agrees_on_generated_encoder_decoder_programs():
    seen = _run_all(_managers)
    assert seen["admitted"] > 0 and seen["refused"] > 0 and seen["external"] > 0 and seen["steps"] > 0


def test_vllm_dropping_encoder_tokens_is_found():
    """A planted vLLM fault: the cross-attention group sized without the encoder tokens."""
    def make(pool):
        managers = _managers(pool)
        vllm = managers["vllm"]
        original = vllm._mgr.allocate_slots

        def faulty(*args, **kwargs):
            kwargs["num_encoder_tokens"] = max(0, kwargs.get("num_encoder_tokens", 0) - 1)
            return original(*args, **kwargs)

        vllm._mgr.allocate_slots = faulty
        return managers

    with pytest.raises(EncDecDivergence):
        _run_all(make)


def test_reference_sizing_cross_by_decoder_tokens_is_found(monkeypatch):
    """A planted reference fault: cross-attention treated as a decoder group."""
    from kvref.impl.reference.cross_attention_manager import CrossAttentionManager

    monkeypatch.setattr(CrossAttentionManager, "is_cross_attention", False)
    with pytest.raises(EncDecDivergence):
        _run_all(_managers)
