"""Single-type managers, coordinators and the KV cache manager on hand-checked cases.

Block ids are exact: they follow from the free-queue rules (docs/invariants.md I8), which the vLLM
differential tests (test_vs_vllm.py) check against vLLM itself.
"""

from __future__ import annotations

import pytest

from kvref.impl.reference.block_pool import BlockPool
from kvref.impl.reference.chunked_local_manager import ChunkedLocalAttentionManager
from kvref.impl.reference.kv_cache_manager import KVCacheBlocks, KVCacheManager
from kvref.impl.reference.sliding_window_manager import SlidingWindowManager
from kvref.impl.request import Request, RequestStatus

from .helpers import config, cross, fa, local, mamba, swa


def admit(m: KVCacheManager, req: Request, num_new: int | None = None, **kw):
    hits, n, _ = m.get_computed_blocks(req)
    num_new = req.num_tokens - n if num_new is None else num_new
    out = m.allocate_slots(req, num_new, n, hits, **kw)
    if out is not None:
        req.num_computed_tokens = n + num_new
        req.status = RequestStatus.RUNNING
    m.check_invariants()
    return out, n


def free_ids(m: KVCacheManager) -> list[int]:
    return list(m.block_pool.free_block_ids())


# ----------------------------------------------------------------------------- skipping rules


def test_sliding_window_skips_tokens_before_the_window():
    """Window 4, 7 tokens computed: the next token (7) reads 4..7, so tokens 0..3 are skipped."""
    m = SlidingWindowManager(swa(2, 4), block_pool=BlockPool(10, True, 2), enable_caching=True,
                             kv_cache_group_id=0, scheduler_block_size=2)
    assert m.get_num_skipped_tokens(7) == 4
    assert m.get_num_skipped_tokens(3) == 0
    m_extra = SlidingWindowManager(swa(2, 4, extra=3), block_pool=BlockPool(10, True, 2),
                                   enable_caching=True, kv_cache_group_id=0, scheduler_block_size=2)
    assert m_extra.get_num_skipped_tokens(7) == 1


def test_chunked_local_skips_whole_chunks():
    m = ChunkedLocalAttentionManager(local(4, 8), block_pool=BlockPool(10, True, 4), enable_caching=True,
                                     kv_cache_group_id=0, scheduler_block_size=4)
    assert [m.get_num_skipped_tokens(n) for n in (13, 8, 7, 0)] == [8, 8, 0, 0]


def test_sliding_window_frees_out_of_window_blocks_on_the_processed_basis():
    m = KVCacheManager(config([swa(2, 4)], num_blocks=12))
    req = Request("r", list(range(8)))
    out, _ = admit(m, req)
    assert out.get_block_ids() == ([1, 2, 3, 4],)
    req.output_token_ids.append(9)
    # one step is still in flight: only 8 - 4 = 4 tokens are processed -> skip 1 token, 0 blocks
    req.num_in_flight_tokens = 4
    assert m.allocate_slots(req, 1) is not None
    assert m.get_block_ids("r") == ([1, 2, 3, 4, 5],)
    req.num_computed_tokens, req.num_in_flight_tokens = 9, 0
    req.output_token_ids.append(10)
    # processed 9 -> skip 6 tokens -> blocks 0..2 become null and are freed, top first
    assert m.allocate_slots(req, 1) is not None
    assert m.get_block_ids("r") == ([0, 0, 0, 4, 5],)
    # freed out-of-window blocks are cached (full, hashed): appended to the back, top first
    assert free_ids(m)[-3:] == [3, 2, 1]
    m.check_invariants()


def test_chunked_local_13_tokens_frees_the_first_chunk():
    m = KVCacheManager(config([local(4, 8)], num_blocks=10))
    req = Request("r", list(range(14)))
    # the lookup treats the whole first chunk as "hit" (null blocks: never read again)
    hits, n, _ = m.get_computed_blocks(req)
    assert n == 8 and hits.get_block_ids() == ([0, 0],)
    assert m.allocate_slots(req, 13) is not None  # compute it anyway, as a cache-less request
    req.num_computed_tokens = 13
    assert m.get_block_ids("r") == ([1, 2, 3, 4],)
    assert m.allocate_slots(req, 1) is not None  # processed 13 -> skip 8 tokens = 2 blocks
    assert m.get_block_ids("r") == ([0, 0, 3, 4],)
    m.check_invariants()


# ----------------------------------------------------------------------------- free-queue order


def test_prefill_hits_ref_counts_and_free_order():
    m = KVCacheManager(config([fa(4)], num_blocks=11))
    a = Request("a", list(range(14)))  # 3 full blocks + 2 tokens
    out, n = admit(m, a)
    assert n == 0 and out.get_block_ids() == ([1, 2, 3, 4],)
    b = Request("b", list(range(12)) + [7, 7])
    out, n = admit(m, b)
    assert n == 12 and out.get_block_ids() == ([5],)
    assert m.get_block_ids("b") == ([1, 2, 3, 5],)
    assert [m.block_pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 2, 1]
    m.free(a)
    # block 4 (uncached tail) went to the front; 1..3 are still held by b
    assert free_ids(m) == [4, 6, 7, 8, 9, 10]
    m.free(b)
    # b frees in reverse: 5 unhashed -> front; 3, 2, 1 hashed -> back (tail evicted first)
    assert free_ids(m) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]


def test_swa_free_split_keeps_cached_tail_ahead_of_scratch():
    """After a free, uncached SWA scratch sits at the front (reused first) and the cached tail at
    the back (kept longest) (vLLM I8 order)."""
    m = KVCacheManager(config([swa(2, 3)], num_blocks=12))
    req = Request("r", list(range(9)))  # 4 full blocks + 1 token
    admit(m, req, 4)
    admit_more = m.allocate_slots(req, 5)
    assert admit_more is not None
    req.num_computed_tokens = 9
    ids = m.get_block_ids("r")[0]
    assert ids == [0, 2, 3, 4, 5]  # block 1 left the window (processed 4 tokens) and was freed
    m.free(req)
    q = free_ids(m)
    assert q[0] == 5  # the partial, uncached block is reused first
    assert q[-4:] == [1, 4, 3, 2]  # cached blocks at the back: earlier frees first, then tail first
    m.check_invariants()


def test_failed_allocation_leaves_hits_untouched():
    m = KVCacheManager(config([fa(4)], num_blocks=6))
    a = Request("a", list(range(9)))
    admit(m, a)
    m.free(a)
    before = (free_ids(m), [b.ref_cnt for b in m.block_pool.blocks])
    b = Request("b", list(range(8)) + list(range(100, 120)))  # hits 2 blocks, needs 6 more
    hits, n, _ = m.get_computed_blocks(b)
    assert n == 8
    assert m.allocate_slots(b, b.num_tokens - n, n, hits) is None
    assert (free_ids(m), [b.ref_cnt for b in m.block_pool.blocks]) == before
    m.check_invariants()


def test_eviction_of_cached_blocks_follows_lru():
    m = KVCacheManager(config([fa(2)], num_blocks=6))
    a = Request("a", [1, 2, 3, 4, 5])
    admit(m, a)
    m.free(a)  # queue: [3(partial), 4, 5, 2, 1]
    assert free_ids(m) == [3, 4, 5, 2, 1]
    c = Request("c", [9, 9, 9, 9, 9, 9, 9])
    admit(m, c)  # takes 3, 4, 5, 2 -> evicts block 2's hash
    assert m.get_block_ids("c") == ([3, 4, 5, 2],)
    a2 = Request("a2", [1, 2, 3, 4, 5])
    hits, n, _ = m.get_computed_blocks(a2)
    assert n == 2 and hits.get_block_ids() == ([1],)  # block 2 was evicted, 1 survives


# ----------------------------------------------------------------------------- admission


def test_swa_admission_cap_admits_a_prompt_larger_than_the_uncapped_need():
    """vLLM #39734 / #40946: window 128, 64 in-flight tokens -> SWA needs cdiv(191, 16)+1 = 13
    blocks, not 64. A 64-block prompt fits a pool of 64 + 13 + 1 (null) blocks."""
    cfg = config([fa(16), swa(16, 128)], num_blocks=64 + 13 + 1, max_in_flight_tokens=64,
                 max_model_len=1024)
    m = KVCacheManager(cfg)
    assert m.coordinator.single_type_managers[1].max_admission_blocks_per_request == 13
    req = Request("r", list(range(1024)))
    out, _ = admit(m, req, 64, full_sequence_must_fit=True)
    assert out is not None
    # chunked prefill runs to completion: out-of-window frees keep SWA within its cap
    while req.num_computed_tokens < req.num_tokens:
        assert m.allocate_slots(req, 64) is not None
        req.num_computed_tokens += 64
        assert sum(1 for b in m.get_blocks("r").blocks[1] if not b.is_null) <= 13
        m.check_invariants()
    # one block less and the gate refuses it (never admitted, nothing allocated)
    small = KVCacheManager(config([fa(16), swa(16, 128)], num_blocks=64 + 13, max_in_flight_tokens=64,
                                  max_model_len=1024))
    req2 = Request("r2", list(range(1024)))
    assert small.allocate_slots(req2, 64, full_sequence_must_fit=True) is None
    assert small.get_num_free_blocks() == 64 + 12


def test_full_attention_is_still_gated_by_the_whole_sequence():
    m = KVCacheManager(config([fa(16)], num_blocks=10, max_model_len=1024))
    req = Request("r", list(range(160)))  # 10 blocks > 9 usable
    assert m.allocate_slots(req, 16, full_sequence_must_fit=True) is None
    assert m.allocate_slots(req, 16) is not None  # without the gate one chunk fits


def test_watermark_applies_only_to_waiting_requests_with_others_scheduled():
    m = KVCacheManager(config([fa(4)], num_blocks=11, watermark=0.2))  # 2 blocks of headroom
    assert m.watermark_blocks == 2
    req = Request("r", list(range(36)))  # 9 blocks, 10 free
    assert m.allocate_slots(req, 36, has_scheduled_reqs=True) is None
    assert m.allocate_slots(req, 36, has_scheduled_reqs=False) is not None


def test_reserved_blocks_constrain_the_current_chunk():
    m = KVCacheManager(config([fa(4)], num_blocks=11))
    req = Request("r", list(range(40)))
    assert m.allocate_slots(req, 16, reserved_blocks=7) is None
    assert m.allocate_slots(req, 16, reserved_blocks=6) is not None


def test_lookahead_tokens_get_slots_but_are_not_cached():
    m = KVCacheManager(config([fa(4)], num_blocks=11))
    req = Request("r", list(range(8)))
    out = m.allocate_slots(req, 8, num_lookahead_tokens=3)
    assert out.get_block_ids() == ([1, 2, 3],)
    assert m.block_pool.blocks[3].block_hash is None and m.block_pool.blocks[2].block_hash is not None


def test_delay_cache_blocks_skips_publishing():
    m = KVCacheManager(config([fa(4)], num_blocks=11))
    req = Request("r", list(range(8)))
    m.allocate_slots(req, 8, delay_cache_blocks=True)
    assert all(b.block_hash is None for b in m.block_pool.blocks)


# ----------------------------------------------------------------------------- hybrid


def test_hybrid_hit_alignment_fa32_swa16_hash16():
    """FA blocks of 32 and SWA blocks of 16 hashed at 16: 4 vs 7 blocks for 100 tokens; a resend
    hits 96 tokens (multiple of the scheduler block 32); FA's prompt tail at 96 is a partial key."""
    m = KVCacheManager(config([fa(32), swa(16, 32)], num_blocks=40))
    a = Request("a", list(range(100)))
    admit(m, a)
    assert [len(ids) for ids in m.get_block_ids("a")] == [4, 7]
    # only whole scheduler blocks (32) are published: FA blocks 0-2, SWA blocks 0-5
    assert [b.block_hash is not None for b in m.get_blocks("a").blocks[0]] == [True] * 3 + [False]
    b = Request("b", list(range(100)))
    hits, n, _ = m.get_computed_blocks(b)
    assert n == 96 and len(hits.blocks[0]) == 3 and len(hits.blocks[1]) == 6
    assert hits.blocks[1][0].is_null  # SWA only needs the window: leading nulls


def test_two_phase_hits_before_external_blocks():
    """vLLM #33775: group 0's allocation for external tokens must not evict group 1's hits that
    sit at the front of the free queue."""
    m = KVCacheManager(config([fa(4), swa(4, 5)], num_blocks=9))
    a = Request("a", list(range(9)))
    admit(m, a)
    m.free(a)
    b = Request("b", list(range(9)) + [1] * 7)
    hits, n, _ = m.get_computed_blocks(b)
    assert n == 8
    hit_ids = hits.get_block_ids()
    out = m.allocate_slots(b, 4, n, hits, num_external_computed_tokens=4)
    assert out is not None
    table = m.get_block_ids("b")
    assert table[0][:2] == list(hit_ids[0])  # full attention keeps both hits
    # SWA skips what lies before the window of 12 tokens (2 blocks) and keeps the rest
    assert table[1][:2] == [0, 0] and table[1][2:len(hit_ids[1])] == list(hit_ids[1][2:])
    for bid in table[0][:2] + table[1][2:len(hit_ids[1])]:
        assert m.block_pool.blocks[bid].block_hash is not None  # never evicted by the new blocks
    assert len(set(table[0]) | set(table[1]) - {0}) == len([x for t in table for x in t if x])
    m.check_invariants()


def test_eagle_drops_the_last_hit_block():
    m = KVCacheManager(config([fa(4)], num_blocks=20, use_eagle=True))
    admit(m, Request("a", list(range(17))))
    hits, n, _ = m.get_computed_blocks(Request("b", list(range(17))))
    assert n == 12 and len(hits.blocks[0]) == 3  # 16 cached tokens, one block dropped


def test_cache_salt_isolates_prefixes():
    m = KVCacheManager(config([fa(4)], num_blocks=20))
    admit(m, Request("a", list(range(9)), cache_salt="x"))
    assert m.get_computed_blocks(Request("b", list(range(9))))[1] == 0
    assert m.get_computed_blocks(Request("c", list(range(9)), cache_salt="x"))[1] == 8


# ----------------------------------------------------------------------------- other specs


def test_mamba_none_mode_keeps_one_state_plus_speculative_blocks():
    m = KVCacheManager(config([mamba(4, "none", spec_blocks=1)], num_blocks=10, caching=False))
    req = Request("r", list(range(8)))
    out, _ = admit(m, req)
    assert out.get_block_ids() == ([1, 2, 3],)  # 2 blocks + 1 speculative
    req.output_token_ids.append(1)
    m.allocate_slots(req, 1)  # skipped = 8 - 1 = 7 tokens -> block 1 freed, then reused first
    assert m.get_block_ids("r") == ([0, 2, 3, 1],)
    m.check_invariants()


def test_mamba_align_defers_a_hit_on_a_state_cached_this_step():
    m = KVCacheManager(config([fa(4), mamba(4)], num_blocks=30))
    admit(m, Request("a", list(range(8))))  # Mamba table [null, state]: the state at 8 is cached
    b = Request("b", list(range(9)) + [5])
    hits, n, _ = m.get_computed_blocks(b)
    assert n == 8
    assert m.allocate_slots(b, b.num_tokens - n, n, hits) is None  # same-step guard
    m.new_step_starts()
    assert m.allocate_slots(b, b.num_tokens - n, n, hits) is not None
    m.check_invariants()


def test_cross_attention_is_sized_by_encoder_tokens():
    m = KVCacheManager(config([fa(4), cross(4)], num_blocks=20, caching=False))
    req = Request("r", list(range(5)))
    out = m.allocate_slots(req, 5, num_encoder_tokens=10)
    assert out.get_block_ids() == ([1, 2], [3, 4, 5])


def test_usage_and_reset_prefix_cache():
    m = KVCacheManager(config([fa(4)], num_blocks=11))
    req = Request("r", list(range(8)))
    admit(m, req)
    assert m.usage == pytest.approx(0.2)
    assert m.reset_prefix_cache() is False
    m.free(req)
    assert m.usage == 0.0 and m.reset_prefix_cache() is True
    assert m.get_computed_blocks(Request("s", list(range(8))))[1] == 0


def test_no_prefix_cache_coordinator_never_hits():
    m = KVCacheManager(config([fa(4), swa(4, 8)], num_blocks=20, caching=False))
    admit(m, Request("a", list(range(9))))
    hits, n, _ = m.get_computed_blocks(Request("b", list(range(9))))
    assert n == 0 and hits is m.empty_kv_cache_blocks
    assert all(b.block_hash is None for b in m.block_pool.blocks)


def test_get_num_blocks_to_allocate_counts_evictable_hits_once():
    """Digest §10.1 (test_get_num_blocks_to_allocate): 20 blocks needed; 10 ref-0 hits -> 10 new
    + 10 evictable; 5 null + 5 ref-0 hits -> 10 new + 5 evictable."""
    pool = BlockPool(100, True, 4)
    manager = SlidingWindowManager(swa(4, 128), block_pool=pool, enable_caching=True,
                                   kv_cache_group_id=0, scheduler_block_size=4)
    hits = pool.blocks[1:11]
    assert manager.get_num_blocks_to_allocate("r", 80, hits, 40, 40, 80) == 20
    mixed = [pool.null_block] * 5 + pool.blocks[11:16]
    assert manager.get_num_blocks_to_allocate("r", 80, mixed, 40, 40, 80) == 15


def test_kv_cache_blocks_ids_and_equality():
    pool = BlockPool(4, True, 4)
    blocks = KVCacheBlocks(([pool.blocks[1], pool.blocks[2]], []))
    assert blocks.get_block_ids() == ([1, 2], [])
    assert blocks == KVCacheBlocks(([pool.blocks[1], pool.blocks[2]], []))


def test_fa_prompt_tail_becomes_a_secondary_key_in_hybrid_models():
    """FA blocks of 32 hashed at 16: the prompt's last hash boundary (80) ends inside FA block 2;
    once that block is full and cached (after decoding to 96), the boundary is a secondary key."""
    m = KVCacheManager(config([fa(32), swa(16, 32)], num_blocks=40))
    a = Request("a", list(range(90)))
    admit(m, a)
    while a.num_computed_tokens < 96:
        a.output_token_ids.append(1)
        assert m.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
    block = m.get_blocks("a").blocks[0][2]
    assert block.block_hash_num_tokens == 96
    secondary = m.block_pool.cached_block_hashes_by_block[block.block_id]
    assert secondary == {m.block_hashes(a)[4] + (0).to_bytes(4, "big")}
    m.check_invariants()


# ----------------------------------------------------------------------------- M3 property


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.conftest import profile_examples  # noqa: E402


@st.composite
def _small_configs(draw):
    kinds = draw(st.lists(st.sampled_from(["fa", "swa", "local"]), min_size=1, max_size=3))
    bs = draw(st.sampled_from([2, 4]))
    specs = []
    for k in kinds:
        if k == "fa":
            specs.append(fa(bs))
        elif k == "swa":
            specs.append(swa(bs, draw(st.integers(1, 12))))
        else:
            specs.append(local(bs, bs * draw(st.integers(1, 3))))
    return config(specs, num_blocks=draw(st.integers(4, 40)), caching=draw(st.booleans()),
                  max_model_len=64, max_in_flight_tokens=draw(st.sampled_from([None, 4])))


@settings(max_examples=profile_examples(30, 120), deadline=None)
@given(cfg=_small_configs(), data=st.data())
def test_predictor_equals_allocator(cfg, data):
    """M3: after ``allocate_slots`` succeeds, the free queue shrank by exactly the number
    ``get_num_blocks_to_allocate`` predicted (new blocks + touched evictable hits); otherwise
    ``get_new_blocks`` could fail mid-allocation (vLLM PR #40027)."""
    m = KVCacheManager(cfg)
    pool = m.block_pool
    seen: list[tuple[int, int]] = []
    predict = m.coordinator.get_num_blocks_to_allocate

    def recording(*args, **kwargs):
        need = predict(*args, **kwargs)
        if not kwargs.get("apply_admission_cap"):
            seen.append((need, pool.get_num_free_blocks()))
        return need

    m.coordinator.get_num_blocks_to_allocate = recording
    live: list[Request] = []
    for i in range(data.draw(st.integers(3, 25))):
        if live and data.draw(st.booleans()):
            req = data.draw(st.sampled_from(live))
            if req.num_computed_tokens >= req.num_tokens:
                if req.num_tokens >= 60:
                    m.free(req)
                    live.remove(req)
                    continue
                req.output_token_ids.append(data.draw(st.integers(0, 2)))
            num_new = min(req.num_tokens - req.num_computed_tokens, data.draw(st.integers(1, 8)))
            seen.clear()
            if m.allocate_slots(req, num_new, num_lookahead_tokens=data.draw(st.integers(0, 2))) is not None:
                need, free_then = seen[-1]
                assert free_then - pool.get_num_free_blocks() == need
                req.num_computed_tokens += num_new
            elif data.draw(st.booleans()):
                m.free(req)
                live.remove(req)
        else:
            req = Request(f"r{i}", [data.draw(st.integers(0, 1)) for _ in range(data.draw(st.integers(1, 30)))])
            hits, n, _ = m.get_computed_blocks(req)
            sbs = cfg.scheduler_block_size
            external = data.draw(st.sampled_from([0, 0, sbs]))
            if n + external >= req.num_tokens:
                external = 0
            num_new = min(req.num_tokens - n - external, data.draw(st.integers(1, 16)))
            seen.clear()
            if m.allocate_slots(req, num_new, n, hits, num_external_computed_tokens=external) is not None:
                need, free_then = seen[-1]
                assert free_then - pool.get_num_free_blocks() == need
                req.num_computed_tokens = n + external + num_new
                live.append(req)
        m.check_invariants()
