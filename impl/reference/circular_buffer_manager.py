"""One ring block per request (vLLM ``CircularBufferManager``, a full-attention subclass).

The ring holds the raw keys of the token group still being compressed; ``block_size`` is its
capacity, so a request claims exactly one block on its first allocation (or its first external
load) and keeps it until it is freed, whatever its length. Nothing is skipped, hit or cached:
the spec is not prefix-cacheable, the hybrid coordinator leaves the group out of hit lookups, and
its hit is always empty.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from kvref.impl.request import Request
from kvref.spec.kv_cache_interface import KVCacheSpec

from .block_hash import BlockHash
from .block_pool import BlockPool
from .full_attention_manager import FullAttentionManager
from .kv_cache_block import KVCacheBlock


class CircularBufferManager(FullAttentionManager):
    supports_fine_grained_hash_lookup: ClassVar[bool] = False

    def _claim_ring_block(self, request_id: str, record_for_zeroing: bool = True) -> list[KVCacheBlock]:
        table = self.req_to_blocks.setdefault(request_id, [])
        if table:
            return []
        new_blocks = self.block_pool.get_new_blocks(1)
        table.extend(new_blocks)
        if self._record_new_block_ids and record_for_zeroing:  # never: the ring is not zeroed
            self.new_block_ids.extend(b.block_id for b in new_blocks)
        return new_blocks

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock],
                                   total_computed_tokens: int, num_local_computed_tokens: int,
                                   num_tokens_main_model: int, apply_admission_cap: bool = False,
                                   prefill_end: int = 0) -> int:
        return 0 if self.req_to_blocks.get(request_id) else 1

    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            num_tokens_main_model: int) -> list[KVCacheBlock]:
        return self._claim_ring_block(request_id)

    def allocate_external_computed_blocks(self, request_id: str, num_local_computed_tokens: int,
                                          num_external_computed_tokens: int,
                                          record_for_zeroing: bool = True) -> None:
        self._claim_ring_block(request_id, record_for_zeroing)

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[BlockHash], max_length: int,
                               kv_cache_group_ids: Sequence[int], block_pool: BlockPool,
                               kv_cache_spec: KVCacheSpec, drop_eagle_block: bool,
                               alignment_tokens: int, dcp_world_size: int = 1,
                               pcp_world_size: int = 1) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        return tuple([] for _ in kv_cache_group_ids), 0

    def cache_blocks(self, request: Request, block_hashes: Sequence[BlockHash], num_tokens: int,
                     retention_interval: int | None = None, replay_boundaries: Sequence[int] = ()) -> None:
        return None

    def add_local_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock],
                                  num_local_computed_tokens: int, num_external_computed_tokens: int) -> None:
        """NOTE: as in vLLM 0.33.0 the request is not marked running here (no ``num_cached_block``
        entry): a ring group has no hits to add."""
        return None

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        return None

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return 0

    def check_invariants(self) -> None:
        super().check_invariants()
        for rid, table in self.req_to_blocks.items():
            assert len(table) <= 1, f"M12: request {rid} holds {len(table)} ring blocks (at most one)"
            assert all(b.block_hash is None for b in table), f"M12: ring block of {rid} is cached"
