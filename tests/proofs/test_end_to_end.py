"""T3 end to end on the executable reference: plan a hybrid model with ``kvref.spec.plan_kv_cache``
at the *smallest* pool its startup check accepts (``num_gpu_blocks_override``), build the reference
``KVCacheManager`` from the plan, and drive one request of any length up to ``max_model_len``
through the full-sequence gate and chunked prefill + decode with ``k`` batches in flight: no
``allocate_slots`` call may fail. The pre-#40946 gate on the same plan refuses long requests."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvref.spec import ChunkedLocalAttentionSpec, EngineConfig, FullAttentionSpec, SlidingWindowSpec
from kvref.spec.errors import InsufficientKVCacheError
from tests.conftest import profile_examples


def _attn(cls, bs, **kw):
    return cls(block_size=bs, num_kv_heads=1, head_size=8, dtype="float16", **kw)


@st.composite
def models(draw):
    bs = draw(st.sampled_from([2, 4, 8, 16]))
    kinds = draw(st.lists(st.sampled_from(["full", "swa", "cl"]), min_size=1, max_size=4))
    sw = draw(st.integers(1, 96))
    chunk = draw(st.integers(1, 12)) * bs  # T2/T3's bound: chunk is a multiple of the block size
    layers = {}
    for i, kind in enumerate(kinds):
        layers[f"layer{i}"] = (_attn(FullAttentionSpec, bs) if kind == "full"
                               else _attn(SlidingWindowSpec, bs, sliding_window=sw) if kind == "swa"
                               else _attn(ChunkedLocalAttentionSpec, bs, attention_chunk_size=chunk))
    return layers


def _smallest_accepted_plan(layers, M, B, k):
    from kvref.spec.planning import plan_kv_cache
    from kvref.spec.pool_sizing import group_blocks_per_request

    probe = plan_kv_cache(layers, EngineConfig(max_model_len=M, max_num_batched_tokens=B, max_concurrent_batches=k,
                                               enable_prefix_caching=False), available_memory=1 << 40)
    cfg = EngineConfig(max_model_len=M, max_num_batched_tokens=B, max_concurrent_batches=k,
                       enable_prefix_caching=False)
    need = sum(group_blocks_per_request(g.kv_cache_spec, cfg, M) for g in probe.groups)
    plan = plan_kv_cache(layers, EngineConfig(max_model_len=M, max_num_batched_tokens=B, max_concurrent_batches=k,
                                              enable_prefix_caching=False, num_gpu_blocks_override=need + 1),
                         available_memory=1 << 40)
    with pytest.raises(InsufficientKVCacheError):  # one block fewer is rejected: it is the smallest
        plan_kv_cache(layers, EngineConfig(max_model_len=M, max_num_batched_tokens=B, max_concurrent_batches=k,
                                           enable_prefix_caching=False, num_gpu_blocks_override=need),
                      available_memory=1 << 40)
    return plan


def _run_request(plan, L, k, B, steps, gate_variant=False):
    from kvref.impl.interface import PoolConfig
    from kvref.impl.reference.kv_cache_manager import KVCacheManager
    from kvref.impl.request import Request, RequestStatus

    manager = KVCacheManager(PoolConfig(**plan.pool_config_kwargs()))
    M = plan.max_model_len
    req = Request("r", list(range(L)), max_tokens=max(1, M - L + 1))
    in_flight: list[int] = []
    first = True
    for n in steps:
        target = M if req.num_computed_tokens >= L else L  # prefill to L, then decode towards M
        if req.num_computed_tokens >= target:
            break
        n = min(n, B, target - req.num_computed_tokens)
        if req.num_computed_tokens >= L:
            n = 1
            req.output_token_ids.append(0)  # the token sampled by the previous step
        blocks = manager.allocate_slots(req, n, full_sequence_must_fit=first, has_scheduled_reqs=False)
        if blocks is None:
            return False
        first = False
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens += n
        req.num_in_flight_tokens += n
        in_flight.append(n)
        if len(in_flight) > k - 1:
            req.num_in_flight_tokens -= in_flight.pop(0)
        manager.coordinator.block_pool.check_invariants()
    return True


@settings(max_examples=profile_examples(15, 60))
@given(layers=models(), M=st.integers(1, 300), B=st.integers(1, 64), k=st.integers(1, 3),
       L_frac=st.floats(0.0, 1.0), steps=st.lists(st.integers(1, 64), min_size=1, max_size=80))
def test_startup_accepted_single_request_never_fails(layers, M, B, k, L_frac, steps):
    plan = _smallest_accepted_plan(layers, M, B, k)
    L = max(1, int(L_frac * M))
    assert _run_request(plan, L, k, B, steps + [B] * (2 * M)), "allocate_slots failed at startup's word"


def test_pre_40946_gate_refuses_a_long_request_the_startup_check_accepted():
    """Full + SWA (window 64, block 16, steps of 64): startup sizes SWA at its cap; a gate charging
    the whole sequence (pre-#40946) cannot admit a max-length request into the empty pool."""
    from kvref.proofs.formulas import REFERENCE
    from kvref.proofs.ops import PyOps
    from kvref.proofs.variants import get_variant

    layers = {"full": _attn(FullAttentionSpec, 16), "swa": _attn(SlidingWindowSpec, 16, sliding_window=64)}
    M, B, k = 4096, 64, 1
    plan = _smallest_accepted_plan(layers, M, B, k)
    assert _run_request(plan, M, k, B, [B] * 200)
    cap = plan.admission_caps[1]
    pre = get_variant("pre-40946-gate").formulas
    gate_pre = pre.gate_full(PyOps, M, 16, 1) + pre.gate_swa(PyOps, M, 16, cap)
    gate_ref = REFERENCE.gate_full(PyOps, M, 16, 1) + REFERENCE.gate_swa(PyOps, M, 16, cap)
    assert gate_ref <= plan.num_usable_blocks < gate_pre


def test_a_pool_sized_for_one_batch_fails_under_async_scheduling():
    """The in-flight term of the cap is needed (PR 40946 as merged reserved one step only): the
    same run succeeds when the plan knows k = 2, and fails mid-prefill when it was sized for k = 1."""
    layers = {"swa": _attn(SlidingWindowSpec, 16, sliding_window=64)}
    assert _run_request(_smallest_accepted_plan(layers, 4096, 64, 2), 4096, 2, 64, [64] * 200)
    assert not _run_request(_smallest_accepted_plan(layers, 4096, 64, 1), 4096, 2, 64, [64] * 200)
