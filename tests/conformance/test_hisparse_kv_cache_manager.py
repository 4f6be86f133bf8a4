"""A HiSparse pool built by the reference ``KVCacheManager`` (``PoolConfig.group_roles`` /
``hisparse_host_num_blocks``) against vLLM 0.33.0's own ``KVCacheManager`` with its bound
``HiSparseCoordinator`` (issue #23): generated requests on shared prompts go through
``get_computed_blocks`` -> ``allocate_slots`` -> the coordinator's per-step write-back planning ->
the offload command -> the workers' reports -> ``free``, and the hit, the new block ids of every
group, the page transfers and the free counts of both pools must agree after every step, with
prefix caching on and off."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from kvref.impl.interface import PoolConfig
from kvref.impl.request import Request, RequestStatus
from kvref.spec.errors import InvalidFieldError
from kvref.spec.hisparse import HiSparseHotSpec, HiSparseResidentSpec
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

BS = 4
ROLES = ("hisparse_source", "hisparse_indexer", "default", "default")


def _groups() -> tuple[KVCacheGroupSpec, ...]:
    fa = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype="float32")
    return (KVCacheGroupSpec(("source",), fa), KVCacheGroupSpec(("indexer",), fa),
            KVCacheGroupSpec(("resident",), HiSparseResidentSpec(block_size=BS, page_size=4 * BS)),
            KVCacheGroupSpec(("hot",), HiSparseHotSpec(block_size=BS, page_size=4 * BS, blocks_per_request=2)))


def _pool_config(num_blocks: int, host_blocks: int, caching: bool) -> PoolConfig:
    return PoolConfig.off_plan("a HiSparse pool as vLLM's tests build it, field by field", num_blocks=num_blocks,
                               groups=_groups(), max_model_len=64, scheduler_block_size=BS, hash_block_size=BS,
                               enable_caching=caching, group_roles=ROLES, hisparse_host_num_blocks=host_blocks)


def _vllm_manager(num_blocks: int, host_blocks: int, caching: bool):
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.hisparse.coordinator import get_hisparse_coordinator
    from vllm.v1.kv_cache_interface import (FullAttentionSpec as VFull, HiSparseHotSpec as VHot,
                                            HiSparseResidentSpec as VResident, KVCacheConfig, KVCacheGroupRole,
                                            KVCacheGroupSpec as VGroup)
    import torch

    fa = VFull(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
    groups = [VGroup(["source"], fa, role=KVCacheGroupRole.HISPARSE_SOURCE, host_resident=True),
              VGroup(["indexer"], fa, role=KVCacheGroupRole.HISPARSE_INDEXER),
              VGroup(["resident"], VResident(block_size=BS, page_size=4 * BS)),
              VGroup(["hot"], VHot(block_size=BS, page_size=4 * BS, blocks_per_request=2), enable_kv_transfer=False)]
    mgr = KVCacheManager(KVCacheConfig(num_blocks=num_blocks, hisparse_host_num_blocks=host_blocks,
                                       kv_cache_tensors=[], kv_cache_groups=groups),
                         max_model_len=64, enable_caching=caching, hash_block_size=BS, scheduler_block_size=BS)
    return mgr, get_hisparse_coordinator(mgr)


def test_pool_config_checks_the_hisparse_fields():
    with pytest.raises(InvalidFieldError, match="hisparse_host_num_blocks"):
        PoolConfig(num_blocks=20, groups=_groups(), max_model_len=64, scheduler_block_size=BS, hash_block_size=BS,
                   group_roles=ROLES)
    with pytest.raises(InvalidFieldError, match="group_roles"):
        PoolConfig(num_blocks=20, groups=_groups(), max_model_len=64, scheduler_block_size=BS, hash_block_size=BS,
                   group_roles=ROLES[:3], hisparse_host_num_blocks=8)
    with pytest.raises(InvalidFieldError, match=r"group_roles\[1\]"):
        PoolConfig(num_blocks=20, groups=_groups(), max_model_len=64, scheduler_block_size=BS, hash_block_size=BS,
                   group_roles=("hisparse_source", "host", "default", "default"), hisparse_host_num_blocks=8)


STEPS = st.lists(st.tuples(st.integers(0, 2), st.integers(1, 24), st.booleans()), min_size=4, max_size=24)


@pytest.mark.vllm
@settings(max_examples=profile_examples(20, 80), deadline=None)
@given(st.integers(12, 40), st.integers(6, 40), st.booleans(), st.lists(st.integers(8, 48), min_size=3, max_size=3),
       STEPS)
def test_the_reference_kv_cache_manager_builds_hisparse_pools_like_vllm(num_blocks, host_blocks, caching, lengths,
                                                                         steps):
    require_vllm()
    from kvref.impl.vllm.loader import load_vllm

    load_vllm()  # NONE_HASH
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import RequestStatus as VStatus

    from kvref.impl.reference.kv_cache_manager import KVCacheManager
    from kvref.impl.vllm.vrequest import vllm_request_from

    ref = KVCacheManager(_pool_config(num_blocks, host_blocks, caching))
    ref_coord = ref.coordinator.hisparse_coordinator
    vm, v_coord = _vllm_manager(num_blocks, host_blocks, caching)
    hasher = get_request_block_hasher(BS, sha256)
    live: dict[str, tuple[Request, object]] = {}
    for n, (idx, chunk, finish) in enumerate(steps):
        rid = f"r{idx}"
        prompt = [t if idx < 2 or t < lengths[idx] // 2 else 1000 + t for t in range(lengths[idx])]
        if rid not in live:
            req = Request(rid, prompt, max_tokens=1)
            vreq = vllm_request_from(req, carry=frozenset(), block_hasher=hasher)
            hits, num_hit, _ = ref.get_computed_blocks(req)
            vhits, vnum_hit, _ = vm.get_computed_blocks(vreq)
            assert (num_hit, hits.get_block_ids()) == (vnum_hit, vhits.get_block_ids()), f"step {n}: hit"
        else:
            (req, vreq), hits, vhits, num_hit, vnum_hit = live[rid], None, None, 0, 0
        num_new = min(chunk, len(prompt) - req.num_computed_tokens - num_hit)
        if num_new <= 0:
            continue
        got = ref.allocate_slots(req, num_new, num_hit, hits)
        vgot = vm.allocate_slots(vreq, num_new, vnum_hit, vhits)
        assert (got is None) == (vgot is None), f"step {n}: admission"
        if got is None:
            continue
        assert got.get_block_ids() == vgot.get_block_ids(), f"step {n}: new blocks"
        live[rid] = (req, vreq)
        done = req.num_computed_tokens + num_hit + num_new
        ref_coord.advance_scheduled([(rid, done)])
        v_coord.advance_scheduled([(rid, done)])
        transfers = [(t.transfer_id, t.host_block_id, tuple(t.resident_block_ids))
                     for t in ref_coord.build_offload_command().page_transfers]
        assert transfers == [(t.transfer_id, t.host_block_id, tuple(t.resident_block_ids))
                             for t in v_coord.build_offload_command().page_transfers], f"step {n}: transfers"
        counts = {t[0]: 1 for t in transfers}
        ref_coord.update_spills(counts, counts)
        v_coord.update_spills(counts, counts)
        req.num_computed_tokens = vreq.num_computed_tokens = done
        if finish or done == len(prompt):
            req.status, vreq.status = RequestStatus.FINISHED, VStatus.FINISHED_STOPPED
            ref.free(req)
            vm.free(vreq)
            del live[rid]
        ref.check_invariants()
        assert (ref.block_pool.get_num_free_blocks(), ref_coord.host_manager.block_pool.get_num_free_blocks()) == \
            (vm.block_pool.get_num_free_blocks(), v_coord.host_manager.block_pool.get_num_free_blocks()), \
            f"step {n}: free blocks"
