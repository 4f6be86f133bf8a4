"""The mutant catalogue: historic vLLM bugs and classic faults, each a runtime patch.

Every entry re-creates one fault in the reference (or in a ``kvref.spec`` formula) through
:class:`~kvref.models.mutants.mutant.Mutant`. Faulty replacement functions are written here, beside their
entry, so the reference itself never carries a fault switch. ``docs/mutants.md`` lists them with
the check that kills each and the reason for every survivor.

Layers: ``spec`` (formulas), ``pool`` (block pool, free queue, index, hashing), ``manager``
(single-type managers, coordinator, KV cache manager), ``scheduler``.
"""

from __future__ import annotations

from typing import Any

from kvref.models.mutants.mutant import CLASSIC, HISTORIC, Mutant
from kvref.models.mutants.registry import CATALOGUE, mutant

_R = "kvref.impl.reference"


# =========================================================================== spec (formulas)


@mutant("spec.cdiv_floor", "kvref.spec.mathutil:cdiv",
        "off-by-one in cdiv: floor division instead of ceiling division", layer="spec")
def _cdiv_floor(original):
    return lambda a, b: a // b


@mutant("spec.swa_cap_no_plus1", "kvref.spec.kv_cache_interface:SlidingWindowSpec.max_admission_blocks_per_request",
        "sliding-window cap without the +1 block for a window that starts mid-block", layer="spec")
def _swa_no_plus1(original):
    def cap(self, max_in_flight_tokens, max_model_len):
        return original(self, max_in_flight_tokens, max_model_len) - 1
    return cap


@mutant("spec.swa_cap_no_inflight", "kvref.spec.kv_cache_interface:SlidingWindowSpec.max_admission_blocks_per_request",
        "sliding-window cap ignores the tokens in flight (blocks freed on the processed basis are "
        "still held)", kind=HISTORIC, vllm_bug="PR 40946 as first merged (before max_in_flight_tokens)",
        layer="spec")
def _swa_no_inflight(original):
    def cap(self, max_in_flight_tokens, max_model_len):
        return original(self, 0, max_model_len)
    return cap


@mutant("spec.swa_cap_window_not_minus1", "kvref.spec.kv_cache_interface:SlidingWindowSpec.max_admission_blocks_per_request",
        "sliding-window cap counts sliding_window instead of sliding_window - 1 retained tokens "
        "(over-reserves by at most one block)", layer="spec")
def _swa_window_off(original):
    def cap(self, max_in_flight_tokens, max_model_len):
        return original(self, max_in_flight_tokens + 1, max_model_len)
    return cap


@mutant("spec.swa_cap_ignores_max_model_len", "kvref.spec.kv_cache_interface:SlidingWindowSpec.max_admission_blocks_per_request",
        "sliding-window cap not clamped to max_model_len (over-reserves for short models)", layer="spec")
def _swa_no_clamp(original):
    def cap(self, max_in_flight_tokens, max_model_len):
        return original(self, max_in_flight_tokens, 10**9)
    return cap


@mutant("spec.chunked_cap_no_inflight", "kvref.spec.kv_cache_interface:ChunkedLocalAttentionSpec.max_admission_blocks_per_request",
        "chunked-local cap ignores the tokens in flight", kind=HISTORIC,
        vllm_bug="PR 40946 as first merged (before max_in_flight_tokens)", layer="spec")
def _cl_no_inflight(original):
    def cap(self, max_in_flight_tokens, max_model_len):
        return original(self, 0, max_model_len)
    return cap


@mutant("spec.full_pages_floor", "kvref.spec.kv_cache_interface:FullAttentionSpec.max_memory_usage_bytes",
        "full-attention memory bound rounds the block count down", layer="spec")
def _full_floor(original):
    def mem(self, config, max_model_len=None):
        m = config.resolved_max_model_len if max_model_len is None else max_model_len
        return (m // self.block_size) * self.page_size_bytes
    return mem


# =========================================================================== block pool

_POOL = f"{_R}.block_pool:BlockPoolCore"


@mutant("pool.touch_no_ref", f"{_POOL}.touch",
        "touch takes a hit out of the free queue but forgets to count the reference")
def _touch_no_ref(original):
    def touch(self, blocks):
        for block in blocks:
            if not block.is_null and block.ref_cnt == 0:
                self.free_block_queue.remove(block)
    return touch


@mutant("pool.touch_no_remove", f"{_POOL}.touch",
        "touch counts the reference but leaves an evictable hit in the free queue")
def _touch_no_remove(original):
    def touch(self, blocks):
        for block in blocks:
            if not block.is_null:
                block.ref_cnt += 1
    return touch


@mutant("pool.touch_counts_null", f"{_POOL}.touch",
        "touch does not skip the null block (its ref count starts moving)")
def _touch_null(original):
    def touch(self, blocks):
        blocks = list(blocks)
        for block in blocks:
            if block.is_null:
                block.ref_cnt += 1
        original(self, blocks)
    return touch


@mutant("pool.free_append_all", f"{_POOL}.free_blocks",
        "free appends every released block at the back, cached or not (vLLM before the "
        "prepend-uncached change; scratch blocks are no longer reused first)", kind=HISTORIC,
        vllm_bug="free-queue order before 0.33 (uncached blocks were appended)")
def _free_append_all(original):
    def free_blocks(self, blocks):
        released = []
        for block in blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                released.append(block)
        self.free_block_queue.append_n(released)
    return free_blocks


@mutant("pool.free_prepend_reversed", f"{_POOL}.free_blocks",
        "uncached released blocks are prepended in reverse order")
def _free_prepend_reversed(original):
    def free_blocks(self, blocks):
        front, back = [], []
        for block in blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (front if block.block_hash is None else back).append(block)
        self.free_block_queue.prepend_n(front[::-1])
        self.free_block_queue.append_n(back)
    return free_blocks


@mutant("pool.free_cached_to_front", f"{_POOL}.free_blocks",
        "cached released blocks go to the front: the prefix cache evicts what it just kept (MRU)")
def _free_cached_front(original):
    def free_blocks(self, blocks):
        released = []
        for block in blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                released.append(block)
        self.free_block_queue.prepend_n(released)
    return free_blocks


@mutant("pool.free_no_null_skip", f"{_POOL}.free_blocks",
        "free does not skip the null block")
def _free_null(original):
    def free_blocks(self, blocks):
        blocks = list(blocks)
        for block in blocks:
            if block.is_null:
                block.ref_cnt -= 1
        original(self, [b for b in blocks if not b.is_null])
    return free_blocks


@mutant("pool.alloc_no_evict", f"{_POOL}.get_new_blocks",
        "get_new_blocks hands out a cached block without dropping its hash (stale cache entry)")
def _alloc_no_evict(original):
    def get_new_blocks(self, num_blocks):
        if num_blocks > self.free_block_queue.num_free_blocks:
            return original(self, num_blocks)
        taken = self.free_block_queue.popleft_n(num_blocks)
        for block in taken:
            block.ref_cnt = 1
        return taken
    return get_new_blocks


@mutant("pool.alloc_from_back", f"{_POOL}.get_new_blocks",
        "get_new_blocks takes the back of the free queue (evicts the most recently cached block)")
def _alloc_back(original):
    def get_new_blocks(self, num_blocks):
        if num_blocks > self.free_block_queue.num_free_blocks or num_blocks == 0:
            return original(self, num_blocks)
        order = list(self.free_block_queue.iter_blocks())
        chosen = order[-num_blocks:][::-1]
        for block in chosen:
            self.free_block_queue.remove(block)
            if block.block_hash is not None:
                self._remove_cached_block_hashes(block)
            block.ref_cnt = 1
        return chosen
    return get_new_blocks


@mutant("pool.null_counted_free", f"{_POOL}.get_num_free_blocks",
        "the null block is counted as usable: one more free block than there is (startup-time "
        "twin: vLLM #47272 / #48724)", kind=HISTORIC, vllm_bug="null block not subtracted (PR 47272)")
def _null_free(original):
    def get_num_free_blocks(self):
        return original(self) + 1
    return get_num_free_blocks


@mutant("pool.get_cached_first_group_only", f"{_POOL}.get_cached_block",
        "a prefix hit needs only the first group to hit (hybrid groups can miss)")
def _cached_first_group(original):
    def get_cached_block(self, block_hash, kv_cache_group_ids):
        ids = list(kv_cache_group_ids)
        first = original(self, block_hash, ids[:1])
        if first is None or len(ids) == 1:
            return first
        rest = [original(self, block_hash, [g]) for g in ids[1:]]
        return first + [r[0] if r else self.null_block for r in rest]
    return get_cached_block


@mutant("pool.reset_while_in_use", f"{_POOL}.reset_prefix_cache",
        "reset_prefix_cache clears the cache even while blocks are in use")
def _reset_always(original):
    def reset_prefix_cache(self):
        self.cached_block_hash_to_block.clear()
        self.cached_block_hashes_by_block.clear()
        for block in self.blocks:
            block.reset_hash()
        return True
    return reset_prefix_cache


@mutant("pool.cache_ignores_mask", f"{_POOL}.cache_full_blocks",
        "cache_full_blocks ignores block_mask (sliding-window blocks that can never be hit are cached)")
def _cache_no_mask(original):
    def cache_full_blocks(self, block_hashes, blocks, num_cached_blocks, num_full_blocks, block_size,
                          kv_cache_group_id, block_mask=None, **kwargs):
        return original(self, block_hashes, blocks, num_cached_blocks, num_full_blocks, block_size,
                        kv_cache_group_id, None, **kwargs)
    return cache_full_blocks


@mutant("pool.cache_off_by_one", f"{_POOL}.cache_full_blocks",
        "cache_full_blocks publishes one block too many (a block that is not full yet)")
def _cache_extra(original):
    def cache_full_blocks(self, block_hashes, blocks, num_cached_blocks, num_full_blocks, block_size,
                          kv_cache_group_id, block_mask=None, **kwargs):
        from kvref.impl.reference.block_hash import resolve_block_hashes

        n = min(num_full_blocks + 1, len(blocks), len(resolve_block_hashes(block_hashes, self.hash_block_size, block_size)))
        if block_mask is not None:
            block_mask = list(block_mask) + [True] * (n - num_full_blocks)
        return original(self, block_hashes, blocks, num_cached_blocks, n, block_size,
                        kv_cache_group_id, block_mask, **kwargs)
    return cache_full_blocks


# =========================================================================== queue, index, hashes

_Q = f"{_R}.free_block_queue:FreeKVCacheBlockQueue"


@mutant("queue.prepend_as_append", f"{_Q}.prepend_n",
        "prepend_n appends instead (uncached blocks are no longer reused first)")
def _prepend_append(original):
    def prepend_n(self, blocks):
        self.append_n(blocks)
    return prepend_n


@mutant("queue.remove_no_count", f"{_Q}.remove",
        "remove unlinks a block but does not decrement num_free_blocks")
def _remove_count(original):
    def remove(self, block):
        original(self, block)
        self.num_free_blocks += 1
    return remove


@mutant("index.get_last_duplicate", f"{_R}.block_hash_to_block_map:BlockHashToBlockMap.get_one_block",
        "with duplicate cached blocks, a lookup returns the last inserted one instead of the first")
def _get_last(original):
    def get_one_block(self, key):
        blocks = self._cache.get(key)
        if blocks is None or not isinstance(blocks, dict):
            return blocks
        return list(blocks.values())[-1]
    return get_one_block


@mutant("index.pop_all_duplicates", f"{_R}.block_hash_to_block_map:BlockHashToBlockMap.pop",
        "evicting one block drops every block cached under the same key")
def _pop_all(original):
    def pop(self, key, block_id):
        blocks = self._cache.get(key)
        got = original(self, key, block_id)
        if got is not None and isinstance(blocks, dict) and blocks:
            for other in list(blocks.values()):
                other.reset_hash()
            self._cache.pop(key, None)
        return got
    return pop


@mutant("hash.not_chained", f"{_R}.block_hash:RequestBlockHasher._extend",
        "block hashes are not chained: a block's hash ignores its prefix (false prefix hits)")
def _not_chained(original):
    def _extend(self, request, hashes, start, num_tokens):
        bs = self.hash_block_size
        tokens = request.prompt_token_ids + request.output_token_ids
        while start + bs <= num_tokens:
            hashes.append(self.hash_fn((self.none_hash, tuple(tokens[start:start + bs]), None)))
            start += bs
    return _extend


@mutant("hash.salt_ignored", f"{_R}.block_hash:RequestBlockHasher._extend",
        "the cache salt is not hashed into the first block (requests with different salts share "
        "cache entries)")
def _salt_ignored(original):
    def _extend(self, request, hashes, start, num_tokens):
        salt = request.cache_salt
        request.cache_salt = None
        try:
            original(self, request, hashes, start, num_tokens)
        finally:
            request.cache_salt = salt
    return _extend


#: one mutant per fault family: what CI runs (``kvref mutants --subset ci``); nightly runs all
CI_SUBSET = (
    "spec.swa_cap_no_plus1", "spec.cdiv_floor", "pool.touch_no_ref", "pool.free_append_all",
    "pool.alloc_no_evict", "queue.remove_no_count", "index.get_last_duplicate", "hash.not_chained",
    "manager.gate_without_cap", "manager.cap_in_every_step", "manager.swa_skip_one_too_many",
    "manager.free_head_first", "kvm.computed_basis_for_frees", "kvm.hit_covers_last_token",
    "offload.in_flight_not_deduped", "sched.fcfs_victim_oldest", "sched.max_num_seqs_off_by_one",
)


def all_mutants() -> list[Mutant]:
    """Every mutant whose target exists in this checkout."""
    return CATALOGUE.select()


from kvref.models.mutants import catalogue_manager  # noqa: E402,F401 - registers the manager-layer mutants
from kvref.models.mutants import catalogue_scheduler  # noqa: E402,F401 - registers the scheduler-policy mutants


__all__ = ["CATALOGUE", "CI_SUBSET", "all_mutants", "mutant", "HISTORIC", "CLASSIC", "Any"]
