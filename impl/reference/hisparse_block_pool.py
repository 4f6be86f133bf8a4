"""The GPU pool a HiSparse coordinator releases clean pages into (vLLM 0.33.0 ``BlockPool.unpin_blocks``
and its reuse watchers, ``v1/core/block_pool.py``; issue #23).

HiSparse keeps GPU-resident pages as a write-back cache of the host tier: once a page's host copy
is durable and its request can read from host, the coordinator drops the page's reference with
``unpin_blocks``. The block counts as free (it joins the *back* of the free queue, a last-resort
eviction candidate, whether or not prefix caching is on) but the request keeps reading it until the
pool hands it out again; at that moment (``get_new_blocks``, or a successful
``reset_prefix_cache``) the watcher registered for it is called once, so the coordinator stops
reading it. A watcher stays registered while the block is touched and freed again in between (an
adopted GPU copy): only reuse or a reset ends it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvref.spec.errors import InvalidFieldError

from .block_pool import BlockPool
from .block_pool_checks import check_own
from .kv_cache_block import KVCacheBlock

ReuseWatcher = Callable[[KVCacheBlock], None]


class ReuseWatchingBlockPool(BlockPool):
    """A :class:`BlockPool` whose blocks can be released while still read (``unpin_blocks``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        #: block id -> what to call when the pool hands the block out again
        self._reuse_watchers: dict[int, ReuseWatcher] = {}
        #: pools whose blocks a caller may hand back here (the HiSparse host pool): vLLM's blocks
        #: know their pool, and ``free_blocks`` returns each to its own (``pop_blocks_for_free``
        #: gives the host source's blocks with the device groups')
        self.other_pools: list[BlockPool] = []

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Free this pool's blocks, then hand each other pool its own, in the given order."""
        blocks = list(ordered_blocks) if not isinstance(ordered_blocks, list) else ordered_blocks
        own, others = [], {}
        for block in blocks:
            pool = next((p for p in self.other_pools if 0 <= getattr(block, "block_id", -1) < len(p.blocks)
                         and p.blocks[block.block_id] is block), None)
            if pool is None:
                own.append(block)
            elif not block.is_null:
                others.setdefault(id(pool), (pool, []))[1].append(block)
        super().free_blocks(own)
        for pool, pool_blocks in others.values():
            pool.free_blocks(pool_blocks)

    def unpin_blocks(self, blocks: Iterable[KVCacheBlock], on_reuse: ReuseWatcher) -> None:
        """Drop one reference from each block and watch it; blocks reaching 0 join the back of the
        free queue in the given order (never the front: they are still being read)."""
        if not callable(on_reuse):
            raise InvalidFieldError("on_reuse", on_reuse, "a callable taking the reused block")
        blocks = list(blocks)
        check_own(self, blocks, "blocks")
        for block in blocks:
            if block.is_null or block.ref_cnt <= 0:
                raise InvalidFieldError("blocks", block.block_id, "referenced, non-null blocks of this pool")
        released = []
        for block in blocks:
            block.ref_cnt -= 1
            self._reuse_watchers[block.block_id] = on_reuse
            if block.ref_cnt == 0:
                released.append(block)
        self.free_block_queue.append_n(released)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        taken = super().get_new_blocks(num_blocks)
        if self._reuse_watchers:
            self._notify_reuse(taken)
        return taken

    def reset_prefix_cache(self) -> bool:
        if not super().reset_prefix_cache():
            return False
        if self._reuse_watchers:
            self._notify_reuse([self.blocks[i] for i in list(self._reuse_watchers)])
        return True

    def _notify_reuse(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            watcher = self._reuse_watchers.pop(block.block_id, None)
            if watcher is not None:
                watcher(block)

    def watched_block_ids(self) -> tuple[int, ...]:
        """Blocks released while still read, in release order (for observation)."""
        return tuple(self._reuse_watchers)

    def check_invariants(self) -> None:
        """The pool's own rules, and M17: only non-null blocks of this pool are watched."""
        super().check_invariants()
        for bid in self._reuse_watchers:
            assert 0 < bid < self.num_gpu_blocks, f"M17: a reuse watcher on block {bid}, not a non-null block"


class SharedEventQueueBlockPool(BlockPool):
    """The HiSparse host pool: its KV cache events (``medium`` CPU) go into the device pool's
    queue, so one ``take_events`` drains both in order (vLLM ``SharedEventQueueBlockPool``,
    ``v1/hisparse/block_pool.py``). The owner swaps in a fresh queue on every drain, so this one
    reads the queue through its owner rather than holding it."""

    def __init__(self, *args, event_owner: BlockPool, **kwargs) -> None:
        if not isinstance(event_owner, BlockPool):
            raise InvalidFieldError("event_owner", event_owner, "the device BlockPool whose queue this pool shares")
        self._event_owner = event_owner
        super().__init__(*args, **kwargs)

    @property
    def kv_event_queue(self) -> list:
        return self._event_owner.kv_event_queue

    @kv_event_queue.setter
    def kv_event_queue(self, events: list) -> None:
        # the base's constructor seeds an empty queue, and a drain here swaps one in: the owner's
        if events:
            raise InvalidFieldError("kv_event_queue", events, "empty: the owner pool holds the queue")
