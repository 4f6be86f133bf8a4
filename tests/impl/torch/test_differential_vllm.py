"""Torch implementation vs vLLM 0.33.0's own KVCacheManager on generated configs and traces.

Same block ids (exactly), admission decisions, hits, free-queue order, hash map and ref counts
after every operation; uniform and hybrid layouts of full attention, sliding window and chunked
local attention, with prefix caching on/off, watermark, reserved blocks, lookahead slots,
in-flight tokens, the full-sequence admission gate with its caps, preemption and frees.
"""

from __future__ import annotations

import pytest
from hypothesis import settings

from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def twin_factory():
    """vLLM's own KVCacheManager behind the adapters' interface (#26: the one mirror of kvref
    requests, no test-side copy); ``hash_index`` and ``ref_counts`` feed the deep comparison."""
    require_vllm()
    from kvref.impl.vllm.kv_cache_manager import VllmKVCacheManager

    return VllmKVCacheManager


def test_torch_matches_vllm_state_machine(twin_factory):
    from kvref.models.machines.torch_differential import make_differential_machine

    machine = make_differential_machine(twin_factory)
    machine.TestCase.settings = settings(max_examples=profile_examples(25, 400), stateful_step_count=40)
    machine.TestCase().runTest()


def test_hybrid_eagle_hits_match_vllm(twin_factory):
    """A grid of full attention + sliding window pools with EAGLE (all groups, or one flagged),
    different block sizes and windows, and prompts sharing a long prefix: every hit, allocation,
    hash map and free queue equals vLLM's (the generated traces rarely reach hybrid EAGLE hits)."""
    import itertools

    from kvref.impl.interface import PoolConfig
    from kvref.impl.request import Request, RequestStatus
    from kvref.impl.torch import make_manager
    from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec

    kw = dict(num_kv_heads=1, head_size=2, dtype="float32")
    hits = 0
    for fbs, sbs, window, flagged in itertools.product([2, 4], [2, 4], [1, 3, 5, 9], [None, 0, 1]):
        groups = (KVCacheGroupSpec(("f",), FullAttentionSpec(block_size=fbs, **kw), is_eagle_group=flagged == 0),
                  KVCacheGroupSpec(("s",), SlidingWindowSpec(block_size=2, sliding_window=window, **kw),
                                   is_eagle_group=flagged == 1))
        cfg = PoolConfig(num_blocks=60, groups=groups, max_model_len=64, scheduler_block_size=max(fbs, sbs),
                         hash_block_size=2, use_eagle=True)
        t, v = make_manager(cfg, device="cpu"), twin_factory(cfg)
        base = list(range(30))
        for i, n in enumerate([30, 29, 25, 22, 31]):
            r = Request(f"r{i}", base[:n] + [100 + i] * (i % 3))
            got = t.get_computed_blocks(r)
            assert got == v.get_computed_blocks(r), (cfg, i)
            hits += got[1] > 0
            args = (r, r.num_tokens - got[1], got[1], got[0])
            assert t.allocate_slots(*args) == v.allocate_slots(*args)
            r.num_computed_tokens, r.status = r.num_tokens, RequestStatus.RUNNING
            assert t.hash_index() == v.hash_index() and t.free_block_queue() == v.free_block_queue()
        t.check_invariants()
    assert hits > 100


def test_torch_matches_vllm_in_the_shared_conformance_harness(twin_factory):
    """The project's own generated traces (``kvref.models.machines.kv_cache_manager``, written
    independently of this implementation's tests: async batches, external loads, preemptions)
    with kinds ``("torch", "vllm")``; Mamba "align" pools are excluded (not modelled here)."""
    from hypothesis import HealthCheck

    from kvref.models.machines.kv_cache_manager import kv_cache_manager_machine
    from kvref.models.strategies.pools import GROUP_SETS

    # not modelled by the torch implementation: Mamba "align" (block-sized or fine-grained), R-SWA, ring
    group_sets = tuple(g for g in GROUP_SETS if g not in ("fa+mamba_align", "fa+mamba_fine", "fa+rswa", "fa+ring"))
    hits = []
    for _ in range(2):
        # a second batch only if the first drew no prefix hit (CI draws at random: one CI run saw
        # 0 hits in 60 examples where 17-29 are usual); every trace of both is checked in full
        machine = kv_cache_manager_machine(("torch", "vllm"), group_sets=group_sets)
        machine.TestCase.settings = settings(max_examples=profile_examples(10, 60), stateful_step_count=60,
                                             suppress_health_check=list(HealthCheck))
        machine.TestCase().runTest()
        st = machine.stats
        assert st.unsupported_pools == 0, dict(st.unsupported_reasons)
        assert st.ops_applied > 0 and len(st.group_sets) >= 3
        hits.append(st.prefix_hits)
        if st.prefix_hits:
            break
    assert hits[-1] > 0, f"no prefix hit in two batches of generated traces: {hits}"


def test_torch_matches_vllm_and_its_numbers_match_dense_attention(twin_factory):
    """The differential machine with the data path on: block ids equal vLLM's *and* every chunk
    the trace schedules (prefill chunks after prefix hits, decodes, connector loads, after
    preemptions and evictions) attends through the torch block tables to dense attention's output."""
    from kvref.models.machines.torch_differential import make_differential_machine

    machine = make_differential_machine(twin_factory, datapath=True)
    machine.TestCase.settings = settings(max_examples=profile_examples(15, 100), stateful_step_count=40)
    machine.TestCase().runTest()
