"""The prefix-cache index: key (hash + group id) -> the block(s) cached under it.

vLLM's ``BlockHashToBlockMap`` (``block_pool.py``). Duplicates are allowed on purpose: block
tables are append-only, so when a request fills a block whose content another block already holds,
both stay cached under the same key rather than re-pointing the table to one of them. A key
therefore maps to one block or to ``{block_id: block}``; lookups return any one of them (the one
inserted first, as vLLM's dict order does).
"""

from __future__ import annotations

from collections.abc import Iterator

from .kv_cache_block import KVCacheBlock


class BlockHashToBlockMap:
    """key -> KVCacheBlock, or key -> {block_id: KVCacheBlock} while duplicates exist."""

    def __init__(self) -> None:
        self._cache: dict[bytes, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def get_one_block(self, key: bytes) -> KVCacheBlock | None:
        blocks = self._cache.get(key)
        if blocks is None or type(blocks) is KVCacheBlock:
            return blocks  # type: ignore[return-value]
        return next(iter(blocks.values()))  # type: ignore[union-attr]

    def contain(self, key: bytes, block_id: int) -> bool:
        """Whether ``key`` maps to the block with ``block_id``."""
        blocks = self._cache.get(key)
        if blocks is None:
            return False
        if type(blocks) is KVCacheBlock:
            return blocks.block_id == block_id
        return block_id in blocks  # type: ignore[operator]

    def insert(self, key: bytes, block: KVCacheBlock) -> None:
        blocks = self._cache.get(key)
        if blocks is None:
            self._cache[key] = block
        elif type(blocks) is KVCacheBlock:
            self._cache[key] = {blocks.block_id: blocks, block.block_id: block}
        else:
            blocks[block.block_id] = block  # type: ignore[index]

    def pop(self, key: bytes, block_id: int) -> KVCacheBlock | None:
        """Remove ``block_id`` from ``key``; returns the removed block or None if absent."""
        blocks = self._cache.get(key)
        if blocks is None:
            return None
        if type(blocks) is KVCacheBlock:
            if blocks.block_id != block_id:  # type: ignore[union-attr]
                return None
            del self._cache[key]
            return blocks  # type: ignore[return-value]
        block = blocks.pop(block_id, None)  # type: ignore[union-attr]
        if not blocks:
            del self._cache[key]
        # NOTE: like vLLM, a dict left with one block stays a dict; lookups see no difference.
        return block

    def __len__(self) -> int:
        return len(self._cache)

    def items(self) -> Iterator[tuple[bytes, KVCacheBlock]]:
        """Every (key, block) pair, duplicates included."""
        for key, blocks in self._cache.items():
            if type(blocks) is KVCacheBlock:
                yield key, blocks  # type: ignore[misc]
            else:
                for block in blocks.values():  # type: ignore[union-attr]
                    yield key, block

    def clear(self) -> None:
        self._cache.clear()
