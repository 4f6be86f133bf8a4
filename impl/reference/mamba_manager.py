"""Mamba / SSM state (vLLM ``MambaManager``).

Only the state after the last computed token matters, so ``get_num_skipped_tokens(n) = n - 1``.

* ``mamba_cache_mode="none"`` (or ``"all"``) without prefix caching: the table is sized like
  attention plus ``num_speculative_blocks`` extra state blocks; skipped blocks are freed.
* ``"align"`` (required for prefix caching): states are checkpointed at block boundaries.
  Allocation ignores lookahead tokens, pads skipped positions with null, allocates at most one
  new state (+ speculative blocks on the first allocation), relocates exclusively owned
  speculative blocks to the end, and frees the state from two steps ago. A hit is a single cached
  state block, searched right to left. A hit on a state cached *in this step* is deferred
  (``get_num_blocks_to_allocate`` returns ``num_gpu_blocks + 1``) because another request's
  state is only written by this step's forward pass; ``new_step_starts`` clears that set.
* Prefill checkpoints (``num_prefill_checkpoint_blocks > 0`` with a
  ``prefill_checkpoint_alignment``): a chunk that runs past the prompt's reusable boundary exports
  the state there into one extra block (reserved at index ``cdiv(end, bs) - 2``) and keys it at
  that boundary; a transient checkpoint that no later request can reach is un-keyed.
* Fine-grained hits (block larger than ``hash_block_size``, enabled by the hybrid coordinator):
  the prompt's last hash boundary inside a block is keyed as a *partial tail*; a hit there takes a
  private copy-on-write block; the request that published it hands the cache entry over to a fresh
  copy (``move_block_hashes``) before its next forward overwrites the state, and offers that copy
  to a KV connector (boundary-state hand-offs, ``take_pending_boundary_state_offloads``).

* Sparse prefix-cache retention (``prefix_cache_retention_interval``, spec/prefix_cache_retention.py):
  only the state blocks ``reachable_block_mask`` keeps are published (segment ends, the replay
  boundary, the shared-prefix junction); a block-aligned prefill checkpoint is kept only where
  retention keeps its block; under 0 a checkpoint block is reserved only on the chunk reaching
  the prefill end (the coordinator passes ``prefill_end``).

* Shared-prefix checkpoint (``enable_mamba_shared_prefix_checkpoint``, set on this manager by the
  ``KVCacheManager`` when EAGLE groups, partial hash hits and no MTP tail allow it): besides the
  prompt's last hash boundary, the state at the request's shared-prefix junction
  (``Request.shared_prefix_boundary``, where a sibling's hit stopped and the scheduler now ends a
  chunk) is keyed as a partial tail too, but only while that junction lies in the prompt chunk
  being computed (``num_computed_tokens < junction <= num_prompt_tokens``): in decode the state
  block is mutated in place and matches its key only after the step's forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from kvref.impl.request import Request
from kvref.spec.kv_cache_interface import (
    KVCacheSpec,
    MambaSpec,
    get_mamba_prefill_checkpoint_position,
    is_mamba_prefill_checkpoint_valid,
)
from kvref.spec.mathutil import cdiv

from .block_hash import BlockHash, resolve_block_hashes
from .block_pool import BlockPool, BlockPoolCore
from .kv_cache_block import KVCacheBlock
from .single_type_manager import SingleTypeKVCacheManager


class MambaManager(SingleTypeKVCacheManager):
    supports_fine_grained_hash_lookup: ClassVar[bool] = True

    def __init__(self, kv_cache_spec: MambaSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.mamba_cache_mode = kv_cache_spec.mamba_cache_mode
        assert self.mamba_cache_mode == "align" or not self.enable_caching
        self.num_speculative_blocks = kv_cache_spec.num_speculative_blocks
        self.has_prefill_checkpoint_blocks = (self.mamba_cache_mode == "align"
                                              and kv_cache_spec.num_prefill_checkpoint_blocks > 0)
        #: set by the coordinator with EAGLE: checkpoints follow EAGLE's replay boundary
        self.drop_eagle_checkpoint_block = False
        #: keys cached during the current scheduler step (the same-step guard)
        self.cached_blocks_this_step: set[bytes] = set()
        self.last_state_block_idx: dict[str, int] = {}
        self._num_retired_blocks: dict[str, int] = {}
        self._allocated_block_reqs: set[str] = set()
        #: rid -> (checkpoint position, reserved block index) of the allocation being made
        self._checkpoints: dict[str, tuple[int, int]] = {}
        #: rid -> (table block, boundary) of the partial tail this request published itself
        self._producer_partial_tail_reqs: dict[str, tuple[KVCacheBlock, int]] = {}

    @property
    def _align(self) -> bool:
        return self.mamba_cache_mode == "align"

    @property
    def has_positionally_stable_blocks(self) -> bool:
        """"align" nulls interior states and relocates speculative blocks: a connector cannot
        follow the table by position (it takes the boundary-state hand-offs instead)."""
        return not self._align

    @property
    def _num_hash_lookahead_tokens(self) -> int:
        return getattr(self.block_pool, "num_hash_lookahead_tokens", 0)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens - 1

    # ------------------------------------------------------------------ lookup

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[BlockHash], max_length: int,
                               kv_cache_group_ids: Sequence[int], block_pool: BlockPool,
                               kv_cache_spec: KVCacheSpec, drop_eagle_block: bool,
                               alignment_tokens: int) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """The rightmost cached state within ``max_length``, nulls before it. With fine-grained
        hits (``alignment_tokens`` a proper divisor of the block) every hash boundary is probed,
        so a partial tail inside a block can be the hit; else only aligned block ends."""
        assert isinstance(kv_cache_spec, MambaSpec)
        block_size = kv_cache_spec.block_size
        computed: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
        null = block_pool.null_block
        if alignment_tokens < block_size and block_size % alignment_tokens == 0:
            # the raw (hash_block_size == alignment) hashes
            scale = block_size // alignment_tokens
            for fine_idx in range(min(max_length // alignment_tokens, len(block_hashes)) - 1, -1, -1):
                hit = block_pool.get_cached_block(block_hashes[fine_idx], kv_cache_group_ids)
                if not hit:
                    continue
                block_idx = fine_idx // scale
                for blocks, block in zip(computed, hit):
                    blocks.extend([null] * block_idx)
                    blocks.append(block)
                return computed, (fine_idx + 1) * alignment_tokens
            return computed, 0
        hashes = resolve_block_hashes(block_hashes, block_pool.hash_block_size, block_size)
        for i in range(max_length // block_size - 1, -1, -1):
            hit = block_pool.get_cached_block(hashes[i], kv_cache_group_ids)
            if not hit:
                continue
            if block_size != alignment_tokens and (i + 1) * block_size % alignment_tokens:
                continue
            for blocks, block in zip(computed, hit):
                blocks.extend([null] * i)
                blocks.append(block)
            return computed, (i + 1) * block_size
        return computed, 0

    # ------------------------------------------------------------------ sizing / allocation

    def _needs_internal_checkpoint(self, request_id: str, query_start: int, query_end: int,
                                   checkpoint_position: int, prefill_end: int) -> bool:
        """Whether this chunk exports a prefill checkpoint into a reserved block: the backend can
        (``is_mamba_prefill_checkpoint_valid``) and the reserved column is free (beyond the
        table, null, or one of a running request's speculative blocks)."""
        checkpoint_idx = cdiv(query_end, self.block_size) - 2
        table = self.req_to_blocks.get(request_id, [])
        return (self.has_prefill_checkpoint_blocks
                and query_end >= prefill_end
                and is_mamba_prefill_checkpoint_valid(
                    query_start, query_end, checkpoint_position, self.block_pool.hash_block_size,
                    self.block_size, self.kv_cache_spec.prefill_checkpoint_alignment)
                and checkpoint_idx >= 0
                and (checkpoint_idx >= len(table) or table[checkpoint_idx].is_null
                     or (request_id in self._allocated_block_reqs
                         and checkpoint_idx >= len(table) - self.num_speculative_blocks)))

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock],
                                   total_computed_tokens: int, num_local_computed_tokens: int,
                                   num_tokens_main_model: int, apply_admission_cap: bool = False,
                                   prefill_end: int = 0) -> int:
        """NOTE: like vLLM, the per-step call (``apply_admission_cap`` False) also records the
        chunk's prefill checkpoint for ``allocate_new_blocks`` (and drops a stale one)."""
        if new_computed_blocks and new_computed_blocks[-1].block_hash in self.cached_blocks_this_step:
            # Same-step guard: more than the pool can give, so the request waits a step.
            return self.block_pool.num_gpu_blocks + 1
        if not self._align:
            if self.num_speculative_blocks:
                num_tokens += self.block_size * self.num_speculative_blocks
            return super().get_num_blocks_to_allocate(
                request_id, num_tokens, new_computed_blocks, total_computed_tokens,
                num_local_computed_tokens, num_tokens_main_model, apply_admission_cap, prefill_end)
        # align: lookahead tokens get no state block (draft models have no Mamba layers)
        num_tokens = num_tokens_main_model
        num_required = cdiv(num_tokens, self.block_size) + self.num_speculative_blocks
        num_new = num_required - len(new_computed_blocks) - len(self.req_to_blocks.get(request_id, ()))
        has_partial_hit = self._has_partial_local_hit(new_computed_blocks, num_local_computed_tokens) \
            or request_id in self._partial_hit_reqs
        if has_partial_hit:
            num_new = max(num_new, 0) + 1
        # keyed on the chunk end, where the worker writes the state
        checkpoint_position = get_mamba_prefill_checkpoint_position(
            num_tokens, self.cache_hit_alignment_tokens, self.drop_eagle_checkpoint_block,
            self._num_hash_lookahead_tokens)
        if not self._needs_internal_checkpoint(request_id, total_computed_tokens, num_tokens,
                                               checkpoint_position, prefill_end):
            checkpoint_position = 0
        checkpoint_block = int(checkpoint_position > 0)
        if not apply_admission_cap:
            if checkpoint_position > 0:
                self._checkpoints[request_id] = (checkpoint_position, cdiv(num_tokens, self.block_size) - 2)
            else:
                self._checkpoints.pop(request_id, None)
        if num_new > 0:
            cap = 1 + int(has_partial_hit) + checkpoint_block
            if request_id not in self._allocated_block_reqs:
                cap += self.num_speculative_blocks
            num_new = min(num_new, cap)
        # NOTE: like vLLM, a negative count is returned as is (it lowers the coordinator's sum).
        return num_new + self._num_evictable(new_computed_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            num_tokens_main_model: int) -> list[KVCacheBlock]:
        if not self._align:
            if self.num_speculative_blocks:
                num_tokens += self.block_size * self.num_speculative_blocks
            return super().allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
        table = self.req_to_blocks.setdefault(request_id, [])
        spec = self.num_speculative_blocks
        num_required = cdiv(num_tokens_main_model, self.block_size) + spec
        checkpoint_block = int(request_id in self._checkpoints)
        partial_hit = self._partial_hit_reqs.get(request_id)
        if num_required <= len(table) and partial_hit is None and not checkpoint_block:
            self._allocated_block_reqs.add(request_id)
            return []
        prev_len = len(table)
        allocated_before = request_id in self._allocated_block_reqs
        if allocated_before:
            # the running state lives in the last (1 + speculative) block
            self.last_state_block_idx[request_id] = prev_len - 1 - spec
        elif prev_len > 0:
            # a prefix hit's last block holds the hit state
            self.last_state_block_idx[request_id] = prev_len - 1
        num_skipped_blocks = num_required - spec - 1
        if prev_len < num_skipped_blocks:
            # the reserved checkpoint column stays a real block
            null_end = num_skipped_blocks - checkpoint_block
            table.extend([self._null_block] * max(0, null_end - prev_len))
        if allocated_before:
            # relocate scratch blocks this step leaves behind (a checkpoint step keeps the one at
            # the checkpoint index: the worker exports the checkpoint into that column)
            for block_idx in range(prev_len - spec, prev_len):
                if block_idx >= num_skipped_blocks - checkpoint_block:
                    break
                self._relocate_speculative_block(table, block_idx)
        num_new = max(num_required - len(table), 0)
        if partial_hit is not None:
            num_new += 1
        cap = 1 + int(partial_hit is not None) + checkpoint_block + (0 if allocated_before else spec)
        assert num_new <= cap, (num_new, cap)
        new_blocks = self.block_pool.get_new_blocks(num_new)
        returned = table[prev_len:]
        if partial_hit is not None:
            block_idx, source = partial_hit
            cow, new_blocks = new_blocks[0], new_blocks[1:]
            if allocated_before:
                self._hand_over_partial_tail(request_id, block_idx, source, cow)
            else:
                self._apply_cow(request_id, block_idx, source, cow)
                returned = [cow] + returned
        table.extend(new_blocks)
        self._allocated_block_reqs.add(request_id)
        self._partial_hit_reqs.pop(request_id, None)
        returned.extend(new_blocks)
        return returned

    def _hand_over_partial_tail(self, request_id: str, block_idx: int, source: KVCacheBlock,
                                cow: KVCacheBlock) -> None:
        """The publisher of a partial tail keeps computing in ``source`` (a running request's
        worker block table is append-only), so the cache entry moves to ``cow``, which the queued
        copy fills before the forward pass overwrites ``source``. Both endpoints stay retained
        until the copy ran; a hit on the moved entry waits a step (it is filled by this step)."""
        table = self.req_to_blocks[request_id]
        assert table[block_idx] is source
        self.block_pool.move_block_hashes(source, cow)
        self._pending_cow_copies.append((source, cow))
        source.ref_cnt += 1
        producer_tail = self._producer_partial_tail_reqs.pop(request_id, None)
        if producer_tail is not None:
            marker, boundary = producer_tail
            assert marker is source
            # the copy preserves the producer's own boundary state: offer it to a connector
            self._pending_boundary_state_offloads.append((request_id, self.kv_cache_group_id, cow, boundary))
        if cow.block_hash is not None:
            self.cached_blocks_this_step.add(cow.block_hash)

    def _relocate_speculative_block(self, table: list[KVCacheBlock], block_idx: int) -> None:
        """Move an exclusively owned, unhashed speculative block to the end of the table."""
        block = table[block_idx]
        assert self.block_pool.is_block_writable(block), "speculative blocks must be private"
        table.append(block)
        table[block_idx] = self._null_block

    # ------------------------------------------------------------------ freeing

    def _remove_blocks_in_range(self, request_id: str, first_block: int, last_block: int) -> None:
        if not self._align:
            return super()._remove_blocks_in_range(request_id, first_block, last_block)
        table = self.req_to_blocks.get(request_id, [])
        first_block = max(first_block, self._num_retired_blocks.get(request_id, 0))
        last_block = min(last_block, len(table))
        if first_block >= last_block:
            return
        freed: list[KVCacheBlock] = []
        # prefill leaves null gaps between states: skip them instead of stopping
        for i in range(last_block - 1, first_block - 1, -1):
            if table[i].is_null:
                continue
            freed.append(table[i])
            table[i] = self._null_block
        if freed:
            BlockPoolCore.free_blocks(self.block_pool, freed)
        self._num_retired_blocks[request_id] = last_block

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        super().remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)
        if not self._align:
            return
        # the state block of two steps ago was only needed as the copy source of the last step
        idx = self.last_state_block_idx.get(request_id)
        if idx is not None and idx < cdiv(processed_computed_tokens, self.block_size) - 1:
            table = self.req_to_blocks.setdefault(request_id, [])
            if table[idx] is not self._null_block:
                BlockPoolCore.free_blocks(self.block_pool, [table[idx]])
                table[idx] = self._null_block

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        if self._align:
            self._allocated_block_reqs.discard(request_id)
            self.last_state_block_idx.pop(request_id, None)
            self._num_retired_blocks.pop(request_id, None)
            self._checkpoints.pop(request_id, None)
            self._producer_partial_tail_reqs.pop(request_id, None)
            # an offer holds committed bytes only until the end of the pass that made it: the
            # blocks go back to the pool now, so drop this request's not-yet-taken hand-offs
            self._pending_boundary_state_offloads = [
                entry for entry in self._pending_boundary_state_offloads if entry[0] != request_id]
        return super().pop_blocks_for_free(request_id)

    def finalize_partial_tail_offload(self, request_id: str, num_computed_tokens: int,
                                      num_in_flight_tokens: int) -> tuple[int, KVCacheBlock, int] | None:
        """A producer that finishes before its copy-on-write hands its table block over directly:
        ``(group id, block, boundary)`` when it stopped exactly at the boundary with nothing in
        flight, else None (the block's state moved past the boundary)."""
        if not self._align:
            return None
        producer_tail = self._producer_partial_tail_reqs.pop(request_id, None)
        if producer_tail is None:
            return None
        source, boundary = producer_tail
        if num_in_flight_tokens != 0 or num_computed_tokens != boundary:
            return None
        return self.kv_cache_group_id, source, boundary

    # ------------------------------------------------------------------ caching

    @classmethod
    def reachable_block_mask(cls, start_block: int, end_block: int, alignment_tokens: int | None,
                             kv_cache_spec: KVCacheSpec, use_eagle: bool,
                             retention_interval: int | None = None,
                             reachable_boundaries: Sequence[int] = (), dcp_world_size: int = 1,
                             final_segment_end_block: int | None = None) -> list[bool] | None:
        """Sparse state-snapshot retention: a Mamba hit needs only the state block ending at it
        (no window; draft models have no Mamba layers, so no EAGLE shift). Dense (None): every
        block. Positive: the block ending each ``retention_interval``-token segment (every block
        when a segment is one block or less). 0: no segments. Under 0 or positive the block ending
        at each of ``reachable_boundaries`` (floored to the alignment) is kept too. A state block is
        one rank's block whatever ``dcp_world_size``, and the offloader's ``final_segment_end_block``
        adds nothing: both are accepted for the common signature and, as in vLLM, ignored."""
        if retention_interval is None or alignment_tokens is None:
            return None
        assert isinstance(kv_cache_spec, MambaSpec)
        block_size = kv_cache_spec.block_size
        mask = [False] * (end_block - start_block)
        if retention_interval:
            per_segment = retention_interval // block_size
            if per_segment <= 1:
                return None
            # block i ends at token (i + 1) * block_size: segment ends are i = k * per_segment - 1
            first = (start_block // per_segment + 1) * per_segment - 1
            for i in range(first, end_block, per_segment):
                mask[i - start_block] = True
        for boundary in reachable_boundaries:
            block_idx = boundary // alignment_tokens * alignment_tokens // block_size - 1
            if start_block <= block_idx < end_block:
                mask[block_idx - start_block] = True
        return mask

    def cache_blocks(self, request: Request, block_hashes: Sequence[BlockHash], num_tokens: int,
                     retention_interval: int | None = None, replay_boundaries: Sequence[int] = ()) -> None:
        rid = request.request_id
        before = self.num_cached_block.get(rid, 0)
        super().cache_blocks(request, block_hashes, num_tokens, retention_interval, replay_boundaries)
        after = self.num_cached_block.get(rid, 0)
        if self._align:
            key = self._cache_partial_tail_block(request, block_hashes, num_tokens, retention_interval)
            if key is not None:
                self.cached_blocks_this_step.add(key)
        if after > before:
            table = self.req_to_blocks[rid]
            for idx in range(before, after):
                block = table[idx]
                if block.is_null or block.block_hash is None:
                    continue
                self.cached_blocks_this_step.add(block.block_hash)
                if self._align:
                    # offer every retained boundary state with its exact block
                    assert block.block_hash_num_tokens is not None
                    self._pending_boundary_state_offloads.append(
                        (rid, self.kv_cache_group_id, block, block.block_hash_num_tokens))

    def _prompt_boundary(self, request: Request, hash_block_size: int) -> int:
        return get_mamba_prefill_checkpoint_position(
            request.num_prompt_tokens, hash_block_size, self.drop_eagle_checkpoint_block,
            self._num_hash_lookahead_tokens)

    def _cache_partial_tail_block(self, request: Request, block_hashes: Sequence[BlockHash],
                                  num_tokens: int, retention_interval: int | None = None) -> bytes | None:
        """Key a state at a boundary inside its block: the chunk's exported prefill checkpoint
        (re-keyed, or un-keyed when no later request can reach it), else the prompt's last hash
        boundary. Returns the new key, or None."""
        rid = request.request_id
        table = self.req_to_blocks.get(rid, [])
        checkpoint = self._checkpoints.get(rid)
        if checkpoint is not None:
            position, idx = checkpoint
            assert 0 <= idx < len(table)
            block = table[idx]
            # the prompt's final chunk caches only up to its last full block, so its checkpoint
            # is the prompt's reusable boundary, not a transient one
            is_prompt_checkpoint = position == self._prompt_boundary(request, self.cache_hit_alignment_tokens)
            # a block-aligned checkpoint stays if retention keeps its block (dense: every one);
            # the replay boundaries are not consulted here, as in vLLM
            is_retained = False
            if position % self.block_size == 0:
                block_idx = position // self.block_size - 1
                kept = self.reachable_block_mask(block_idx, block_idx + 1, self.cache_hit_alignment_tokens,
                                                 self.kv_cache_spec, self.drop_eagle_checkpoint_block,
                                                 retention_interval)
                is_retained = kept is None or kept[0]
            if not is_prompt_checkpoint and not is_retained \
                    and position != getattr(request, "shared_prefix_boundary", 0):
                # the transient state overwrites this slot: neither it nor a key registered
                # earlier this step is reusable
                self.block_pool._maybe_evict_cached_block(block)  # the metrics hear of it too
                return None
            if block.block_hash_num_tokens == position:
                return None
            return self.block_pool.cache_partial_block(block_hashes, block, position, self.kv_cache_group_id,
                                                       self.block_size, replace_existing_hashes=True,
                                                       request=request)
        hbs = self.block_pool.hash_block_size
        if num_tokens <= 0 or num_tokens % hbs:
            return None
        # the junction is the other place a sibling resumes (where the scheduler ends a chunk)
        junction = getattr(request, "shared_prefix_boundary", 0)
        at_junction = (self.shared_prefix_checkpoint and num_tokens == junction
                       and request.num_computed_tokens < num_tokens <= request.num_prompt_tokens)
        if num_tokens != self._prompt_boundary(request, hbs) and not at_junction:
            return None
        block_idx = cdiv(num_tokens, self.block_size) - 1
        if block_idx >= len(table):
            return None
        source = table[block_idx]
        # already keyed here by a hit or an earlier step: re-keying would defer every sibling
        if source.is_null or source.block_hash_num_tokens == num_tokens:
            return None
        key = self.block_pool.cache_partial_block(block_hashes, source, num_tokens, self.kv_cache_group_id,
                                                  self.block_size, request=request)
        if key is not None and num_tokens % self.block_size:
            # the next forward overwrites this state: the coming copy-on-write preserves it
            self._partial_hit_reqs[rid] = (block_idx, source)
            self.num_cached_block[rid] = block_idx
            self._producer_partial_tail_reqs[rid] = (source, num_tokens)
        return key

    def new_step_starts(self) -> None:
        self.cached_blocks_this_step.clear()

    def check_invariants(self) -> None:
        super().check_invariants()
        # vLLM arms the shared-prefix checkpoint only on caching "align" groups (issue #23)
        assert not self.shared_prefix_checkpoint or (self._align and self.enable_caching), \
            f"M11: shared-prefix checkpoint on a {self.mamba_cache_mode!r} group (caching={self.enable_caching})"
        if not self._align:
            return
        for rid, (position, idx) in self._checkpoints.items():
            assert position > 0 and idx >= 0, f"M11: request {rid}'s checkpoint at {position}, slot {idx}"
        for rid, (block, boundary) in self._producer_partial_tail_reqs.items():
            assert boundary % self.block_size, f"M11: producer tail of {rid} at a block boundary {boundary}"
            assert rid in self.req_to_blocks, f"M11: producer tail of request {rid}, which holds no table"
        for rid, _gid, block, boundary in self._pending_boundary_state_offloads:
            assert rid in self.req_to_blocks, f"M11: hand-off of freed request {rid}"
            assert not block.is_null and boundary > 0, \
                f"M11: hand-off of request {rid}: block {block.block_id} at boundary {boundary}"
