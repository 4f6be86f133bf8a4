"""One physical KV-cache block's metadata (vLLM ``KVCacheBlock`` in ``kv_cache_utils.py``).

A block is a page of the shared pool: ``block_id`` indexes it, ``ref_cnt`` counts the block-table
slots (and transient pins) that use it, and ``block_hash`` is set while its content is published in
the prefix cache. ``prev_free_block``/``next_free_block`` thread it into the free queue without
allocating list nodes (an intrusive doubly linked list, so removing a cache hit from the middle of
the queue is O(1)).

Block 0 of every pool is the *null block* (``is_null``): a placeholder for skipped, out-of-window
or padding positions in block tables. It is never free, never cached and its ``ref_cnt`` is not
maintained.
"""

from __future__ import annotations


class KVCacheBlock:
    """Metadata of one block. ``__slots__`` keeps it small: a pool holds one per block."""

    __slots__ = ("block_id", "ref_cnt", "_block_hash", "_block_hash_num_tokens",
                 "prev_free_block", "next_free_block", "is_null")

    def __init__(self, block_id: int, ref_cnt: int = 0) -> None:
        self.block_id = block_id
        self.ref_cnt = ref_cnt
        #: ``BlockHashWithGroupId`` (hash bytes + 4-byte group id) while the block is cached
        self._block_hash: bytes | None = None
        #: prefix length (tokens) the primary hash covers; a partial entry can end inside the block
        self._block_hash_num_tokens: int | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False

    @property
    def block_hash(self) -> bytes | None:
        return self._block_hash

    @property
    def block_hash_num_tokens(self) -> int | None:
        return self._block_hash_num_tokens

    def set_block_hash(self, block_hash: bytes, num_tokens: int | None = None) -> None:
        """Publish the block under its primary key; a block has at most one primary key."""
        assert self._block_hash is None and self._block_hash_num_tokens is None, \
            f"block {self.block_id} already has a hash"
        self._block_hash = block_hash
        self._block_hash_num_tokens = num_tokens

    def reset_hash(self) -> None:
        """Forget the hash (the block was evicted from the prefix cache)."""
        self._block_hash = None
        self._block_hash_num_tokens = None

    def __repr__(self) -> str:
        prev_id = self.prev_free_block.block_id if self.prev_free_block else None
        next_id = self.next_free_block.block_id if self.next_free_block else None
        return (f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
                f"block_hash={self._block_hash!r}, prev={prev_id}, next={next_id}"
                f"{', null' if self.is_null else ''})")
