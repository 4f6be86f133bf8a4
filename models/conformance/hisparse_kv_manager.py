"""A HiSparse pool behind the whole ``KVCacheManager``: vLLM 0.33.0's vs the reference's (#22/#23).

The HiSparse programs (models/machines/hisparse_pool.py) call the managers one by one; here
requests on shared prompts go through ``get_computed_blocks`` -> ``allocate_slots`` -> the
coordinator's write-back planning -> the offload command -> the workers' reports -> ``free``. With
prefix caching the host source keeps a longer hit than the GPU groups, and ``allocate_slots``
trims it to the tokens the request reuses (vLLM's ``retained_hit_group_ids``). After every step the
hit, the new block ids of every group, the page transfers and the whole pool state (tables,
both pools' free queues, the coordinator's records) must agree. Run inside ``conform-kv-manager``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st

from kvref.impl.hisparse_calls import HiSparseWholeManagerCalls
from kvref.impl.interface import PoolConfig
from kvref.impl.reference.hisparse_pool import HiSparsePool
from kvref.impl.reference.kv_cache_manager import KVCacheManager
from kvref.impl.request import Request, RequestStatus
from kvref.spec.hisparse import HiSparsePoolConfig
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

from kvref.models.machines.hisparse_pool import prompt_of


def _pool_config(config: HiSparsePoolConfig) -> PoolConfig:
    fa = FullAttentionSpec(block_size=config.block_size, num_kv_heads=1, head_size=1, dtype="float32")
    groups = [KVCacheGroupSpec(("source",), fa), KVCacheGroupSpec(("indexer",), fa)]
    for i in range(config.num_resident_groups):
        groups += [KVCacheGroupSpec((f"resident_{i}",), config.resident_spec()),
                   KVCacheGroupSpec((f"hot_{i}",), config.hot_spec())]
    roles = ("hisparse_source", "hisparse_indexer") + ("default", "default") * config.num_resident_groups
    return PoolConfig.off_plan("a HiSparse pool as vLLM's tests build it, field by field",
                               num_blocks=config.num_gpu_blocks, groups=tuple(groups),
                               max_model_len=config.max_model_len, scheduler_block_size=config.block_size,
                               hash_block_size=config.block_size, enable_caching=config.enable_caching,
                               max_in_flight_tokens=config.max_in_flight_tokens, group_roles=roles,
                               hisparse_host_num_blocks=config.host_num_blocks)


class ReferenceHiSparseKVCacheManager(HiSparseWholeManagerCalls, HiSparsePool):
    """The reference ``KVCacheManager`` over the same pool, answering the calls of
    :class:`kvref.impl.vllm.hisparse_kv_manager.VllmHiSparseKVCacheManager` (and, through the
    coordinator it builds, those of :class:`HiSparsePool`: the offload command, reports, state)."""

    def __init__(self, config: HiSparsePoolConfig) -> None:
        self.config = config
        self._mgr = KVCacheManager(_pool_config(config))
        self.coordinator = self._mgr.coordinator.hisparse_coordinator
        self.managers = tuple(self._mgr.coordinator.single_type_managers)
        self.gpu_pool = self._mgr.block_pool
        self.host_pool = self.managers[0].block_pool
        self.resident_managers = self.coordinator.resident_managers
        self.hot_managers = self.coordinator.hot_managers
        self.requests: dict[str, Request] = {}
        self._whole_hits: dict[str, Any] = {}

    def _status(self, name: str) -> RequestStatus:
        return RequestStatus[name]

    def check_invariants(self) -> None:
        self._mgr.check_invariants()


#: (request index, chunk, finish after the step, complete the step's transfers)
STEPS = st.lists(st.tuples(st.integers(0, 2), st.integers(1, 24), st.booleans(), st.booleans()),
                 min_size=4, max_size=24)


@st.composite
def whole_manager_configs(draw) -> HiSparsePoolConfig:
    bs = draw(st.sampled_from((2, 4)))
    max_model_len = draw(st.sampled_from((32, 48)))
    return HiSparsePoolConfig(block_size=bs, num_gpu_blocks=draw(st.integers(12, 48)),
                              host_num_blocks=draw(st.integers(8, 48)), blocks_per_request=draw(st.integers(1, 2)),
                              num_resident_groups=draw(st.sampled_from((1, 1, 2))), max_model_len=max_model_len,
                              max_in_flight_tokens=max_model_len, enable_caching=draw(st.sampled_from((True, True, False))))


def run_whole_manager_program(config: HiSparsePoolConfig, lengths: list[int], steps: list[tuple],
                              make_vllm: Callable[[HiSparsePoolConfig], Any]) -> Counter:
    """Run ``steps`` on both managers; AssertionError at the first difference. Returns the paths taken."""
    ref, vll = ReferenceHiSparseKVCacheManager(config), make_vllm(config)
    seen: Counter = Counter()
    computed: dict[str, int] = {}
    for n, (idx, chunk, finish, complete) in enumerate(steps):
        rid = f"r{idx}"
        length = min(lengths[idx], config.max_model_len)
        where = f"step {n} ({rid}, chunk {chunk})"
        num_hit = 0
        if rid not in computed:
            prompt = prompt_of(idx, length)
            hit, theirs = ref.manager_hit(rid, prompt), vll.manager_hit(rid, prompt)
            assert hit == theirs, f"{where}: hit kvref {hit} != vLLM {theirs}"
            num_hit = hit[0]
            # the host source's hit is longer than the indexer's (it keeps pages the GPU lost):
            # allocate_slots then trims it to the reused prefix
            seen["longer_source_hit"] += len(hit[1][0]) > len(hit[1][1])
            seen["hit"] += bool(num_hit)
        done = computed.get(rid, 0) + num_hit
        num_new = min(chunk, length - done)
        if num_new <= 0:
            continue
        got = ref.manager_allocate(rid, num_new)
        theirs = vll.manager_allocate(rid, num_new)
        assert got == theirs, f"{where}: new blocks per group kvref {got} != vLLM {theirs}"
        if got is None:
            seen["refused"] += 1
            if rid not in computed:  # a refused admission leaves nothing behind
                ref.manager_free(rid)
                vll.manager_free(rid)
            continue
        seen["allocated"] += 1
        done += num_new
        computed[rid] = done
        ref.manager_computed(rid, done)
        vll.manager_computed(rid, done)
        ref.advance_scheduled([(rid, done)])
        vll.advance_scheduled([(rid, done)])
        transfers = ref.build_offload_command()
        assert transfers == vll.build_offload_command(), f"{where}: page transfers"
        if complete and transfers:
            counts = {t[0]: 1 for t in transfers}
            ref.update_spills(counts, counts)
            vll.update_spills(counts, counts)
            seen["transfers_done"] += len(counts)
        if finish or done == length:
            ref.manager_free(rid)
            vll.manager_free(rid)
            computed.pop(rid)
            seen["freed"] += 1
        ref.check_invariants()
        state = ref.observe()
        assert state == vll.observe(), f"{where}: state kvref {state} != vLLM {vll.observe()}"
    return seen
