"""kvref's ``BlockPool`` behind the block-id interface the block pool machine drives.

vLLM's pool takes and returns block *objects* and its ``cache_full_blocks`` takes a request; the
machine speaks block ids and hash lists. This driver is the reference side of that translation;
:class:`kvref.impl.vllm.block_pool.VllmBlockPoolDriver` is vLLM's, so both answer the same calls.
"""

from __future__ import annotations

from typing import Any

#: the one KV cache group the block pool machine uses
GROUP_ID = 0


class ReferenceBlockPoolDriver:
    """kvref's BlockPool, addressed by block id."""

    name = "reference"

    def __init__(self, num_blocks: int, hash_block_size: int) -> None:
        from kvref.impl.reference.block_pool import BlockPool

        self.pool = BlockPool(num_blocks, True, hash_block_size)

    def blocks(self, ids: list[int]) -> list[Any]:
        return [self.pool.blocks[i] for i in ids]

    def get_new_blocks(self, n: int) -> list[int]:
        return [b.block_id for b in self.pool.get_new_blocks(n)]

    def get_cached_block(self, h: bytes) -> int | None:
        found = self.pool.get_cached_block(h, [GROUP_ID])
        return None if found is None else found[0].block_id

    def touch(self, ids: list[int]) -> None:
        self.pool.touch(self.blocks(ids))

    def free_blocks(self, ids: list[int]) -> None:
        self.pool.free_blocks(self.blocks(ids))

    def cache(self, hashes: list[bytes], ids: list[int], start: int, end: int, block_size: int) -> None:
        self.pool.cache_full_blocks(hashes, self.blocks(ids), start, end, block_size, GROUP_ID)

    def evict_blocks(self, ids: list[int]) -> None:
        self.pool.evict_blocks(ids)

    def reset(self) -> bool:
        return self.pool.reset_prefix_cache()

    def num_free(self) -> int:
        return self.pool.get_num_free_blocks()

    def free_queue(self) -> list[int]:
        return list(self.pool.free_block_ids())

    def ref_counts(self) -> dict[int, int]:
        return {b.block_id: b.ref_cnt for b in self.pool.blocks[1:]}

    def primary(self) -> dict[int, bytes]:
        return {b.block_id: b.block_hash for b in self.pool.blocks if b.block_hash is not None}

    def check_invariants(self) -> None:
        self.pool.check_invariants()
