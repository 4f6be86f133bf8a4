"""What HiSparse's two GPU-side groups share (vLLM ``HiSparseResidentManager`` and
``HiSparseHotManager``, ``v1/core/single_type_kv_cache_manager.py``).

Neither group is prefix-cached and neither hits: the host source group owns the prefix cache, so
publishing is a no-op and a lookup finds nothing. Both grow a request's table with plain new
blocks (no copy-on-write, no new-block-id record: HiSparse pools never zero). One base keeps the
two managers from restating it (#26: the duplicates tool's D2).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvref.spec.kv_cache_interface import KVCacheSpec

from .block_hash import BlockHash
from .block_pool import BlockPool
from .kv_cache_block import KVCacheBlock
from .single_type_manager import SingleTypeKVCacheManager
from kvref.impl.request import Request


class HiSparseGpuGroup(SingleTypeKVCacheManager):
    """A HiSparse group in the GPU pool that the host source group's prefix cache stands for."""

    def _grow_table(self, request_id: str, num_blocks: int) -> list[KVCacheBlock]:
        """Extend the request's table to ``num_blocks`` entries with new blocks; the new ones."""
        table = self.req_to_blocks.setdefault(request_id, [])
        num_new = num_blocks - len(table)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        table.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, block_hashes: Sequence[BlockHash], num_tokens: int,
                     retention_interval: int | None = None, replay_boundaries: Sequence[int] = ()) -> None:
        """Never published: the host source owns prefix caching."""

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[BlockHash], max_length: int,
                               kv_cache_group_ids: Sequence[int], block_pool: BlockPool,
                               kv_cache_spec: KVCacheSpec, drop_eagle_block: bool,
                               alignment_tokens: int) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        return tuple([] for _ in kv_cache_group_ids), 0
