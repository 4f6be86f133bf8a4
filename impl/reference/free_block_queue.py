"""The free-block queue: an intrusive doubly linked list of blocks in eviction order.

Mirrors vLLM's ``FreeKVCacheBlockQueue`` (``kv_cache_utils.py``). The *front* is the next block
``get_new_blocks`` hands out (and so the next cached block to be evicted); the *back* is the most
recently released cached block. Every operation is O(1) per block moved: ``remove`` unlinks a
prefix-cache hit from the middle of the queue when a request touches it.

Who puts blocks where is the pool's business (see ``BlockPool.free_blocks``): in vLLM 0.33.0
uncached blocks are *prepended* (reused first, LIFO) and cached blocks *appended* (LRU). The
initial order is block-id order.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from .kv_cache_block import KVCacheBlock


class FreeKVCacheBlockQueue:
    """Doubly linked list with two sentinel blocks, so real blocks always have both neighbours."""

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.fake_free_list_head = KVCacheBlock(-1)
        self.fake_free_list_tail = KVCacheBlock(-1)
        self.fake_free_list_head.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = self.fake_free_list_head
        self.num_free_blocks = 0
        self.append_n(list(blocks))

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        """Take the front block. Raises ``IndexError`` when empty (callers check the count first)."""
        if self.num_free_blocks == 0:
            raise IndexError("the free block queue is empty")
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Take the ``n`` front blocks, front first. ``n`` must not exceed ``num_free_blocks``."""
        assert 0 <= n <= self.num_free_blocks, (n, self.num_free_blocks)
        taken: list[KVCacheBlock] = []
        block = self.fake_free_list_head.next_free_block
        for _ in range(n):
            taken.append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        self.fake_free_list_head.next_free_block = block
        block.prev_free_block = self.fake_free_list_head
        self.num_free_blocks -= n
        return taken

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from wherever it sits (a prefix-cache hit leaving the eviction pool)."""
        prev_block, next_block = block.prev_free_block, block.next_free_block
        assert prev_block is not None and next_block is not None, \
            f"block {block.block_id} is not in the free queue"
        prev_block.next_free_block = next_block
        next_block.prev_free_block = prev_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        self.append_n([block])

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put ``blocks`` at the back, in the given order (the last one becomes the new back)."""
        if not blocks:
            return
        tail = self.fake_free_list_tail
        last = tail.prev_free_block
        for block in blocks:
            block.prev_free_block = last
            last.next_free_block = block
            last = block
        last.next_free_block = tail
        tail.prev_free_block = last
        self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put ``blocks`` at the front, in the given order (``blocks[0]`` becomes the new front)."""
        if not blocks:
            return
        head = self.fake_free_list_head
        first = head.next_free_block
        prev = head
        for block in blocks:
            block.prev_free_block = prev
            prev.next_free_block = block
            prev = block
        prev.next_free_block = first
        first.prev_free_block = prev
        self.num_free_blocks += len(blocks)

    def iter_blocks(self) -> Iterator[KVCacheBlock]:
        """Blocks front to back (O(n); for inspection, tests and offload scans)."""
        block = self.fake_free_list_head.next_free_block
        tail = self.fake_free_list_tail
        while block is not tail:
            yield block
            block = block.next_free_block

    def iter_blocks_after(self, cursor: KVCacheBlock | None) -> Iterator[KVCacheBlock]:
        """Blocks after ``cursor`` (from the front when None), front to back.

        The lazy CPU-offload store scan walks the queue from where it stopped last step.
        """
        block = self.fake_free_list_head.next_free_block if cursor is None else cursor.next_free_block
        tail = self.fake_free_list_tail
        while block is not None and block is not tail:
            yield block
            block = block.next_free_block

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        return list(self.iter_blocks())

    def check_invariants(self) -> None:
        """Links are symmetric, the count matches the list, no block appears twice (I5 of
        docs/invariants.md)."""
        head, tail = self.fake_free_list_head, self.fake_free_list_tail
        assert head.prev_free_block is None and tail.next_free_block is None, "I5: a sentinel links outside the list"
        seen: set[int] = set()
        prev = head
        block = head.next_free_block
        while block is not tail:
            assert block is not None, "I5: free list is broken (no link to the tail)"
            assert block.prev_free_block is prev, f"I5: block {block.block_id}: prev link is broken"
            assert block.block_id not in seen, f"I5: block {block.block_id} is twice in the free queue"
            seen.add(block.block_id)
            prev = block
            block = block.next_free_block
        assert tail.prev_free_block is prev, "I5: tail's prev link is broken"
        assert len(seen) == self.num_free_blocks, \
            f"I5: {len(seen)} blocks in the list, num_free_blocks={self.num_free_blocks}"
