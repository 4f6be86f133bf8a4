"""Mutants of the managers, the coordinator and the KV cache manager.

Registered into :data:`kvref.models.mutants.registry.CATALOGUE`; a mutant whose target does not
exist in this checkout is simply not available (``Mutant.available()``). Most are thin wrappers
around the original method, so they keep working when the reference's internals change.
"""

from __future__ import annotations

import inspect

from kvref.models.mutants.mutant import HISTORIC
from kvref.models.mutants.registry import mutant

_R = "kvref.impl.reference"
_STM = f"{_R}.single_type_manager:SingleTypeKVCacheManager"
_SWA = f"{_R}.sliding_window_manager:SlidingWindowManager"
_KVM = f"{_R}.kv_cache_manager:KVCacheManager"


@mutant("manager.gate_without_cap", f"{_STM}.get_num_blocks_to_allocate",
        "the full-sequence gate charges windowed groups for the whole sequence (no admission cap): "
        "a request startup accepted is never admitted — the head-of-line hang", kind=HISTORIC,
        vllm_bug="#39734 (fixed by PR 40946)", layer="manager")
def _gate_without_cap(original):
    return _with_admission_cap(original, False)


def _with_admission_cap(original, value: bool):
    """``original`` with ``apply_admission_cap`` forced to ``value``, however it was passed
    (``MambaManager`` hands it on positionally)."""
    sig = inspect.signature(original)

    def get_num_blocks_to_allocate(self, *args, **kwargs):
        bound = sig.bind(self, *args, **kwargs)
        bound.arguments["apply_admission_cap"] = value
        return original(*bound.args, **bound.kwargs)
    return get_num_blocks_to_allocate


@mutant("manager.cap_in_every_step", f"{_STM}.get_num_blocks_to_allocate",
        "the admission cap is applied to every step's prediction too: the predictor under-counts "
        "and allocation fails mid-way", kind=HISTORIC,
        vllm_bug="PR 40946 as first merged (crash documented in PR 40027)", layer="manager")
def _cap_every_step(original):
    return _with_admission_cap(original, True)


@mutant("manager.predictor_undercount", f"{_STM}.get_num_blocks_to_allocate",
        "the block predictor counts one block fewer than the allocator takes", layer="manager")
def _undercount(original):
    def get_num_blocks_to_allocate(self, *args, **kwargs):
        return max(0, original(self, *args, **kwargs) - 1)
    return get_num_blocks_to_allocate


@mutant("manager.evictable_hits_uncounted", f"{_STM}.get_num_blocks_to_allocate",
        "touching evictable prefix hits is not counted as consuming free blocks", layer="manager")
def _evictable(original):
    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks, total_computed_tokens,
                                   *args, **kwargs):
        n = original(self, request_id, num_tokens, new_computed_blocks, total_computed_tokens, *args, **kwargs)
        if request_id in self.num_cached_block:
            return n
        skipped = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        first = max(0, skipped - len(self.req_to_blocks.get(request_id, ())))
        return n - sum(1 for b in new_computed_blocks[first:] if b.ref_cnt == 0 and not b.is_null)
    return get_num_blocks_to_allocate


@mutant("manager.free_head_first", f"{_STM}.free",
        "a finished request's blocks are freed head first (its prefix is evicted before its tail; "
        "vLLM frees reversed(blocks))", layer="manager")
def _free_head_first(original):
    def free(self, request_id):
        blocks = self.pop_blocks_for_free(request_id)
        if blocks:
            self.block_pool.free_blocks(blocks)
    return free


@mutant("manager.free_keeps_table", f"{_STM}.free",
        "free releases the blocks but keeps the request's table (a later free double-frees)",
        layer="manager")
def _free_keeps(original):
    def free(self, request_id):
        table = list(self.req_to_blocks.get(request_id, ()))
        original(self, request_id)
        if table:
            self.req_to_blocks[request_id] = table
    return free


@mutant("manager.swa_skip_one_too_many", f"{_SWA}.get_num_skipped_tokens",
        "sliding window: one token too many counted as out of window (a block still read is freed)",
        layer="manager")
def _swa_skip(original):
    def get_num_skipped_tokens(self, n):
        return min(n, original(self, n) + 1)
    return get_num_skipped_tokens


@mutant("manager.chunked_skip_one_block_too_many", f"{_R}.chunked_local_manager:ChunkedLocalAttentionManager.get_num_skipped_tokens",
        "chunked-local attention: the current chunk's first block counted as skipped (freed while the "
        "chunk still reads it)", layer="manager")
def _chunked_skip(original):
    def get_num_skipped_tokens(self, n):
        return min(n, original(self, n) + self.block_size)
    return get_num_skipped_tokens


@mutant("manager.swa_never_frees", f"{_SWA}.get_num_skipped_tokens",
        "sliding window never frees out-of-window blocks (holds as much as full attention)",
        layer="manager")
def _swa_never(original):
    return lambda self, n: 0


@mutant("manager.remove_skipped_noop", f"{_STM}.remove_skipped_blocks",
        "remove_skipped_blocks does nothing (out-of-window blocks stay allocated)", layer="manager")
def _remove_noop(original):
    return lambda self, request_id, processed_computed_tokens, num_prompt_tokens=None: None


@mutant("manager.remove_skipped_no_free", f"{_STM}._remove_blocks_in_range",
        "out-of-window blocks are replaced by the null block but never returned to the pool (leak)",
        layer="manager")
def _remove_leak(original):
    def _remove_blocks_in_range(self, request_id, first_block, last_block):
        table = self.req_to_blocks.get(request_id)
        if table is None or first_block >= last_block:
            return
        for i in range(min(last_block, len(table)) - 1, first_block - 1, -1):
            if table[i] is self._null_block:
                break
            table[i] = self._null_block
    return _remove_blocks_in_range


@mutant("kvm.computed_basis_for_frees", f"{_KVM}.allocate_slots",
        "out-of-window blocks are freed on the computed basis, ignoring tokens in flight (a step "
        "in flight still reads them)", kind=HISTORIC,
        vllm_bug="processed-token basis (max_in_flight_tokens evolution of PR 40946)", layer="manager")
def _computed_basis(original):
    def allocate_slots(self, request, *args, **kwargs):
        in_flight = request.num_in_flight_tokens
        request.num_in_flight_tokens = 0
        try:
            return original(self, request, *args, **kwargs)
        finally:
            request.num_in_flight_tokens = in_flight
    return allocate_slots


@mutant("kvm.hit_covers_last_token", f"{_KVM}.get_computed_blocks",
        "the prefix-cache hit may cover the whole prompt (the last token must be recomputed for "
        "its logits)", layer="manager")
def _hit_last(original):
    def get_computed_blocks(self, request, max_cache_hit_length=None):
        if max_cache_hit_length is None:
            max_cache_hit_length = request.num_tokens
        return original(self, request, max_cache_hit_length)
    return get_computed_blocks


@mutant("kvm.no_full_sequence_gate", f"{_KVM}.allocate_slots",
        "the full-sequence admission gate is skipped (scheduler_reserve_full_isl ignored)",
        layer="manager")
def _no_gate(original):
    def allocate_slots(self, *args, **kwargs):
        kwargs["full_sequence_must_fit"] = False
        return original(self, *args, **kwargs)
    return allocate_slots


@mutant("kvm.no_cache_blocks", f"{_KVM}.allocate_slots",
        "full blocks are never published in the prefix cache (delay_cache_blocks always on)",
        layer="manager")
def _no_cache(original):
    def allocate_slots(self, *args, **kwargs):
        kwargs["delay_cache_blocks"] = True
        return original(self, *args, **kwargs)
    return allocate_slots


@mutant("kvm.free_keeps_hashes", f"{_KVM}.free",
        "freeing a request forgets its block hashes only later: a recycled request id reuses the "
        "old hash list", layer="manager")
def _free_keeps_hashes(original):
    def free(self, request):
        hasher = self.hasher
        self.hasher = None
        try:
            original(self, request)
        finally:
            self.hasher = hasher
    return free


# =========================================================================== offload (SimpleCPU)

_SOS = f"{_R}.offload.simple_cpu_offload_scheduler:SimpleCPUOffloadScheduler"


@mutant("offload.in_flight_not_deduped", f"{_SOS}._prepare_eager_store_specs",
        "eager stores remember only this step's selections: a GPU block still being stored is "
        "selected again, two in-flight stores read it", kind=HISTORIC,
        vllm_bug="#41289 (fixed by PR 41289: _in_flight_store_gpu_blocks)", layer="offload")
def _no_dedup(original):
    def _prepare_eager_store_specs(self, step):
        # Before #41289 a step's scans saw only that step's own selections. The scheduler's set
        # still records every selection afterwards, so its bookkeeping (O1) stays true and only
        # the behaviour differs: a block whose store is in flight is stored again.
        remembered, self._in_flight_store_gpu_blocks = self._in_flight_store_gpu_blocks, set()
        try:
            return original(self, step)
        finally:
            remembered |= self._in_flight_store_gpu_blocks
            self._in_flight_store_gpu_blocks = remembered
    return _prepare_eager_store_specs


@mutant("offload.in_flight_not_drained", f"{_SOS}._process_store_event",
        "a completed store leaves its GPU blocks in the in-flight set (never drained): those blocks "
        "are never offloaded again", layer="offload")
def _not_drained(original):
    def _process_store_event(self, ev):
        t = self._store_event_to_blocks.get(ev)
        kept = set(t.gpu_block_ids) if t is not None and not self.lazy else set()
        original(self, ev)
        self._in_flight_store_gpu_blocks.update(kept)
    return _process_store_event
