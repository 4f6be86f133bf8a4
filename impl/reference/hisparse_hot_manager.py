"""HiSparse hot region (vLLM ``HiSparseHotManager``, ``v1/core/single_type_kv_cache_manager.py``).

A request that reads host-backed history needs a fixed GPU region of ``blocks_per_request``
blocks. It is allocated whole, once the request is marked ``hot_required`` (a host prefix hit, an
external import, or the HiSparse coordinator asking a request to transition because the shared
pool runs low), and freed with the request. The group is never prefix-cached and never hits: the
host source group owns the prefix cache.

Admission quirk kept from vLLM 0.33.0: the count (:func:`kvref.spec.hisparse.hot_needs_region`)
asks about the request *before* ``add_local_computed_blocks`` marks it, while the allocation runs
after; see docs/differences.md for the pool without resident groups, where vLLM cannot admit.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvref.spec.hisparse import HiSparseHotSpec, hot_blocks_to_allocate, hot_needs_region

from .kv_cache_block import KVCacheBlock
from .hisparse_gpu_group import HiSparseGpuGroup


class HiSparseHotManager(HiSparseGpuGroup):
    """Hot regions of one HiSparse hot group.

    ``has_resident_groups``: whether the pool has HiSparse resident groups (vLLM reads it off its
    HiSparse coordinator); without them every admitted request reads from host at once.
    """

    def __init__(self, kv_cache_spec: HiSparseHotSpec, *, has_resident_groups: bool = True, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.blocks_per_request = kv_cache_spec.blocks_per_request
        self.has_resident_groups = has_resident_groups
        #: requests whose next allocation takes the hot region
        self.hot_required: set[str] = set()

    def require_hot(self, request_id: str) -> None:
        self.hot_required.add(request_id)

    def has_hot(self, request_id: str) -> bool:
        return len(self.req_to_blocks.get(request_id, ())) == self.blocks_per_request

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock],
                                   total_computed_tokens: int, num_local_computed_tokens: int,
                                   num_tokens_main_model: int, apply_admission_cap: bool = False,
                                   prefill_end: int = 0) -> int:
        assert not new_computed_blocks, "a HiSparse hot group never hits"
        if hot_needs_region(total_computed_tokens, num_local_computed_tokens,
                            request_id in self.num_cached_block, request_id in self.hot_required):
            return self.get_num_required_blocks(request_id)
        return 0

    def get_num_required_blocks(self, request_id: str) -> int:
        return hot_blocks_to_allocate(self.blocks_per_request, len(self.req_to_blocks.get(request_id, ())))

    def add_local_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock],
                                  num_local_computed_tokens: int, num_external_computed_tokens: int) -> None:
        assert not new_computed_blocks, "a HiSparse hot group never hits"
        # no table yet (vLLM's HiSparseHotManager makes one only with the region, in
        # allocate_new_blocks): a new request whose hit is on the host source alone (the GPU groups
        # hit 0 tokens) comes here with an empty hit and stays cold, without a table (#22)
        self.num_cached_block[request_id] = 0
        if num_local_computed_tokens > 0 or not self.has_resident_groups:
            self.require_hot(request_id)

    def allocate_external_computed_blocks(self, request_id: str, num_local_computed_tokens: int,
                                          num_external_computed_tokens: int,
                                          record_for_zeroing: bool = True) -> None:
        """An import is read from host: the region follows in ``allocate_new_blocks``."""
        self.require_hot(request_id)

    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            num_tokens_main_model: int) -> list[KVCacheBlock]:
        # Cold admissions may skip add_local_computed_blocks: the request runs from here on.
        self.num_cached_block[request_id] = 0
        if request_id not in self.hot_required:
            return []  # a cold request has no table here until it needs its region
        return self._grow_table(request_id, self.blocks_per_request)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        self.hot_required.discard(request_id)
        return super().pop_blocks_for_free(request_id)

    def check_invariants(self) -> None:
        """M14: a hot region is empty or at most ``blocks_per_request`` blocks, all real blocks of
        this group's pool still referenced. (A running cold request has no table here, unlike the
        base's M2: vLLM creates it only with the region.)"""
        for rid, table in self.req_to_blocks.items():
            assert len(table) <= self.blocks_per_request, \
                f"M14: request {rid} holds {len(table)} hot blocks > blocks_per_request {self.blocks_per_request}"
            for block in table:
                assert not block.is_null and self.block_pool.blocks[block.block_id] is block and block.ref_cnt > 0, \
                    f"M14: request {rid}'s hot region holds block {block.block_id}: null, foreign or free"
