"""The block pool: every KV-cache block, the free queue and the prefix-cache index.

Mirrors vLLM 0.33.0's ``BlockPool`` (``vllm/v1/core/block_pool.py``). One pool is shared by all
KV-cache groups of a model, so a block id belongs to one group's table at a time.

Two layers (kvref issue #26, "a thin core"): :class:`BlockPoolCore` is the plain pool, trusting its
arguments as vLLM's does; the KV cache managers call it directly with their own tables' blocks.
:class:`BlockPool` is what everyone constructs: each public method checks its arguments once
(:mod:`.block_pool_checks`, ``InvalidFieldError`` naming the field, nothing changed) and then runs
the core's. Every method without arguments to check is the core's.

The rules that decide block ids, and so must match vLLM exactly:

* Block 0 is the null block, taken out of the free queue at construction and never returned.
* ``get_new_blocks(n)`` pops the ``n`` front blocks of the free queue; a popped block that still
  carries a prefix-cache hash is evicted (its keys are dropped) at that moment, not earlier.
* ``free_blocks(blocks)`` decrements reference counts; blocks reaching 0 are split by whether they
  are cached: **uncached blocks are prepended** to the front (in the given order, so scratch is
  reused first, LIFO), **cached blocks are appended** to the back (in the given order: LRU). A
  request's blocks are freed in reverse table order, so its tail is evicted first. (Older vLLM
  appended everything; the queue's own docstring still says so.)
* ``touch(blocks)`` takes a prefix-cache hit out of the free queue when its count goes 0 -> 1.
* The cache index allows duplicates (see ``block_hash_to_block_map``); a block can carry one
  *primary* key (``block.block_hash``) and further *secondary* keys (partial, fine-grained entries,
  kept in ``cached_block_hashes_by_block``).

KV cache events (``enable_kv_cache_events``, off by default as in vLLM) are emitted where vLLM
emits them and taken with ``take_events()``; see :mod:`.kv_events` and docs/kv_events.md.

``BlockStored`` events carry the request's LoRA id and name, session id, its per-block extra keys
in vLLM's untagged event form (multimodal items, LoRA name, cache salt, prompt-embeds digest) and,
with hash lookahead (``num_hash_lookahead_tokens``), the lookahead tokens after each block.

Not modelled: metrics, reuse watchers (HiSparse ``unpin_blocks``), routing frees
to another pool.

Every operation costs O(blocks it touches); nothing scans the pool except ``reset_prefix_cache``
and ``check_invariants``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvref.impl.request import Request
from kvref.spec.errors import check_int

from . import block_pool_checks as checks
from .block_hash import (
    BlockHash,
    BlockHashWithGroupId,
    generate_block_hash_extra_keys,
    get_block_hash,
    get_group_id,
    resolve_block_hashes,
    to_event_extra_keys,
)
from .block_hash_to_block_map import BlockHashToBlockMap
from .errors import BlockRefCountError, NotEnoughFreeBlocksError
from .free_block_queue import FreeKVCacheBlockQueue
from .kv_cache_block import KVCacheBlock
from .kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    to_external_block_hash,
    use_int_block_hashes,
)

_GROUP_SUFFIXES = tuple(i.to_bytes(4, "big") for i in range(64))


def group_suffix(group_id: int) -> bytes:
    """The 4-byte big-endian group id that ends every prefix-cache key."""
    return _GROUP_SUFFIXES[group_id] if 0 <= group_id < 64 else group_id.to_bytes(4, "big")


class BlockPoolCore:
    """All blocks of one pool, with vLLM's operations and no argument checks (see the module
    docstring; construct :class:`BlockPool`).

    Args:
        num_gpu_blocks: blocks in the pool, including the null block 0 (so at least 1).
        enable_caching: whether full blocks are published in the prefix cache.
        hash_block_size: the token granularity of request block hashes; a group's block size is a
            multiple of it.
        enable_kv_cache_events: queue a :mod:`.kv_events` event wherever vLLM's pool does (off by
            default, as in vLLM; the scheduler turns it on with ``--kv-events-config``).
        medium: the ``medium`` field of the events (vLLM's ``MEDIUM_GPU`` for the device pool).
        int_block_hashes: publish hashes as 64-bit ints (vLLM's default) or bytes; None reads
            ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` now (vLLM reads it at each event).
        num_hash_lookahead_tokens: tokens after each block its hash covers (EAGLE block drop);
            events then carry them and extra keys cover them too.
    """

    def __init__(self, num_gpu_blocks: int, enable_caching: bool, hash_block_size: int,
                 enable_kv_cache_events: bool = False, medium: str = MEDIUM_GPU,
                 int_block_hashes: bool | None = None, num_hash_lookahead_tokens: int = 0) -> None:
        self.num_hash_lookahead_tokens = num_hash_lookahead_tokens
        self.enable_kv_cache_events = enable_kv_cache_events
        self.medium = medium
        # only a pool that emits reads the environment (a bad value is then an error naming it)
        self.int_block_hashes = int_block_hashes if int_block_hashes is not None else (
            use_int_block_hashes() if enable_kv_cache_events else True)
        self.kv_event_queue: list[KVCacheEvent] = []
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        #: block_id -> secondary keys of a block that already has a primary key
        self.cached_block_hashes_by_block: dict[int, set[BlockHashWithGroupId]] = {}
        # vLLM: block 0 stands for every skipped slot (outside a window); it is never handed out
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        #: block residency metrics (vLLM ``--kv-cache-metrics``): a
        #: :class:`~kvref.impl.reference.kv_cache_metrics.KVCacheMetricsCollector` or None (off)
        self.metrics_collector = None

    # ------------------------------------------------------------------ lookups

    def get_cached_block(self, block_hash: BlockHash,
                         kv_cache_group_ids: Sequence[int]) -> list[KVCacheBlock] | None:
        """One cached block per group for ``block_hash``, or None if any group misses (vLLM: a
        hit must hold in every group of the spec, or it is no hit)."""
        get = self.cached_block_hash_to_block.get_one_block
        if len(kv_cache_group_ids) == 1:  # the common case, without the loop
            block = get(block_hash + group_suffix(kv_cache_group_ids[0]))
            return None if block is None else [block]
        cached_blocks: list[KVCacheBlock] = []
        for group_id in kv_cache_group_ids:
            block = get(block_hash + group_suffix(group_id))
            if block is None:
                return None
            cached_blocks.append(block)
        return cached_blocks

    def get_num_free_blocks(self) -> int:
        """Free-queue length; includes cached blocks that are eviction candidates."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of the usable blocks (all but the null block) not in the free queue."""
        total = self.num_gpu_blocks - 1
        if not total:
            return 0.0
        return 1.0 - self.free_block_queue.num_free_blocks / total

    def is_block_writable(self, block: KVCacheBlock) -> bool:
        """Whether the sole owner may overwrite it (not null, one reference, not cached)."""
        return not block.is_null and block.ref_cnt == 1 and block.block_hash is None

    # ------------------------------------------------------------------ allocation

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` blocks from the front of the free queue, evicting their hashes.

        Raises:
            NotEnoughFreeBlocksError: fewer free blocks than asked (nothing is taken).
        """
        num_free = self.free_block_queue.num_free_blocks
        if num_blocks > num_free:
            raise NotEnoughFreeBlocksError(num_blocks, num_free)
        # the front is the eviction end: scratch freed last (LIFO), then cached blocks, least recent first
        ret = self.free_block_queue.popleft_n(num_blocks)
        metrics = self.metrics_collector
        for block in ret:
            if metrics is not None and self.enable_caching:  # vLLM: every reused block "evicted", hashed or not
                metrics.on_block_evicted(block.block_id)
            if block._block_hash is not None:  # a cached block is evicted only now, when reused
                removed = self._remove_cached_block_hashes(block)
                if self.enable_kv_cache_events:
                    self._emit_block_removed_events(removed)
            assert block.ref_cnt == 0, f"I3: block {block.block_id} in the free queue has ref_cnt {block.ref_cnt}"
            block.ref_cnt = 1
            if metrics is not None:
                metrics.on_block_allocated(block.block_id)
        return ret

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take one more reference to each block (a prefix-cache hit); 0 -> 1 leaves the queue."""
        remove = self.free_block_queue.remove
        for block in blocks:
            if block.is_null:  # vLLM: shared by every skipped slot, its count is never kept
                continue
            if block.ref_cnt == 0:  # an eviction candidate in the free queue: no longer one
                remove(block)
            block.ref_cnt += 1
            if self.metrics_collector is not None:
                self.metrics_collector.on_block_accessed(block.block_id)

    def free_blocks(self, ordered_blocks: Sequence[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 go back to the free queue.

        ``ordered_blocks`` is in eviction priority (first = evicted first). Uncached blocks are
        prepended in that order, cached ones appended in that order (see the module docstring).
        Null blocks are skipped.

        Raises:
            BlockRefCountError: a block is not in use (double free); nothing is changed. (vLLM
                does not look; the count would go negative. This is what catches a double free.)
        """
        blocks_to_evict_first: list[KVCacheBlock] = []
        blocks_to_evict_last: list[KVCacheBlock] = []
        caching = self.enable_caching
        for idx, block in enumerate(ordered_blocks):
            if block.is_null:  # vLLM: never pooled; its ref_cnt is not maintained
                continue
            if block.ref_cnt <= 0:
                for done in ordered_blocks[:idx]:  # undo, so a double free changes nothing
                    if not done.is_null:
                        done.ref_cnt += 1
                raise BlockRefCountError(block.block_id, block.ref_cnt)
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block._block_hash is None or not caching:
                    blocks_to_evict_first.append(block)  # vLLM: LIFO reuse of uncached blocks (GPU locality)
                else:
                    blocks_to_evict_last.append(block)  # vLLM: FIFO reuse of cached blocks (LRU eviction)
        self.free_block_queue.prepend_n(blocks_to_evict_first)
        self.free_block_queue.append_n(blocks_to_evict_last)

    # ------------------------------------------------------------------ prefix cache

    def cache_full_blocks(self, block_hashes: Sequence[BlockHash], blocks: Sequence[KVCacheBlock],
                          num_cached_blocks: int, num_full_blocks: int, block_size: int,
                          kv_cache_group_id: int, block_mask: Sequence[bool] | None = None,
                          request: Request | None = None) -> None:
        """Publish ``blocks[num_cached_blocks:num_full_blocks]`` under their hashes.

        Args:
            block_hashes: the request's hashes at ``hash_block_size`` granularity (viewed at
                ``block_size`` here).
            blocks: the request's whole block table in this group.
            num_cached_blocks / num_full_blocks: the range to publish.
            block_size: the group's block size (a multiple of ``hash_block_size``).
            kv_cache_group_id: the group, part of every key.
            block_mask: aligned with the range; False skips a block that can never serve a hit
                (sliding-window tails). Null blocks are always skipped.
            request: the request the blocks belong to; needed only with KV cache events (the
                ``BlockStored`` event carries its token ids and cache salt).

        A block that already has a key here is a partial entry being promoted to the full block
        (fine-grained hits): its old keys are removed first (one ``BlockRemoved`` each).

        With events on, one ``BlockStored`` follows for the whole range — even when every block
        in it was skipped (then with no hashes), as vLLM 0.33.0 does.
        """
        if num_cached_blocks >= num_full_blocks:
            return
        events = self.enable_kv_cache_events
        new_full_blocks = blocks[num_cached_blocks:num_full_blocks]
        block_hashes = resolve_block_hashes(block_hashes, self.hash_block_size, block_size)
        suffix = group_suffix(kv_cache_group_id)
        stored: list[int] = []  # indexes of the blocks that got a key (for the event)
        for i, blk in enumerate(new_full_blocks, num_cached_blocks):
            # vLLM: the null block is never cached; a masked block could never serve a hit
            if blk.is_null or (block_mask is not None and not block_mask[i - num_cached_blocks]):
                continue
            num_hash_tokens = (i + 1) * block_size
            if blk._block_hash is not None:  # a partial (fine-grained) entry promoted to the full block
                assert blk._block_hash_num_tokens is not None and blk._block_hash_num_tokens < num_hash_tokens, \
                    f"block {blk.block_id} is already cached for {blk._block_hash_num_tokens} tokens"
                removed = self._remove_cached_block_hashes(blk)
                if events:
                    self._emit_block_removed_events(removed)
            self._insert_block_hash(block_hashes[i] + suffix, blk, num_hash_tokens)
            if events:
                stored.append(i)
        if events:
            assert request is not None
            ext = self._external_hash
            parent_block_hash = ext(block_hashes[num_cached_blocks - 1]) if num_cached_blocks else None
            self.kv_event_queue.append(self._block_stored(
                request, [ext(block_hashes[i]) for i in stored], parent_block_hash,
                num_cached_blocks * block_size, num_full_blocks * block_size, block_size, kv_cache_group_id,
                [i * block_size for i in stored]))

    def _external_hash(self, block_hash: BlockHash) -> int | bytes:
        return to_external_block_hash(block_hash, self.int_block_hashes)

    def _block_stored(self, request: Request, hashes: list, parent: int | bytes | None, start: int,
                      end: int, block_size: int, group_id: int, block_starts: list[int]) -> BlockStored:
        """vLLM's ``_build_block_stored_event``. ``block_starts``: where each block that got a key
        starts; its event extra keys cover ``block_size`` tokens plus the hash lookahead
        (``to_event_extra_keys``: None when no block got a key), and with hash lookahead each
        block's lookahead tokens are listed."""
        lookahead = self.num_hash_lookahead_tokens
        tokens = request.all_token_ids
        extra = to_event_extra_keys([generate_block_hash_extra_keys(request, b, b + block_size + lookahead)
                                     for b in block_starts])
        lora = request.lora_request
        return BlockStored(block_hashes=hashes, parent_block_hash=parent,
                           token_ids=tokens[start:end], block_size=block_size,
                           lora_id=None if lora is None else lora.adapter_id, medium=self.medium,
                           lora_name=None if lora is None else lora.name,
                           extra_keys=extra, group_idx=group_id, session_id=request.session_id,
                           lookahead_token_ids=[tokens[b + block_size:b + block_size + lookahead]
                                                for b in block_starts] if lookahead else None)

    def _emit_block_removed_events(self, keys: list[BlockHashWithGroupId]) -> None:
        """One ``BlockRemoved`` per removed key, in removal order (primary key first)."""
        for key in keys:
            self.kv_event_queue.append(BlockRemoved(
                block_hashes=[self._external_hash(get_block_hash(key))], medium=self.medium,
                group_idx=get_group_id(key)))

    def emit_cached_block_events(self, request: Request, block_hashes: Sequence[BlockHash],
                                 num_cached_blocks: int, block_size: int, kv_cache_group_id: int) -> None:
        """``BlockStored`` for a prefix-cache hit of ``num_cached_blocks`` blocks, without
        touching any state: for requests with ``kv_cache_report_mode == "full"``, so a router
        also learns about reused blocks (vLLM ``BlockPool.emit_cached_block_events``). A hit is
        a prefix from block 0, so there is no parent."""
        if not self.enable_kv_cache_events or num_cached_blocks == 0:
            return
        block_hashes = resolve_block_hashes(block_hashes, self.hash_block_size, block_size)
        ext = self._external_hash
        self.kv_event_queue.append(self._block_stored(
            request, [ext(block_hashes[i]) for i in range(num_cached_blocks)], None, 0,
            num_cached_blocks * block_size, block_size, kv_cache_group_id,
            [i * block_size for i in range(num_cached_blocks)]))

    def take_events(self) -> list[KVCacheEvent]:
        """Take every queued event (oldest first) and empty the queue; [] with events off."""
        if not self.enable_kv_cache_events:
            return []
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    def cache_partial_block(self, block_hashes: Sequence[BlockHash], block: KVCacheBlock,
                            num_tokens: int, kv_cache_group_id: int, block_size: int,
                            replace_existing_hashes: bool = False,
                            request: Request | None = None) -> BlockHashWithGroupId | None:
        """Publish ``block`` under the hash of the prefix ending at ``num_tokens``, a hash boundary
        inside the block (fine-grained hits; full attention's prompt tail in hybrid models).

        The key becomes the block's primary key if it has none, else a secondary key. A block
        keyed for a shorter prefix is re-keyed (its old keys dropped). Returns the key, or None
        for the null block. With events on (``request`` then required), a new entry is announced
        by a one-hash ``BlockStored`` covering the last ``hash_block_size`` tokens before
        ``num_tokens``; an entry the block already had is not announced again.
        """
        if block.is_null:  # vLLM: the null block is never cached
            return None
        events = self.enable_kv_cache_events
        hbs = self.hash_block_size
        num_hash_blocks = num_tokens // hbs
        block_hash = block_hashes[num_hash_blocks - 1]
        key = block_hash + kv_cache_group_id.to_bytes(4, "big")
        already_cached = block._block_hash == key or \
            self.cached_block_hash_to_block.contain(key, block.block_id)
        if replace_existing_hashes:
            removed = self._remove_cached_block_hashes(block)
            already_cached = False
            if events:
                self._emit_block_removed_events(removed)
        elif (not already_cached and block._block_hash is not None
              and block._block_hash_num_tokens is not None
              and block._block_hash_num_tokens < num_tokens):
            # keyed for a shorter prefix: the longer one replaces it (a hit wants the longest)
            removed = self._remove_cached_block_hashes(block)
            if events:
                self._emit_block_removed_events(removed)
        self._insert_block_hash(key, block, num_tokens)
        if events and not already_cached:
            assert request is not None
            start = (num_hash_blocks - 1) * hbs
            parent = block_hashes[num_hash_blocks - 2] if num_hash_blocks > 1 else None
            self.kv_event_queue.append(self._block_stored(
                request, [self._external_hash(block_hash)],
                None if parent is None else self._external_hash(parent), start, num_tokens,
                num_tokens - start, kv_cache_group_id, [start]))
        return key

    def move_block_hashes(self, src_block: KVCacheBlock, dst_block: KVCacheBlock) -> None:
        """Re-point ``src_block``'s cache entries to ``dst_block`` (Mamba copy-on-write); the
        destination is neither null nor cached."""
        if src_block is dst_block:
            return
        num_tokens = src_block.block_hash_num_tokens
        for key in self._remove_cached_block_hashes(src_block):
            self._insert_block_hash(key, dst_block, num_tokens)

    def _insert_block_hash(self, key: BlockHashWithGroupId, block: KVCacheBlock,
                           num_tokens: int | None) -> None:
        if block._block_hash == key or self.cached_block_hash_to_block.contain(key, block.block_id):
            return
        if block._block_hash is None:
            block.set_block_hash(key, num_tokens)
        else:
            self.cached_block_hashes_by_block.setdefault(block.block_id, set()).add(key)
        self.cached_block_hash_to_block.insert(key, block)

    def _remove_cached_block_hashes(self, block: KVCacheBlock) -> list[BlockHashWithGroupId]:
        """Drop every key of ``block`` from the index and clear its hash; returns the keys removed."""
        keys: list[BlockHashWithGroupId] = []
        if block._block_hash is not None:
            keys.append(block._block_hash)
        keys.extend(self.cached_block_hashes_by_block.pop(block.block_id, ()))
        if not keys:
            return []
        pop = self.cached_block_hash_to_block.pop
        removed = [key for key in keys if pop(key, block.block_id) is not None]
        block.reset_hash()
        return removed

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """vLLM's eviction of one block: the metrics hear of it (hashed or not), then its keys
        leave the index (a BlockRemoved event); True when it had any."""
        if self.metrics_collector is not None:
            self.metrics_collector.on_block_evicted(block.block_id)
        removed = self._remove_cached_block_hashes(block)
        if removed and self.enable_kv_cache_events:
            self._emit_block_removed_events(removed)
        return bool(removed)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the prefix-cache keys of these blocks (connector-driven invalidation).

        Blocks in use stay allocated; free ones stay where they are in the queue, now uncached.
        """
        for block_id in block_ids:
            if self.metrics_collector is not None:
                self.metrics_collector.on_block_evicted(block_id)
            removed = self._remove_cached_block_hashes(self.blocks[block_id])
            if self.enable_kv_cache_events:
                self._emit_block_removed_events(removed)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, but only when no block is in use (else return False)."""
        # vLLM refuses while any block is referenced: a running request would lose its hits' keys
        if self.num_gpu_blocks - self.get_num_free_blocks() != 1:  # the null block is always "used"
            return False
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.cached_block_hashes_by_block.clear()
        for block in self.blocks:
            block.reset_hash()
        if self.metrics_collector is not None:
            self.metrics_collector.reset()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    # ------------------------------------------------------------------ inspection

    def cached_blocks(self) -> dict[tuple[int, int], BlockHash]:
        """``{(group_id, block_id): primary hash bytes}`` for every block with a primary key."""
        out: dict[tuple[int, int], BlockHash] = {}
        for key, block in self.cached_block_hash_to_block.items():
            if block.block_hash == key:
                out[(get_group_id(key), block.block_id)] = get_block_hash(key)
        return out

    def free_block_ids(self) -> tuple[int, ...]:
        return tuple(b.block_id for b in self.free_block_queue.iter_blocks())

    def check_invariants(self) -> None:
        """docs/invariants.md I1–I8 and I11 (I9 needs the managers' tables; I10 is enforced by reset)."""
        n = self.num_gpu_blocks
        # I1: one block object per id.
        assert len(self.blocks) == n, f"I1: {len(self.blocks)} blocks in a pool of {n}"
        for i, block in enumerate(self.blocks):
            assert block.block_id == i, f"I1: blocks[{i}] has id {block.block_id}"
        # I2: the null block.
        null = self.null_block
        assert null is self.blocks[0] and null.is_null, "I2: the null block is not block 0"
        assert null.prev_free_block is None and null.next_free_block is None, "I2: null block is in the free queue"
        assert null.block_hash is None and null.block_id not in self.cached_block_hashes_by_block, \
            "I2: the null block is hashed"
        assert null.ref_cnt == 0, f"I2: null block ref_cnt changed to {null.ref_cnt}"
        assert not any(b.is_null for b in self.blocks[1:]), "I2: only block 0 may be the null block"
        # I5: the queue is a well-formed list with a correct count.
        self.free_block_queue.check_invariants()
        in_queue = {b.block_id for b in self.free_block_queue.iter_blocks()}
        # I3 / I4: in the queue <=> ref_cnt == 0; counts never negative.
        num_used = 0
        for block in self.blocks[1:]:
            assert block.ref_cnt >= 0, f"I4: block {block.block_id} has ref_cnt {block.ref_cnt}"
            assert (block.block_id in in_queue) == (block.ref_cnt == 0), \
                f"I3: block {block.block_id}: ref_cnt {block.ref_cnt} but in_queue={block.block_id in in_queue}"
            num_used += block.ref_cnt > 0
        assert self.get_num_free_blocks() + num_used == n - 1, \
            f"I5: {self.get_num_free_blocks()} free + {num_used} referenced != {n - 1} non-null blocks"
        # I6: index <-> block hashes agree.
        num_keys = 0
        for key, block in self.cached_block_hash_to_block.items():
            num_keys += 1
            assert self.blocks[block.block_id] is block and not block.is_null, \
                f"I6: the index maps a key to block {block.block_id}, not a non-null block of this pool"
            assert block.block_hash == key or key in self.cached_block_hashes_by_block.get(block.block_id, ()), \
                f"I6: index maps a key to block {block.block_id} which does not carry it"
        num_expected = 0
        for block in self.blocks:
            if block.block_hash is not None:
                assert self.enable_caching, "I6: a hash was set with caching disabled"
                assert self.cached_block_hash_to_block.contain(block.block_hash, block.block_id), \
                    f"I6: hashed block {block.block_id} is not in the index"
                num_expected += 1
            else:
                assert block.block_hash_num_tokens is None, \
                    f"I6: block {block.block_id} has a hash length but no hash"
        for bid, keys in self.cached_block_hashes_by_block.items():
            assert keys, f"I6: empty secondary key set for block {bid}"
            assert self.blocks[bid].block_hash is not None, f"I6: block {bid} has secondary keys but no primary"
            for key in keys:
                assert self.cached_block_hash_to_block.contain(key, bid), \
                    f"I6: a secondary key of block {bid} is not in the index"
            num_expected += len(keys)
        assert num_keys == num_expected, f"I6: {num_keys} index keys but the blocks carry {num_expected}"
        assert self.enable_kv_cache_events or not self.kv_event_queue, "I11: events queued with events off"


class BlockPool(BlockPoolCore):
    """The block pool everyone constructs: each public method checks its arguments once
    (:mod:`.block_pool_checks`; ``InvalidFieldError`` naming the field, nothing changed) and runs
    :class:`BlockPoolCore`'s. Arguments are as there."""

    def __init__(self, num_gpu_blocks: int, enable_caching: bool, hash_block_size: int,
                 enable_kv_cache_events: bool = False, medium: str = MEDIUM_GPU,
                 int_block_hashes: bool | None = None, num_hash_lookahead_tokens: int = 0) -> None:
        checks.check_pool_args(num_gpu_blocks, enable_caching, hash_block_size, enable_kv_cache_events, medium,
                               int_block_hashes, num_hash_lookahead_tokens)
        super().__init__(num_gpu_blocks, enable_caching, hash_block_size, enable_kv_cache_events, medium,
                         int_block_hashes, num_hash_lookahead_tokens)

    def get_cached_block(self, block_hash: BlockHash,
                         kv_cache_group_ids: Sequence[int]) -> list[KVCacheBlock] | None:
        checks.check_get_cached_block(block_hash, kv_cache_group_ids)
        return super().get_cached_block(block_hash, kv_cache_group_ids)

    def is_block_writable(self, block: KVCacheBlock) -> bool:
        checks.check_own(self, (block,), "block")
        return super().is_block_writable(block)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        check_int("num_blocks", num_blocks, minimum=0)
        return super().get_new_blocks(num_blocks)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:  # type: ignore[override]
        super().touch(checks.own_blocks(self, blocks, "blocks"))

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:  # type: ignore[override]
        super().free_blocks(checks.own_blocks(self, ordered_blocks, "ordered_blocks"))

    def cache_full_blocks(self, block_hashes: Sequence[BlockHash], blocks: Sequence[KVCacheBlock],
                          num_cached_blocks: int, num_full_blocks: int, block_size: int,
                          kv_cache_group_id: int, block_mask: Sequence[bool] | None = None,
                          request: Request | None = None) -> None:
        checks.check_cache_full_blocks(self, block_hashes, blocks, num_cached_blocks, num_full_blocks, block_size,
                                       kv_cache_group_id, block_mask, request)
        super().cache_full_blocks(block_hashes, blocks, num_cached_blocks, num_full_blocks, block_size,
                                  kv_cache_group_id, block_mask, request=request)

    def emit_cached_block_events(self, request: Request, block_hashes: Sequence[BlockHash],
                                 num_cached_blocks: int, block_size: int, kv_cache_group_id: int) -> None:
        checks.check_emit_cached_block_events(self, request, block_hashes, num_cached_blocks, block_size,
                                              kv_cache_group_id)
        super().emit_cached_block_events(request, block_hashes, num_cached_blocks, block_size, kv_cache_group_id)

    def cache_partial_block(self, block_hashes: Sequence[BlockHash], block: KVCacheBlock,
                            num_tokens: int, kv_cache_group_id: int, block_size: int,
                            replace_existing_hashes: bool = False,
                            request: Request | None = None) -> BlockHashWithGroupId | None:
        checks.check_cache_partial_block(self, block_hashes, block, num_tokens, kv_cache_group_id, block_size,
                                         request)
        return super().cache_partial_block(block_hashes, block, num_tokens, kv_cache_group_id, block_size,
                                           replace_existing_hashes=replace_existing_hashes, request=request)

    def move_block_hashes(self, src_block: KVCacheBlock, dst_block: KVCacheBlock) -> None:
        checks.check_move_block_hashes(self, src_block, dst_block)
        super().move_block_hashes(src_block, dst_block)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        super().evict_blocks(checks.check_block_ids(self, block_ids))
