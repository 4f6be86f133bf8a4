"""Full attention: every block is read until the request finishes (vLLM ``FullAttentionManager``).

Hits are a left-to-right run of cached blocks: chained hashes make the first miss final. In a
hybrid model whose hash granularity is finer than this group's block, the prompt's last hash
boundary inside a block is also published as a *partial* entry (vLLM ``BlockPool.cache_full_blocks``).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice
from typing import ClassVar

from kvref.impl.request import Request
from kvref.spec.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheSpec
from kvref.spec.mathutil import cdiv

from .block_hash import BlockHash, BlockHashListWithBlockSize
from .block_pool import BlockPool, BlockPoolCore, group_suffix
from .kv_cache_block import KVCacheBlock
from .single_type_manager import SingleTypeKVCacheManager


class FullAttentionManager(SingleTypeKVCacheManager):
    supports_fine_grained_hash_lookup: ClassVar[bool] = True

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[BlockHash], max_length: int,
                               kv_cache_group_ids: Sequence[int], block_pool: BlockPool,
                               kv_cache_spec: KVCacheSpec, drop_eagle_block: bool,
                               alignment_tokens: int, dcp_world_size: int = 1,
                               pcp_world_size: int = 1) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Phase 1: cached full blocks from the start until the first miss. Phase 2 (only when
        hits may land on hash boundaries inside a block): the longest cached interior boundary
        of the next block. EAGLE drops one unit; the result is rounded down to the alignment.
        Under DCP the hashes are viewed at the sharded block (``block_size × dcp``); PCP scales
        nothing (spec/context_parallel.py)."""
        assert isinstance(kv_cache_spec, (FullAttentionSpec, ChunkedLocalAttentionSpec))
        block_size = kv_cache_spec.block_size * dcp_world_size
        hbs = block_pool.hash_block_size
        fine_grained = alignment_tokens < block_size and block_size % alignment_tokens == 0
        coarse = block_hashes if block_size == hbs else BlockHashListWithBlockSize(block_hashes, hbs, block_size)
        if fine_grained:
            # fine-grained alignment == hash_block_size; ``block_hashes`` are the fine hashes
            coarse = BlockHashListWithBlockSize(block_hashes, alignment_tokens, block_size)
        computed: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
        get_cached = BlockPoolCore.get_cached_block  # our own hashes: the plain lookup
        if len(kv_cache_group_ids) == 1:
            # one group: probe the index directly (same result, no per-block list)
            get_one = block_pool.cached_block_hash_to_block.get_one_block
            suffix = group_suffix(kv_cache_group_ids[0])
            blocks = computed[0]
            for block_hash in islice(coarse, max_length // block_size):
                block = get_one(block_hash + suffix)
                if block is None:
                    break
                blocks.append(block)
        else:
            for block_hash in islice(coarse, max_length // block_size):
                hit = get_cached(block_pool, block_hash, kv_cache_group_ids)
                if not hit:
                    break
                for blocks, block in zip(computed, hit):
                    blocks.append(block)
        hit_length = len(computed[0]) * block_size
        if fine_grained:
            scale = block_size // alignment_tokens
            first = len(computed[0]) * scale
            last = min(first + scale - 1, max_length // alignment_tokens, len(block_hashes))
            for fine_idx in range(last - 1, first - 1, -1):
                hit = get_cached(block_pool, block_hashes[fine_idx], kv_cache_group_ids)
                if not hit:
                    continue
                for blocks, block in zip(computed, hit):
                    blocks.append(block)
                hit_length = (fine_idx + 1) * alignment_tokens
                break
        if drop_eagle_block and hit_length > 0:
            hit_length -= min(alignment_tokens, block_size)
        hit_length -= hit_length % alignment_tokens
        num_blocks = cdiv(hit_length, block_size)
        for blocks in computed:
            del blocks[num_blocks:]
        return computed, hit_length

    def cache_blocks(self, request: Request, block_hashes: Sequence[BlockHash], num_tokens: int,
                     retention_interval: int | None = None, replay_boundaries: Sequence[int] = ()) -> None:
        super().cache_blocks(request, block_hashes, num_tokens, retention_interval, replay_boundaries)
        if self.block_size != self.block_pool.hash_block_size:
            self._cache_partial_tail_block(request, block_hashes, num_tokens)

    def _cache_partial_tail_block(self, request: Request, block_hashes: Sequence[BlockHash],
                                  num_tokens: int) -> None:
        """Publish the prompt's last hash boundary when it ends inside a block, so a later
        request resending this prompt (hit ≤ prompt − 1; EAGLE reads the whole prompt) can land
        there with fine-grained hits."""
        hbs = self.block_pool.hash_block_size
        token_limit = request.num_prompt_tokens if self.use_eagle else request.num_prompt_tokens - 1
        boundary = min(token_limit // hbs, len(block_hashes)) * hbs
        if boundary == 0 or boundary > num_tokens or boundary % self.block_size == 0:
            return
        table = self.req_to_blocks.get(request.request_id, [])
        block_idx = boundary // self.block_size
        if block_idx >= len(table):
            return
        self.block_pool.cache_partial_block(block_hashes, table[block_idx], boundary,
                                            self.kv_cache_group_id, self.block_size, request=request)
