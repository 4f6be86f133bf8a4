"""vLLM's free block queue as a trace implies it: which block a fresh allocation must get (#28, session 17).

vLLM's ``BlockPool`` hands out fresh blocks from the head of its ``FreeKVCacheBlockQueue``
(``get_new_blocks`` -> ``popleft_n``). Startup queues blocks ``1 .. num_blocks - 1`` in id order (block
0 is the null block). ``free_blocks`` takes a request's blocks tail first (``SingleTypeKVCacheManager.free``
frees ``reversed`` of its table, one call per KV cache group) and, for each whose reference count
drops to 0, *prepends* those without a prefix-cache hash (LIFO reuse) and *appends* those with one
(LRU eviction of cached content). A hit on a free cached block takes it out of the queue
(``touch``); a fresh allocation of a cached block evicts its hash; ``reset_prefix_cache`` clears
every hash. So from a trace that shows every allocation, hit and free, in order, the block each
fresh allocation gets is determined: another one means vLLM's pool handed out blocks in another
order than its rules (e.g. freed a reset's or a preemption's requests in another order).

The queue is bounded by the pool (one entry per free block), as the run properties' other state.
"""

from __future__ import annotations

from collections import OrderedDict


class FreeQueue:
    """The free block ids, head first, and which of them carry a prefix-cache hash."""

    def __init__(self, num_blocks: int, caching: bool) -> None:
        self.order: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.caching = caching
        #: blocks vLLM has given a block hash (full, computed, caching on) and not evicted since
        self.hashed: set[int] = set()

    def head(self) -> int | None:
        return next(iter(self.order), None)

    def take(self, b: int) -> bool:
        """A fresh allocation got ``b``: whether it was at the head; it leaves the queue, its hash
        (if any) evicted. False also when ``b`` is not free here at all."""
        at_head = self.head() == b
        self.order.pop(b, None)
        self.hashed.discard(b)
        return at_head

    def touch(self, b: int) -> None:
        """A prefix-cache hit on ``b``: out of the queue if it was free."""
        self.order.pop(b, None)

    def free(self, blocks: list[int]) -> None:
        """One ``free_blocks`` call: ``blocks`` in the order vLLM passed them (a table tail first),
        only those whose reference count dropped to 0."""
        first = [b for b in blocks if not (self.caching and b in self.hashed)]
        for b in reversed(first):  # prepend_n: first[0] ends at the head
            self.order[b] = None
            self.order.move_to_end(b, last=False)
        for b in blocks:
            if self.caching and b in self.hashed:
                self.order[b] = None
                self.order.move_to_end(b)

    def check_invariants(self, held: dict) -> None:
        assert not (set(self.order) & set(held)), "a held block in the free queue"
        assert 0 not in self.order, "the null block in the free queue"


__all__ = ["FreeQueue"]
