"""CrossHair contracts (PEP 316 docstrings) on the spec functions and the block pool.

Each function here calls the real ``kvref.spec`` / ``kvref.impl.reference`` code and states what
it must guarantee as ``pre:``/``post:`` conditions. CrossHair (``python -m crosshair check``) runs
them symbolically within a fixed per-condition budget; :mod:`kvref.proofs.crosshair_run` drives it
and reports, per contract, whether it was confirmed, refuted (with a counterexample) or could not be
analysed within the budget — never silently skipped.

Spec contracts cover the admission caps (both directions of the ``cdiv`` bound: enough blocks, not
one too many), the single source of truth between startup bytes and the cap, block-size resolution
and auto-fit. Block-pool contracts cover allocation, free and touch on small pools.
"""

from __future__ import annotations

from kvref.spec.mathutil import cdiv

_ATTN = dict(num_kv_heads=1, head_size=2, dtype="float16")


def contract_cdiv(a: int, b: int) -> int:
    """``cdiv`` is the least q with q*b >= a.

    pre: b >= 1
    post: __return__ * b >= a
    post: (__return__ - 1) * b < a
    """
    return cdiv(a, b)


def contract_swa_cap(sliding_window: int, extra_retained_tokens: int, block_size: int,
                     max_in_flight_tokens: int, max_model_len: int) -> int:
    """SWA cap covers the retained window plus in-flight tokens, with exactly one block of slack.

    pre: 1 <= sliding_window <= 1 << 20 and 0 <= extra_retained_tokens <= 1 << 10
    pre: 1 <= block_size <= 1 << 12 and 0 <= max_in_flight_tokens <= 1 << 20 and 1 <= max_model_len <= 1 << 22
    post: __return__ >= 1
    post: (__return__ - 1) * block_size >= min(sliding_window - 1 + extra_retained_tokens + max_in_flight_tokens, max_model_len)
    post: (__return__ - 2) * block_size < min(sliding_window - 1 + extra_retained_tokens + max_in_flight_tokens, max_model_len)
    post: __return__ <= cdiv(max_model_len, block_size) + 1
    """
    from kvref.spec import SlidingWindowSpec

    spec = SlidingWindowSpec(block_size=block_size, sliding_window=sliding_window,
                             extra_retained_tokens=extra_retained_tokens, **_ATTN)
    return spec.max_admission_blocks_per_request(max_in_flight_tokens, max_model_len)


def contract_cl_cap(attention_chunk_size: int, block_size: int, max_in_flight_tokens: int,
                    max_model_len: int) -> int:
    """Chunked-local cap: the least block count covering one chunk plus in-flight tokens.

    pre: 1 <= attention_chunk_size <= 1 << 20 and 1 <= block_size <= 1 << 12
    pre: 0 <= max_in_flight_tokens <= 1 << 20 and 1 <= max_model_len <= 1 << 22
    post: __return__ * block_size >= min(attention_chunk_size + max_in_flight_tokens, max_model_len)
    post: (__return__ - 1) * block_size < min(attention_chunk_size + max_in_flight_tokens, max_model_len)
    """
    from kvref.spec import ChunkedLocalAttentionSpec

    spec = ChunkedLocalAttentionSpec(block_size=block_size, attention_chunk_size=attention_chunk_size, **_ATTN)
    return spec.max_admission_blocks_per_request(max_in_flight_tokens, max_model_len)


def contract_swa_single_source(sliding_window: int, block_size: int, max_num_batched_tokens: int,
                               max_concurrent_batches: int, max_model_len: int) -> int:
    """Startup bytes of a SWA layer = the runtime cap x page size (vLLM #40946).

    pre: 1 <= sliding_window <= 1 << 16 and 1 <= block_size <= 1 << 10
    pre: 1 <= max_num_batched_tokens <= 1 << 16 and 1 <= max_concurrent_batches <= 4
    pre: 1 <= max_model_len <= 1 << 20
    post: __return__ == 0
    """
    from kvref.spec import EngineConfig, SlidingWindowSpec

    cfg = EngineConfig(max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
                       max_concurrent_batches=max_concurrent_batches)
    spec = SlidingWindowSpec(block_size=block_size, sliding_window=sliding_window, **_ATTN)
    cap = spec.max_admission_blocks_per_request(cfg.max_in_flight_tokens, max_model_len)
    return spec.max_memory_usage_bytes(cfg, max_model_len) - cap * spec.page_size_bytes


def contract_block_sizes(bs1: int, bs2: int, cacheable2: bool) -> tuple:
    """Scheduler block size is a common multiple; the hash size divides every cacheable size.

    pre: 1 <= bs1 <= 64 and 1 <= bs2 <= 64
    post: __return__[0] % __return__[1] == 0
    post: __return__[0] % bs1 == 0 and __return__[0] % bs2 == 0
    post: bs1 % __return__[1] == 0
    post: (not cacheable2) or bs2 % __return__[1] == 0
    """
    from kvref.spec import CrossAttentionSpec, EngineConfig, FullAttentionSpec, KVCacheGroupSpec
    from kvref.spec.block_sizes import resolve_kv_cache_block_sizes

    second = FullAttentionSpec if cacheable2 else CrossAttentionSpec
    groups = (KVCacheGroupSpec(("a",), FullAttentionSpec(block_size=bs1, **_ATTN)),
              KVCacheGroupSpec(("b",), second(block_size=bs2, **_ATTN)))
    return resolve_kv_cache_block_sizes(groups, EngineConfig(enable_prefix_caching=True))


def contract_auto_fit(num_blocks: int, block_size: int, derived_max_model_len: int) -> int:
    """Auto-fit of a one-layer full-attention model leaves the null block out and is maximal.

    pre: 2 <= num_blocks <= 64 and 1 <= block_size <= 32 and 1 <= derived_max_model_len <= 4096
    post: __return__ <= derived_max_model_len
    post: cdiv(__return__, block_size) <= num_blocks - 1
    post: __return__ == derived_max_model_len or cdiv(__return__ + 1, block_size) > num_blocks - 1
    """
    from kvref.spec import EngineConfig, FullAttentionSpec, KVCacheGroupSpec
    from kvref.spec.pool_sizing import auto_fit_max_model_len, pool_bytes_per_block

    groups = (KVCacheGroupSpec(("a",), FullAttentionSpec(block_size=block_size, **_ATTN)),)
    bpb = pool_bytes_per_block(groups)
    cfg = EngineConfig(max_model_len="auto", derived_max_model_len=derived_max_model_len)
    return auto_fit_max_model_len(groups, cfg, num_blocks * bpb - bpb, derived_max_model_len)


# ---------------------------------------------------------------------------- block pool

def contract_pool_get_free(num_gpu_blocks: int, k: int) -> int:
    """Taking k blocks and freeing them restores the free count; the null block is never handed out.

    pre: 2 <= num_gpu_blocks <= 6 and 0 <= k <= num_gpu_blocks - 1
    post: __return__ == num_gpu_blocks - 1
    """
    from kvref.impl.reference.block_pool import BlockPool

    pool = BlockPool(num_gpu_blocks, enable_caching=False, hash_block_size=1)
    free0 = pool.get_num_free_blocks()
    blocks = pool.get_new_blocks(k)
    assert pool.get_num_free_blocks() == free0 - k
    assert len({b.block_id for b in blocks}) == k and all(b.block_id != 0 and b.ref_cnt == 1 for b in blocks)
    pool.check_invariants()
    pool.free_blocks(blocks)
    pool.check_invariants()
    return pool.get_num_free_blocks()


def contract_pool_over_allocation(num_gpu_blocks: int, k: int) -> int:
    """Asking for more blocks than are free raises NotEnoughFreeBlocksError and changes nothing.

    pre: 1 <= num_gpu_blocks <= 6 and k >= num_gpu_blocks
    post: __return__ == num_gpu_blocks - 1
    """
    from kvref.impl.reference.block_pool import BlockPool
    from kvref.impl.reference.errors import NotEnoughFreeBlocksError

    pool = BlockPool(num_gpu_blocks, enable_caching=False, hash_block_size=1)
    try:
        pool.get_new_blocks(k)
    except NotEnoughFreeBlocksError:
        pass
    else:
        raise AssertionError("over-allocation did not raise")
    pool.check_invariants()
    return pool.get_num_free_blocks()


def contract_pool_touch(num_gpu_blocks: int, k: int, touches: int) -> int:
    """touch adds one reference per call; every reference must be freed before a block is free.

    pre: 2 <= num_gpu_blocks <= 5 and 1 <= k <= num_gpu_blocks - 1 and 0 <= touches <= 2
    post: __return__ == num_gpu_blocks - 1
    """
    from kvref.impl.reference.block_pool import BlockPool

    pool = BlockPool(num_gpu_blocks, enable_caching=False, hash_block_size=1)
    blocks = pool.get_new_blocks(k)
    for _ in range(touches):
        pool.touch(blocks)
    assert all(b.ref_cnt == 1 + touches for b in blocks)
    for _ in range(touches):
        pool.free_blocks(blocks)
    assert pool.get_num_free_blocks() == num_gpu_blocks - 1 - k
    pool.free_blocks(blocks)
    pool.check_invariants()
    return pool.get_num_free_blocks()


def contract_pool_cached_hit(num_gpu_blocks: int, k: int) -> int:
    """A freed, cached block stays findable; touching it (a prefix hit) takes it off the free queue,
    and allocating every free block evicts its hash.

    pre: 2 <= num_gpu_blocks <= 5 and 1 <= k <= num_gpu_blocks - 1
    post: __return__ == num_gpu_blocks - 1
    """
    from kvref.impl.reference.block_pool import BlockPool

    pool = BlockPool(num_gpu_blocks, enable_caching=True, hash_block_size=1)
    blocks = pool.get_new_blocks(k)
    hashes = [bytes([i + 1]) for i in range(k)]
    pool.cache_full_blocks(hashes, blocks, 0, k, 1, 0)
    pool.free_blocks(list(reversed(blocks)))
    assert pool.get_num_free_blocks() == num_gpu_blocks - 1
    hit = pool.get_cached_block(hashes[0], [0])
    assert hit is not None and hit[0] is blocks[0]
    pool.touch(hit)
    assert pool.get_num_free_blocks() == num_gpu_blocks - 2 and blocks[0].ref_cnt == 1
    pool.free_blocks(hit)
    everything = pool.get_new_blocks(pool.get_num_free_blocks())
    assert all(pool.get_cached_block(h, [0]) is None for h in hashes)
    pool.check_invariants()
    pool.free_blocks(everything)
    return pool.get_num_free_blocks()


CONTRACTS = (contract_cdiv, contract_swa_cap, contract_cl_cap, contract_swa_single_source, contract_block_sizes,
             contract_auto_fit, contract_pool_get_free, contract_pool_over_allocation, contract_pool_touch, contract_pool_cached_hit)
