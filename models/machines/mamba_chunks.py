"""Chunks the way vLLM's scheduler cuts them on a Mamba "align" pool, for the KV-manager machine.

vLLM never hands its KV cache manager a prefill chunk that ends off a Mamba state boundary: the
scheduler clips it first (``_mamba_block_aligned_split``, here
:mod:`kvref.impl.reference.scheduler_mamba_split`). Only chunks clipped that way reach the
prompt's partial tail, the prefill checkpoint column and the hand-over of a published tail, so the
machine clips most of its drawn chunks on such pools (and leaves some raw: the manager must stay
consistent with vLLM on any chunk).
"""

from __future__ import annotations

from kvref.impl.interface import PoolConfig
from kvref.impl.reference.kv_cache_coordinator import manager_class_for_spec, partial_hash_hits_enabled
from kvref.impl.reference.scheduler_mamba_split import MambaSplitConfig, mamba_block_aligned_split
from kvref.models.conformance.differential import Harness


def mamba_split_config(pool: PoolConfig) -> MambaSplitConfig | None:
    """The split settings of ``pool``; None when no Mamba group runs in "align" mode."""
    specs = [getattr(g.kv_cache_spec, "first_spec", g.kv_cache_spec) for g in pool.groups]
    partial = pool.enable_caching and len(specs) > 1 and partial_hash_hits_enabled(
        specs, pool.hash_block_size, [manager_class_for_spec(s) for s in specs], pool.dcp_world_size)
    return MambaSplitConfig.from_specs(specs, pool.hash_block_size, pool.scheduler_block_size, partial,
                                       use_eagle_block_drop=pool.use_eagle)


def _peek_hit(h: Harness, request) -> tuple[int, int]:
    """The request's prefix-cache hit length and shared-prefix boundary (where a sparse group lags
    a longer hit: the scheduler stops a chunk there), looked up without side effects: on the
    reference's coordinator when it is compared (``get_computed_blocks`` may queue KV events, e.g.
    with ``kv_cache_report_mode="full"``, which would then be the reference's alone), else on the
    first implementation."""
    ref = getattr(h.managers.get("reference"), "manager", None)
    if ref is not None:
        if not ref.prefix_cache_lookup_enabled(request):
            return 0, 0
        _, hit, uncached = ref.coordinator.find_longest_cache_hit(ref.block_hashes(request), request.num_tokens - 1)
        return hit, hit + uncached if uncached else 0
    return h.managers[h.kinds[0]].get_computed_blocks(request)[1], 0


def aligned_chunk(h: Harness, config: MambaSplitConfig | None, rid: str, chunk: int, admitting: bool) -> int:
    """``chunk`` clipped as the scheduler would for ``rid``'s next chunk (an admission starts after
    its prefix hit); ``chunk`` itself where nothing clips it or the clip leaves nothing."""
    if config is None or rid not in h.reqs:
        return chunk
    s = h.reqs[rid]
    r = s.request
    num_hit = 0
    junction = getattr(r, "shared_prefix_boundary", 0)
    if admitting:
        num_hit, junction = _peek_hit(h, r)
        schedulable = r.num_tokens - num_hit
    else:
        schedulable = r.num_tokens + s.placeholders - r.num_computed_tokens
    num_new = min(chunk, schedulable)
    if num_new <= 0:
        return chunk
    split = mamba_block_aligned_split(config, r.num_computed_tokens, r.num_prompt_tokens, r.num_tokens, num_new,
                                      num_new_local_computed_tokens=num_hit, shared_prefix_boundary=junction)
    return split if split > 0 else chunk
