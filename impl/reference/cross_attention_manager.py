"""Cross-attention of encoder-decoder models (vLLM ``CrossAttentionManager``).

Encoder states are unique per request and written once, so nothing is ever cached or hit; the
table is sized by the encoder tokens (the coordinator passes ``num_encoder_tokens``).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvref.impl.request import Request
from kvref.spec.kv_cache_interface import KVCacheSpec

from .block_hash import BlockHash
from .block_pool import BlockPool
from .kv_cache_block import KVCacheBlock
from .single_type_manager import SingleTypeKVCacheManager


class CrossAttentionManager(SingleTypeKVCacheManager):
    is_cross_attention = True

    def add_local_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock],
                                  num_local_computed_tokens: int, num_external_computed_tokens: int) -> None:
        # vLLM only asserts there are no hits; the request is *not* marked running here.
        assert len(new_computed_blocks) == 0

    def allocate_external_computed_blocks(self, request_id: str, num_local_computed_tokens: int,
                                          num_external_computed_tokens: int,
                                          record_for_zeroing: bool = True) -> None:
        return

    def cache_blocks(self, request: Request, block_hashes: Sequence[BlockHash], num_tokens: int,
                     retention_interval: int | None = None, replay_boundaries: Sequence[int] = ()) -> None:
        # vLLM raises here; kvref refuses cross-attention with prefix caching when building.
        raise AssertionError("cross-attention blocks are never cached")

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[BlockHash], max_length: int,
                               kv_cache_group_ids: Sequence[int], block_pool: BlockPool,
                               kv_cache_spec: KVCacheSpec, drop_eagle_block: bool,
                               alignment_tokens: int, dcp_world_size: int = 1,
                               pcp_world_size: int = 1) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        raise AssertionError("cross-attention has no prefix cache")
