"""HiSparse GPU-resident pages (vLLM ``HiSparseResidentManager``, ``v1/core/single_type_kv_cache_manager.py``).

One table entry per page of the request. A page the request hit on the host (a host prefix) or
imported from a KV connector starts as a null placeholder, read from host; pages the request writes
get GPU blocks. The table stays append-only: which GPU block a page is read from changes through
``residency_changes`` (``adopt_resident_page`` points a host page at a pinned GPU copy,
``drop_resident_page`` stops reading one), which the HiSparse coordinator ships to the worker
separately. Never prefix-cached: the host source owns the prefix cache.

Counts: :func:`kvref.spec.hisparse.resident_blocks_to_allocate`; the admission cap
(``max_admission_blocks_per_request``) is :func:`kvref.spec.hisparse.resident_max_admission_blocks`.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvref.spec.hisparse import HiSparseResidentSpec, resident_blocks_to_allocate
from kvref.spec.mathutil import cdiv

from .kv_cache_block import KVCacheBlock
from .hisparse_gpu_group import HiSparseGpuGroup
from .single_type_manager import null_head_len


class HiSparseResidentManager(HiSparseGpuGroup):
    #: the HiSparse coordinator (:class:`~.hisparse_coordinator.HiSparseCoordinator`), set when it binds
    coordinator = None

    def __init__(self, kv_cache_spec: HiSparseResidentSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        assert self.max_admission_blocks_per_request is not None, \
            "HiSparse resident groups always carry an admission cap"
        #: request -> page index -> the block the page is now read from (null: host only)
        self.residency_changes: dict[str, dict[int, KVCacheBlock]] = {}

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock],
                                   total_computed_tokens: int, num_local_computed_tokens: int,
                                   num_tokens_main_model: int, apply_admission_cap: bool = False,
                                   prefill_end: int = 0) -> int:
        assert not new_computed_blocks, "a HiSparse resident group never hits"
        tail_resident = True
        if total_computed_tokens > num_local_computed_tokens:
            tail_page = cdiv(total_computed_tokens, self.block_size) - 1
            tail_resident = self.get_resident_page(request_id, tail_page) is not None
        return resident_blocks_to_allocate(
            self.block_size, num_tokens, total_computed_tokens, num_local_computed_tokens,
            len(self.req_to_blocks.get(request_id, ())), tail_resident, apply_admission_cap,
            self.max_admission_blocks_per_request)

    def add_local_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock],
                                  num_local_computed_tokens: int, num_external_computed_tokens: int) -> None:
        """A host prefix hit: one null placeholder per hit page (read from host)."""
        assert not new_computed_blocks, "a HiSparse resident group never hits"
        table = self.req_to_blocks.setdefault(request_id, [])
        assert not table, f"request {request_id} already has resident pages"
        num_host_pages = cdiv(num_local_computed_tokens, self.block_size)
        table.extend([self._null_block] * num_host_pages)
        self.num_cached_block[request_id] = 0
        self.coordinator.commit_computed_blocks(request_id, num_host_pages)

    def allocate_external_computed_blocks(self, request_id: str, num_local_computed_tokens: int,
                                          num_external_computed_tokens: int,
                                          record_for_zeroing: bool = True) -> None:
        """Reserve a writable last imported page; the earlier imported pages stay on host."""
        assert num_external_computed_tokens > 0
        num_tokens = num_local_computed_tokens + num_external_computed_tokens
        table = self.req_to_blocks.setdefault(request_id, [])
        tail_page = (num_tokens - 1) // self.block_size
        if len(table) <= tail_page:
            table.extend([self._null_block] * (tail_page + 1 - len(table)))
        if self.get_resident_page(request_id, tail_page) is None:
            table[tail_page] = self.block_pool.get_new_blocks(1)[0]

    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            num_tokens_main_model: int) -> list[KVCacheBlock]:
        return self._grow_table(request_id, cdiv(num_tokens, self.block_size))

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """The residency row (changes applied) without its null head: the blocks the request reads
        are the ones it frees, not the ones its append-only table first held. The coordinator
        detaches the request first (its clean pages are released, still readable copies)."""
        self.coordinator.free(request_id)
        row = self.get_residency_row(request_id)
        self.residency_changes.pop(request_id, None)
        super().pop_blocks_for_free(request_id)
        head = null_head_len(row)
        return row[head:] if head else row

    # ------------------------------------------------------------------ residency

    def adopt_resident_page(self, request_id: str, block_idx: int, block: KVCacheBlock) -> bool:
        """Read a host-only page from ``block`` (a pinned GPU copy); False if the page is not in
        the table or already resident."""
        table = self.req_to_blocks.get(request_id)
        if table is None or block_idx >= len(table):
            return False
        if self.get_resident_page(request_id, block_idx) is not None:
            return False
        self.residency_changes.setdefault(request_id, {})[block_idx] = block
        return True

    def drop_resident_page(self, request_id: str, block_idx: int) -> KVCacheBlock | None:
        """Stop reading a page from the GPU; return the block it was read from (None if host-only)."""
        block = self.get_resident_page(request_id, block_idx)
        if block is not None:
            self.residency_changes.setdefault(request_id, {})[block_idx] = self._null_block
        return block

    def get_resident_page(self, request_id: str, block_idx: int) -> KVCacheBlock | None:
        table = self.req_to_blocks.get(request_id)
        if table is None or block_idx >= len(table):
            return None
        block = self.residency_changes.get(request_id, {}).get(block_idx, table[block_idx])
        return None if block.is_null else block

    def get_residency_row(self, request_id: str, start: int = 0) -> list[KVCacheBlock]:
        """The request's table from ``start`` with residency changes applied (host-only pages are
        the null block)."""
        table = self.req_to_blocks.get(request_id, [])[start:]
        changes = self.residency_changes.get(request_id)
        if not changes:
            return table
        return [changes.get(i, b) for i, b in enumerate(table, start)]

    def check_invariants(self) -> None:
        """I1 (table blocks belong to this group's pool) and M15: residency changes name pages
        inside their request's table. Not the base's I9: in vLLM a page the HiSparse coordinator
        unpinned stays in the append-only table with ref_cnt 0 (its residency row reads null)."""
        for rid, table in self.req_to_blocks.items():
            for block in table:
                assert self.block_pool.blocks[block.block_id] is block, \
                    f"I1: request {rid} holds block {block.block_id} of another pool"
        for rid, changes in self.residency_changes.items():
            assert rid in self.req_to_blocks, f"M15: residency changes for unknown request {rid}"
            n = len(self.req_to_blocks[rid])
            assert all(0 <= i < n for i in changes), \
                f"M15: request {rid}'s residency changes {sorted(changes)} fall outside its {n} pages"
