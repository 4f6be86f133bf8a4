"""A HiSparse pool in the reference: the host source, indexer, resident and hot managers over one
GPU pool and a private host pool, with the HiSparse coordinator's admission-side rules (issue #23).

The group layout is :class:`kvref.spec.hisparse.HiSparsePoolConfig`'s. The operations are those
vLLM's ``KVCacheManager`` / ``KVCacheCoordinator`` run on the managers (admission counts, hit and
import set-up, allocation, free) and the ``HiSparseCoordinator.update_residency`` transition rule
(:func:`kvref.spec.hisparse.needs_hot_transition`). Not modelled (docs/coverage.md): host write-back
(spills and their worker completions), hence publication of durable host pages, unpinning of clean
resident pages and GPU copies adopted by later hits — they start from worker completion reports.
"""

from __future__ import annotations

from typing import Any

from kvref.impl.hisparse_calls import HiSparseManagerCalls
from kvref.spec.errors import InvalidFieldError
from kvref.spec.hisparse import HiSparsePoolConfig, needs_hot_transition, transition_watermark
from kvref.spec.kv_cache_interface import FullAttentionSpec

from .block_pool import BlockPool
from .full_attention_manager import FullAttentionManager
from .hisparse_hot_manager import HiSparseHotManager
from .hisparse_resident_manager import HiSparseResidentManager
from .hisparse_source_manager import HiSparseSourceManager
from .single_type_manager import SingleTypeKVCacheManager


class HiSparsePool(HiSparseManagerCalls):
    kind = "reference"

    def __init__(self, config: HiSparsePoolConfig) -> None:
        if not isinstance(config, HiSparsePoolConfig):
            raise InvalidFieldError("config", config, "a kvref.spec.hisparse.HiSparsePoolConfig")
        self.config = config
        bs = config.block_size
        self.gpu_pool = BlockPool(config.num_gpu_blocks, enable_caching=False, hash_block_size=bs)
        fa = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype="float32")
        common = dict(block_pool=self.gpu_pool, enable_caching=False, scheduler_block_size=bs)
        source = HiSparseSourceManager(fa, kv_cache_group_id=0, **common)
        source.bind_host_pool(config.host_num_blocks, config.num_gpu_blocks)
        managers: list[SingleTypeKVCacheManager] = [source, FullAttentionManager(fa, kv_cache_group_id=1, **common)]
        resident_spec, hot_spec = config.resident_spec(), config.hot_spec()
        cap = resident_spec.max_admission_blocks_per_request(config.max_in_flight_tokens, config.max_model_len)
        for kind in config.group_kinds[2:]:
            gid = len(managers)
            if kind == "resident":
                managers.append(HiSparseResidentManager(resident_spec, kv_cache_group_id=gid,
                                                        max_admission_blocks_per_request=cap, **common))
            else:
                managers.append(HiSparseHotManager(hot_spec, kv_cache_group_id=gid, has_resident_groups=True,
                                                   **common))
        self.managers = tuple(managers)
        self.host_pool = source.block_pool
        self.resident_managers = tuple(m for m in managers if isinstance(m, HiSparseResidentManager))
        self.hot_managers = tuple(m for m in managers if isinstance(m, HiSparseHotManager))
        self.transition_watermark = transition_watermark([m.blocks_per_request for m in self.hot_managers],
                                                         config.num_gpu_blocks)

    def require_hot(self, request_id: str) -> None:
        for m in self.hot_managers:
            m.require_hot(request_id)

    def _fills_admission_window(self, request_id: str) -> bool:
        return any(len(m.req_to_blocks.get(request_id, ())) >= m.max_admission_blocks_per_request
                   for m in self.resident_managers)

    def update_residency(self, request_id: str) -> None:
        """A request that cannot read from host yet (no complete hot region) is asked for one when
        the GPU pool runs below the watermark or it fills its admission window. (Requests that can
        read from host would release their clean pages: none are clean without write-back.)"""
        can_read_from_host = bool(self.hot_managers) and all(m.has_hot(request_id) for m in self.hot_managers)
        if not can_read_from_host and needs_hot_transition(self.gpu_pool.get_num_free_blocks(),
                                                           self.transition_watermark,
                                                           self._fills_admission_window(request_id)):
            self.require_hot(request_id)

    def adopt(self, request_id: str, page: int, donor_id: str, donor_page: int) -> list[bool]:
        """Point a host-only page of each resident group at the donor's GPU block of that group and
        pin it (vLLM ``HiSparseCoordinator._adopt_copies`` does it for GPU copies of host pages)."""
        out = []
        for m in self.resident_managers:
            block = m.get_resident_page(donor_id, donor_page)
            ok = block is not None and m.adopt_resident_page(request_id, page, block)
            if ok:
                m.block_pool._touch([block])
            out.append(ok)
        return out

    def drop(self, request_id: str, page: int) -> list[int | None]:
        """Stop reading an adopted page from the GPU and release its pin."""
        out = []
        for m in self.resident_managers:
            block = m.drop_resident_page(request_id, page)
            if block is not None:
                m.block_pool._free_blocks([block])
            out.append(None if block is None else block.block_id)
        return out

    def free(self, request_id: str) -> None:
        for m in self.managers:
            m.free(request_id)

    def observe(self) -> dict[str, Any]:
        tables = []
        for m in self.managers:
            tables.append({rid: [b.block_id for b in (m.get_residency_row(rid)
                                                      if isinstance(m, HiSparseResidentManager) else blocks)]
                           for rid, blocks in m.req_to_blocks.items()})
        return dict(
            tables=tables,
            gpu_free=self.gpu_pool.get_num_free_blocks(),
            host_free=self.host_pool.get_num_free_blocks(),
            gpu_free_queue=list(self.gpu_pool.free_block_ids()),
            host_free_queue=list(self.host_pool.free_block_ids()),
            hot_required=[sorted(m.hot_required) for m in self.hot_managers],
            has_hot=[sorted(rid for rid in m.req_to_blocks if m.has_hot(rid)) for m in self.hot_managers],
        )

    def check_invariants(self) -> None:
        """Each pool's own rules, each manager's, and M16: every block's reference count equals the
        tables reading it (resident groups: their residency rows; no unpinning is modelled, so
        read means referenced)."""
        self.gpu_pool.check_invariants()
        self.host_pool.check_invariants()
        for m in self.managers:
            m.check_invariants()
        for pool, managers in ((self.gpu_pool, self.managers[1:]), (self.host_pool, self.managers[:1])):
            held: dict[int, int] = {}
            for m in managers:
                rows = ([m.get_residency_row(rid) for rid in m.req_to_blocks]
                        if isinstance(m, HiSparseResidentManager) else m.req_to_blocks.values())
                for table in rows:
                    for b in table:
                        if not b.is_null:
                            held[b.block_id] = held.get(b.block_id, 0) + 1
            for b in pool.blocks:
                if not b.is_null:
                    assert b.ref_cnt == held.get(b.block_id, 0), \
                        f"M16: block {b.block_id} has ref_cnt {b.ref_cnt} but {held.get(b.block_id, 0)} tables hold it"
