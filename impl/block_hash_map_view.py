"""A prefix-cache index behind block ids (issue #22's index conformance).

vLLM's ``BlockHashToBlockMap`` (``vllm/v1/core/block_pool.py``) and the reference's have the same
API over block objects; the generated programs (:mod:`kvref.models.machines.block_index_programs`)
speak block ids. One view maps ids to either map's blocks, so both sides get exactly the same
calls; it adds no behaviour.
"""

from __future__ import annotations

from typing import Any


class BlockHashMapView:
    """``index`` over ``blocks`` (block ``i`` has id ``i``), spoken to in block ids."""

    def __init__(self, blocks: list[Any], index: Any) -> None:
        self.blocks = blocks
        self.index = index

    def insert(self, key: bytes, block_id: int) -> None:
        self.index.insert(key, self.blocks[block_id])

    def pop(self, key: bytes, block_id: int) -> int | None:
        block = self.index.pop(key, block_id)
        return None if block is None else block.block_id

    def get_one_block(self, key: bytes) -> int | None:
        block = self.index.get_one_block(key)
        return None if block is None else block.block_id

    def contain(self, key: bytes, block_id: int) -> bool:
        return self.index.contain(key, block_id)

    def __len__(self) -> int:
        return len(self.index)

    def state(self) -> dict[bytes, list[int]]:
        """key -> the ids cached under it, oldest first (the order ``get_one_block`` answers from).
        Both maps keep one block bare and several in a ``{block_id: block}`` dict (``_cache``)."""
        out = {}
        for key, blocks in self.index._cache.items():
            out[key] = list(blocks) if isinstance(blocks, dict) else [blocks.block_id]
        return out
