"""Per-group block tables: the base of vLLM's ``SingleTypeKVCacheManager``.

One manager per KV-cache group holds, for every request, the group's *block table*
(``req_to_blocks``: position ``j`` covers tokens ``[j*bs, (j+1)*bs)``; null placeholders stand
for positions the layer no longer reads) and how many leading entries are already published in the
prefix cache (``num_cached_block``). A request is *running* in a manager once it has an entry in
``num_cached_block`` — set when its prefix-cache hits are added or when it first publishes a block.

Subclasses say which tokens a layer no longer reads (``get_num_skipped_tokens``), how to find a
prefix-cache hit (``find_longest_cache_hit``) and which full blocks are worth publishing
(``reachable_block_mask``). Source: ``vllm/v1/core/single_type_kv_cache_manager.py`` (0.33.0).
The rules every manager keeps are M1–M9 of docs/invariants.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from kvref.spec.context_parallel import manager_world_sizes
from kvref.spec.kv_cache_interface import KVCacheSpec
from kvref.spec.kv_zeroing import records_new_block_ids
from kvref.spec.mathutil import cdiv

from .block_hash import BlockHash
from .block_pool import BlockPool, BlockPoolCore
from .kv_cache_block import KVCacheBlock
from kvref.impl.request import Request


def null_head_len(blocks: Sequence[KVCacheBlock]) -> int:
    """Number of leading null blocks (a windowed table's skipped prefix)."""
    n = 0
    for block in blocks:
        if not block.is_null:
            break
        n += 1
    return n


class SingleTypeKVCacheManager:
    """Block tables of one KV-cache group.

    Args:
        kv_cache_spec: the group's spec.
        block_pool: the pool shared by all groups.
        enable_caching: prefix caching on/off.
        kv_cache_group_id: index of the group (part of every prefix-cache key).
        scheduler_block_size: the scheduling granularity, a multiple of this group's block size
            (vLLM PR #44165); the default cache-hit alignment.
        dcp_world_size / pcp_world_size: the engine's context-parallel sizes; kept (and DCP scales
            ``block_size``) only when the spec is DCP-sharded.
        max_admission_blocks_per_request: the recycling-aware per-request cap
            (``spec.max_admission_blocks_per_request``) for windowed specs, else None. Applied
            only when ``apply_admission_cap`` is passed (the full-sequence admission gate), see
            vLLM #40946 / #39734.
    """

    #: whether lookups can land on hash boundaries inside a block (fine-grained hits)
    supports_fine_grained_hash_lookup: ClassVar[bool] = False
    #: cross-attention tables are sized by encoder tokens (the coordinator asks)
    is_cross_attention: ClassVar[bool] = False

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, enable_caching: bool,
                 kv_cache_group_id: int, scheduler_block_size: int,
                 max_admission_blocks_per_request: int | None = None,
                 needs_kv_cache_zeroing: bool = False, dcp_world_size: int = 1,
                 pcp_world_size: int = 1) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_pool = block_pool
        self.enable_caching = enable_caching
        self.kv_cache_group_id = kv_cache_group_id
        self.scheduler_block_size = scheduler_block_size
        #: hits land on multiples of this (the hybrid coordinator may lower it to hash_block_size)
        self.cache_hit_alignment_tokens = scheduler_block_size
        # context parallelism (spec/context_parallel.py): a DCP-sharded group's block covers
        # block_size × DCP tokens; a replicated group runs with world sizes 1
        self.dcp_world_size, self.pcp_world_size = manager_world_sizes(kv_cache_spec, dcp_world_size,
                                                                       pcp_world_size)
        self.block_size = kv_cache_spec.block_size * self.dcp_world_size
        self.max_admission_blocks_per_request = max_admission_blocks_per_request
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        #: set by the coordinator: this group drops the EAGLE block on hits
        self.use_eagle = False
        #: set by the ``KVCacheManager`` (vLLM's narrowed ``enable_mamba_shared_prefix_checkpoint``):
        #: only an EAGLE Mamba "align" group ever gets it
        self.shared_prefix_checkpoint = False
        self._null_block = block_pool.null_block
        # Partial (fine-grained) hit tails awaiting their copy-on-write block: rid -> (index, block)
        self._partial_hit_reqs: dict[str, tuple[int, KVCacheBlock]] = {}
        #: (source, destination) copies the worker must run; both endpoints hold a reference
        self._pending_cow_copies: list[tuple[KVCacheBlock, KVCacheBlock]] = []
        #: (request, group, block, boundary tokens) states a KV connector may offload (Mamba "align")
        self._pending_boundary_state_offloads: list[tuple[str, int, KVCacheBlock, int]] = []
        #: KV zeroing (spec/kv_zeroing.py): new attention block ids the worker must zero before use,
        #: drained by ``take_new_block_ids`` (vLLM ``new_block_ids``)
        self._record_new_block_ids = records_new_block_ids(kv_cache_spec, needs_kv_cache_zeroing)
        self.new_block_ids: list[int] = []

    @property
    def has_positionally_stable_blocks(self) -> bool:
        """Whether a connector can follow the block table by position (indices never reused for
        another token range)."""
        return True

    # ------------------------------------------------------------------ sizing

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens the layer no longer reads once ``num_computed_tokens`` are computed."""
        return 0

    @staticmethod
    def _num_evictable(blocks: Sequence[KVCacheBlock]) -> int:
        """Hits that sit in the free queue: touching them consumes free capacity."""
        return sum(1 for b in blocks if b.ref_cnt == 0 and not b.is_null)

    def _has_partial_local_hit(self, new_computed_blocks: Sequence[KVCacheBlock],
                               num_local_computed_tokens: int) -> bool:
        """The local hit ends inside a block: that shared tail needs a private copy."""
        return len(new_computed_blocks) > 0 and num_local_computed_tokens % self.block_size != 0

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock],
                                   total_computed_tokens: int, num_local_computed_tokens: int,
                                   num_tokens_main_model: int, apply_admission_cap: bool = False,
                                   prefill_end: int = 0) -> int:
        """Free blocks an allocation for ``num_tokens`` slots would consume.

        Equals what ``allocate_new_computed_blocks`` + ``allocate_new_blocks`` take from the free
        queue (new blocks plus touched hits that were eviction candidates) when
        ``apply_admission_cap`` is False — the predictor must match the allocator, else
        ``get_new_blocks`` fails mid-allocation (vLLM PR #40027).

        With ``apply_admission_cap`` the required block count is capped by
        ``max_admission_blocks_per_request``. NOTE (as in vLLM 0.33.0): the cap bounds an
        absolute block count, while the result subtracts blocks already held or hit, so with a
        long hit the capped gate may count 0 new blocks for a windowed group. Gate-only, so it can
        under-reserve but never crash.
        """
        block_size = self.block_size
        num_required = -(-num_tokens // block_size)
        if apply_admission_cap and self.max_admission_blocks_per_request is not None:
            num_required = min(num_required, self.max_admission_blocks_per_request)
        num_held = len(self.req_to_blocks.get(request_id, ()))
        if request_id in self.num_cached_block:
            # Running: no new hits. Fewer than held is possible after rejected draft tokens.
            return max(num_required - num_held, 0)
        num_skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // block_size
        num_new = max(num_required - max(num_skipped_blocks, len(new_computed_blocks) + num_held), 0)
        # The first skipped blocks' worth of hits are never touched (they become null); the others
        # that sit in the free queue are taken out of it by the touch.
        first_touched = max(0, num_skipped_blocks - num_held)
        num_evictable = 0
        for block in (new_computed_blocks[first_touched:] if first_touched else new_computed_blocks):
            if block.ref_cnt == 0 and not block.is_null:
                num_evictable += 1
        if new_computed_blocks and num_local_computed_tokens % block_size:
            num_new += 1  # the copy-on-write block for a shared partial tail
        return num_new + num_evictable

    # ------------------------------------------------------------------ allocation

    def add_local_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock],
                                  num_local_computed_tokens: int, num_external_computed_tokens: int) -> None:
        """Start the request's table with its prefix-cache hits (first allocation only).

        Hits wholly before the window become null placeholders and are not touched; the rest are
        touched so their reference counts track the tables holding them.
        """
        table = self.req_to_blocks.setdefault(request_id, [])
        assert not table, f"request {request_id} already has blocks in group {self.kv_cache_group_id}"
        num_total = num_local_computed_tokens + num_external_computed_tokens
        num_skipped_blocks = self.get_num_skipped_tokens(num_total) // self.block_size
        hits = new_computed_blocks[num_skipped_blocks:] if num_skipped_blocks > 0 else new_computed_blocks
        if self.enable_caching:
            BlockPoolCore.touch(self.block_pool, hits)  # hits checked by KVCacheManager
        else:
            assert not hits, "prefix-cache hits with caching disabled"
        if num_skipped_blocks > 0:
            table.extend([self._null_block] * num_skipped_blocks)
        table.extend(hits)
        self.num_cached_block[request_id] = len(table)
        if self._has_partial_local_hit(hits, num_local_computed_tokens):
            block_idx = num_local_computed_tokens // self.block_size
            self._partial_hit_reqs[request_id] = (block_idx, hits[-1])
            self.num_cached_block[request_id] = block_idx

    def allocate_external_computed_blocks(self, request_id: str, num_local_computed_tokens: int,
                                          num_external_computed_tokens: int,
                                          record_for_zeroing: bool = True) -> None:
        """Blocks for tokens a KV connector will load (after *all* groups touched their hits, so
        one group's allocation cannot evict another group's hits — vLLM #33775).
        ``record_for_zeroing`` False: an asynchronous load writes them after this step, and zeroing
        them would race with it."""
        num_total = num_local_computed_tokens + num_external_computed_tokens
        num_skipped = self.get_num_skipped_tokens(num_total)
        if num_skipped > 0:
            num_external_computed_tokens = min(num_total - num_skipped, num_external_computed_tokens)
        if num_external_computed_tokens <= 0:
            return
        table = self.req_to_blocks.setdefault(request_id, [])
        num_new = max(0, cdiv(num_total, self.block_size) - len(table))
        new_blocks = self.block_pool.get_new_blocks(num_new)
        table.extend(new_blocks)
        if self._record_new_block_ids and record_for_zeroing:
            self.new_block_ids.extend(b.block_id for b in new_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            num_tokens_main_model: int) -> list[KVCacheBlock]:
        """Grow the table to ``cdiv(num_tokens, block_size)`` entries; return the new blocks
        (a pending copy-on-write block first)."""
        cow_blocks: list[KVCacheBlock] = []
        if request_id in self._partial_hit_reqs:
            block_idx, source = self._partial_hit_reqs.pop(request_id)
            cow = self.block_pool.get_new_blocks(1)[0]
            self._apply_cow(request_id, block_idx, source, cow)
            # NOTE (as vLLM 0.33.0): the copy target is recorded whether or not this group records
            # new blocks; the scheduler drops the ids when the cache needs no zeroing.
            self.new_block_ids.append(cow.block_id)
            cow_blocks.append(cow)
        table = self.req_to_blocks.setdefault(request_id, [])
        num_new = cdiv(num_tokens, self.block_size) - len(table)
        if num_new <= 0:
            return cow_blocks
        new_blocks = self.block_pool.get_new_blocks(num_new)
        table.extend(new_blocks)
        if self._record_new_block_ids:
            self.new_block_ids.extend(b.block_id for b in new_blocks)
        return cow_blocks + new_blocks

    @property
    def records_new_block_ids(self) -> bool:
        """Whether this group's new blocks are zeroed by the worker (spec/kv_zeroing.py)."""
        return self._record_new_block_ids

    def take_new_block_ids(self) -> list[int]:
        """Drain the block ids recorded for zeroing since the last call."""
        ids, self.new_block_ids = self.new_block_ids, []
        return ids

    def _apply_cow(self, request_id: str, block_idx: int, source: KVCacheBlock, cow: KVCacheBlock) -> None:
        """Replace the shared partial tail by a private block; both keep a reference until the
        worker copied the data (the source keeps its hit reference, the copy gets an extra one)."""
        table = self.req_to_blocks[request_id]
        assert table[block_idx] is source and not source.is_null and source.ref_cnt > 0
        table[block_idx] = cow
        self._pending_cow_copies.append((source, cow))
        cow.ref_cnt += 1

    def take_pending_cow_copies(self) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        pending, self._pending_cow_copies = self._pending_cow_copies, []
        return pending

    def take_pending_boundary_state_offloads(self) -> list[tuple[str, int, KVCacheBlock, int]]:
        """Drain the boundary-state hand-offs ``(request id, group id, block, boundary tokens)``.
        The blocks are not kept alive by the table for the whole request: pin before reading
        them asynchronously."""
        pending, self._pending_boundary_state_offloads = self._pending_boundary_state_offloads, []
        return pending

    def finalize_partial_tail_offload(self, request_id: str, num_computed_tokens: int,
                                      num_in_flight_tokens: int) -> tuple[int, KVCacheBlock, int] | None:
        """A finishing producer's partial tail to offload; only Mamba "align" has one."""
        return None

    # ------------------------------------------------------------------ prefix caching

    @classmethod
    def reachable_block_mask(cls, start_block: int, end_block: int, alignment_tokens: int | None,
                             kv_cache_spec: KVCacheSpec, use_eagle: bool,
                             retention_interval: int | None = None,
                             reachable_boundaries: Sequence[int] = (), dcp_world_size: int = 1,
                             final_segment_end_block: int | None = None) -> list[bool] | None:
        """Which full blocks in ``[start_block, end_block)`` could ever serve a hit; None = all.

        Dense here (full attention and every kind that caches densely). Sliding-window and Mamba
        managers thin it out by ``retention_interval`` (spec/prefix_cache_retention.py), keeping
        the tails that end at ``reachable_boundaries`` (token positions). vLLM's
        ``dcp_world_size`` and ``final_segment_end_block`` (the offloading connector's) only matter
        to the sliding-window mask.
        """
        return None

    def _reachable_boundaries(self, request: Request, replay_boundaries: Sequence[int]) -> list[int]:
        """Positions whose reachable tail sparse retention must keep: the prompt's replay
        boundaries and the shared-prefix junction the scheduler observed at the request's lookup
        (``shared_prefix_boundary``); with EAGLE also one block below the junction (a sibling that
        diverges right after it cannot use the block past it as the EAGLE peek)."""
        boundaries = list(replay_boundaries)
        junction = getattr(request, "shared_prefix_boundary", 0)
        if junction:
            boundaries.append(junction)
            if self.use_eagle:
                boundaries.append(junction - self.block_size)
        return boundaries

    def cache_blocks(self, request: Request, block_hashes: Sequence[BlockHash], num_tokens: int,
                     retention_interval: int | None = None, replay_boundaries: Sequence[int] = ()) -> None:
        """Publish the request's full blocks up to ``num_tokens`` (only blocks with a hash and,
        under sparse retention, only those ``reachable_block_mask`` keeps)."""
        if not self.kv_cache_spec.prefix_cacheable:
            return
        rid = request.request_id
        num_cached = self.num_cached_block.get(rid, 0)
        num_hashed_tokens = len(block_hashes) * self.block_pool.hash_block_size
        num_full = min(num_tokens, num_hashed_tokens) // self.block_size
        if num_cached >= num_full:
            return
        mask = self.reachable_block_mask(num_cached, num_full, self.cache_hit_alignment_tokens,
                                         self.kv_cache_spec, self.use_eagle, retention_interval,
                                         self._reachable_boundaries(request, replay_boundaries),
                                         dcp_world_size=self.dcp_world_size)
        self.block_pool.cache_full_blocks(block_hashes, self.req_to_blocks.setdefault(rid, []),
                                          num_cached, num_full, self.block_size, self.kv_cache_group_id, mask,
                                          request=request)
        self.num_cached_block[rid] = num_full

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[BlockHash], max_length: int,
                               kv_cache_group_ids: Sequence[int], block_pool: BlockPool,
                               kv_cache_spec: KVCacheSpec, drop_eagle_block: bool,
                               alignment_tokens: int, dcp_world_size: int = 1,
                               pcp_world_size: int = 1) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Longest prefix (≤ ``max_length`` tokens, a multiple of ``alignment_tokens``) cached in
        every group of ``kv_cache_group_ids``: per-group hit blocks (null where the layer does
        not read) and the hit length in tokens. ``dcp_world_size`` / ``pcp_world_size`` are the
        manager's (the coordinator passes them only when one is above 1)."""
        raise NotImplementedError("abstract: each single-type manager implements its own cache-hit search")

    # ------------------------------------------------------------------ freeing

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """Forget the request; return its blocks without the leading null run (not freed yet)."""
        table = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        self._partial_hit_reqs.pop(request_id, None)
        head = null_head_len(table)
        return table[head:] if head else table

    def free(self, request_id: str) -> None:
        """Free the request's blocks tail first, so its tail blocks are evicted first. The table
        is walked in reverse, never reversed in place: a caller still holding it (``get_blocks``
        before the free, e.g. a KV connector) keeps seeing it in table order, as in vLLM, which
        iterates ``reversed()`` (issue #23's first difference)."""
        blocks = self.pop_blocks_for_free(request_id)
        if blocks:
            BlockPoolCore.free_blocks(self.block_pool, blocks[::-1])

    def _remove_blocks_in_range(self, request_id: str, first_block: int, last_block: int) -> None:
        """Null out and free ``table[first_block:last_block]``, walking down from the top and
        stopping at the first null (the range below it was freed by an earlier call)."""
        table = self.req_to_blocks.get(request_id)
        if table is None or first_block >= last_block:
            return
        last_block = min(last_block, len(table))
        freed: list[KVCacheBlock] = []
        null = self._null_block
        for i in range(last_block - 1, first_block - 1, -1):
            if table[i] is null:
                break
            freed.append(table[i])
            table[i] = null
        if freed:
            BlockPoolCore.free_blocks(self.block_pool, freed)

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        """Free the blocks wholly before the window of the next token.

        ``processed_computed_tokens`` is the *processed* basis (computed minus in flight): steps
        still in flight read blocks below the optimistic boundary.
        """
        num_skipped_tokens = self.get_num_skipped_tokens(processed_computed_tokens)
        if num_skipped_tokens <= 0:
            return
        table = self.req_to_blocks.setdefault(request_id, [])
        self._remove_blocks_in_range(request_id, 0, min(num_skipped_tokens // self.block_size, len(table)))

    def new_step_starts(self) -> None:
        """Hook called at the start of every scheduler step (Mamba's same-step guard)."""

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        """M2, M6 (docs/invariants.md) and per-table sanity; reference counts are checked across
        groups by the manager."""
        for rid, table in self.req_to_blocks.items():
            for block in table:
                assert self.block_pool.blocks[block.block_id] is block, \
                    f"I1: request {rid} holds block {block.block_id} of another pool"
                assert block.is_null or block.ref_cnt > 0, \
                    f"I9: request {rid} holds free block {block.block_id} in group {self.kv_cache_group_id}"
            if rid in self.num_cached_block:
                assert self.num_cached_block[rid] <= len(table) or not table, \
                    f"M2: request {rid}: num_cached_block {self.num_cached_block[rid]} > {len(table)} blocks"
        for rid in self.num_cached_block:
            assert rid in self.req_to_blocks, f"M2: running request {rid} without a table"
        for rid, (idx, block) in self._partial_hit_reqs.items():
            assert self.req_to_blocks[rid][idx] is block, \
                f"M5: request {rid}'s partial-hit block {block.block_id} left its table slot {idx}"
