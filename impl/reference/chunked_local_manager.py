"""Chunked local attention (vLLM ``ChunkedLocalAttentionManager``).

A token reads only its own ``attention_chunk_size`` chunk, so all tokens before the current
chunk's start are skipped: ``floor(n / chunk) * chunk`` (13 -> 8, 8 -> 8, 7 -> 0 for chunk 8).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvref.spec.kv_cache_interface import ChunkedLocalAttentionSpec, KVCacheSpec

from .block_hash import BlockHash, resolve_block_hashes
from .block_pool import BlockPool, BlockPoolCore
from .kv_cache_block import KVCacheBlock
from .single_type_manager import SingleTypeKVCacheManager


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    def __init__(self, kv_cache_spec: ChunkedLocalAttentionSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.attention_chunk_size = kv_cache_spec.attention_chunk_size

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens // self.attention_chunk_size * self.attention_chunk_size

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[BlockHash], max_length: int,
                               kv_cache_group_ids: Sequence[int], block_pool: BlockPool,
                               kv_cache_spec: KVCacheSpec, drop_eagle_block: bool,
                               alignment_tokens: int) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Blocks before the last chunk start (of ``max_length``) count as hit (null, never read);
        then cached blocks left to right until a miss. The hit may be all nulls."""
        assert isinstance(kv_cache_spec, ChunkedLocalAttentionSpec)
        # vLLM asserts both; kvref rejects such configurations when the manager is built.
        assert not drop_eagle_block and kv_cache_spec.block_size == alignment_tokens
        block_size = kv_cache_spec.block_size
        chunk = kv_cache_spec.attention_chunk_size
        hashes = resolve_block_hashes(block_hashes, block_pool.hash_block_size, block_size)
        max_num_blocks = max_length // block_size
        window_start_block = (max_length // chunk * chunk if max_length > 0 else 0) // block_size
        null = block_pool.null_block
        computed = tuple([null] * window_start_block for _ in kv_cache_group_ids)
        get_cached = BlockPoolCore.get_cached_block  # our own hashes: the plain lookup
        for i in range(window_start_block, max_num_blocks):
            hit = get_cached(block_pool, hashes[i], kv_cache_group_ids)
            if not hit:
                break
            for blocks, block in zip(computed, hit):
                blocks.append(block)
        return computed, len(computed[0]) * block_size
