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

Not modelled (kvref refuses such configurations): prefill checkpoint blocks
(``num_prefill_checkpoint_blocks > 0``), fine-grained partial hits with their copy-on-write and
``move_block_hashes`` path (a Mamba "align" block larger than ``hash_block_size``), sparse
retention, connector boundary-state hand-offs and the shared-prefix checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from kvref.impl.request import Request
from kvref.spec.kv_cache_interface import KVCacheSpec, MambaSpec
from kvref.spec.mathutil import cdiv

from .block_hash import BlockHash, resolve_block_hashes
from .block_pool import BlockPool
from .kv_cache_block import KVCacheBlock
from .single_type_manager import SingleTypeKVCacheManager


def mamba_prefill_checkpoint_position(num_tokens: int, hash_block_size: int, drop_eagle_block: bool) -> int:
    """The reusable state boundary of a prefill: leave the last token (for logits) unless EAGLE
    already drops a unit; rounded down to ``hash_block_size`` (vLLM
    ``get_mamba_prefill_checkpoint_position`` without hash lookahead)."""
    limit = num_tokens if drop_eagle_block else num_tokens - 1
    position = limit // hash_block_size * hash_block_size
    if drop_eagle_block:
        position -= hash_block_size
    return max(position, 0)


class MambaManager(SingleTypeKVCacheManager):
    supports_fine_grained_hash_lookup: ClassVar[bool] = True

    def __init__(self, kv_cache_spec: MambaSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.mamba_cache_mode = kv_cache_spec.mamba_cache_mode
        assert self.mamba_cache_mode == "align" or not self.enable_caching
        assert kv_cache_spec.num_prefill_checkpoint_blocks == 0 or self.mamba_cache_mode != "align"
        self.num_speculative_blocks = kv_cache_spec.num_speculative_blocks
        #: set by the coordinator with EAGLE: checkpoints follow EAGLE's replay boundary
        self.drop_eagle_checkpoint_block = False
        #: keys cached during the current scheduler step (the same-step guard)
        self.cached_blocks_this_step: set[bytes] = set()
        self.last_state_block_idx: dict[str, int] = {}
        self._num_retired_blocks: dict[str, int] = {}
        self._allocated_block_reqs: set[str] = set()

    @property
    def _align(self) -> bool:
        return self.mamba_cache_mode == "align"

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens - 1

    # ------------------------------------------------------------------ lookup

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[BlockHash], max_length: int,
                               kv_cache_group_ids: Sequence[int], block_pool: BlockPool,
                               kv_cache_spec: KVCacheSpec, drop_eagle_block: bool,
                               alignment_tokens: int) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """The rightmost cached (aligned) state block within ``max_length``, nulls before it."""
        assert isinstance(kv_cache_spec, MambaSpec)
        block_size = kv_cache_spec.block_size
        assert not (alignment_tokens < block_size and block_size % alignment_tokens == 0), \
            "fine-grained Mamba hits are not modelled"
        hashes = resolve_block_hashes(block_hashes, block_pool.hash_block_size, block_size)
        computed: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
        null = block_pool.null_block
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

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock],
                                   total_computed_tokens: int, num_local_computed_tokens: int,
                                   num_tokens_main_model: int, apply_admission_cap: bool = False,
                                   prefill_end: int = 0) -> int:
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
        num_required = cdiv(num_tokens_main_model, self.block_size) + self.num_speculative_blocks
        num_new = num_required - len(new_computed_blocks) - len(self.req_to_blocks.get(request_id, ()))
        has_partial_hit = self._has_partial_local_hit(new_computed_blocks, num_local_computed_tokens) \
            or request_id in self._partial_hit_reqs
        if has_partial_hit:
            num_new = max(num_new, 0) + 1
        if num_new > 0:
            cap = 1 + int(has_partial_hit)
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
        assert request_id not in self._partial_hit_reqs, "partial Mamba hits are not modelled"
        if num_required <= len(table):
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
            table.extend([self._null_block] * (num_skipped_blocks - prev_len))
        if allocated_before:
            for block_idx in range(prev_len - spec, prev_len):
                if block_idx >= num_skipped_blocks:
                    break
                self._relocate_speculative_block(table, block_idx)
        num_new = max(num_required - len(table), 0)
        assert num_new <= 1 + (0 if allocated_before else spec), num_new
        new_blocks = self.block_pool.get_new_blocks(num_new)
        returned = table[prev_len:]
        table.extend(new_blocks)
        self._allocated_block_reqs.add(request_id)
        returned.extend(new_blocks)
        return returned

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
            self.block_pool._free_blocks(freed)
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
                self.block_pool._free_blocks([table[idx]])
                table[idx] = self._null_block

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        self._allocated_block_reqs.discard(request_id)
        self.last_state_block_idx.pop(request_id, None)
        self._num_retired_blocks.pop(request_id, None)
        return super().pop_blocks_for_free(request_id)

    # ------------------------------------------------------------------ caching

    def cache_blocks(self, request: Request, block_hashes: Sequence[BlockHash], num_tokens: int) -> None:
        rid = request.request_id
        before = self.num_cached_block.get(rid, 0)
        super().cache_blocks(request, block_hashes, num_tokens)
        after = self.num_cached_block.get(rid, 0)
        if self._align:
            key = self._cache_partial_tail_block(request, block_hashes, num_tokens)
            if key is not None:
                self.cached_blocks_this_step.add(key)
        if after > before:
            table = self.req_to_blocks[rid]
            for idx in range(before, after):
                block = table[idx]
                if not block.is_null and block.block_hash is not None:
                    self.cached_blocks_this_step.add(block.block_hash)

    def _cache_partial_tail_block(self, request: Request, block_hashes: Sequence[BlockHash],
                                  num_tokens: int) -> bytes | None:
        """Key the state at the prompt's reusable boundary (a no-op unless that block is not yet
        keyed for exactly this boundary)."""
        hbs = self.block_pool.hash_block_size
        if num_tokens <= 0 or num_tokens % hbs:
            return None
        boundary = mamba_prefill_checkpoint_position(request.num_prompt_tokens, hbs,
                                                     self.drop_eagle_checkpoint_block)
        if num_tokens != boundary:
            return None
        table = self.req_to_blocks.get(request.request_id, [])
        block_idx = cdiv(num_tokens, self.block_size) - 1
        if block_idx >= len(table):
            return None
        source = table[block_idx]
        if source.is_null or source.block_hash_num_tokens == num_tokens:
            return None
        key = self.block_pool.cache_partial_block(block_hashes, source, num_tokens,
                                                  self.kv_cache_group_id, self.block_size, request=request)
        assert not num_tokens % self.block_size, "partial Mamba tails are not modelled"
        return key

    def new_step_starts(self) -> None:
        self.cached_blocks_this_step.clear()
