"""Conformance of kvref's offload reference against vLLM 0.33.0's own classes.

* ``CPUOffloadingManager`` (LRU and ARC): generated traces of stores, completions (late, out of
  order, failed), loads, touches, request finishes and resets; after every call the outputs
  (chunk ids, evictions, lookups, events) and the whole resident state must agree.
* The lookup primitives of ``OffloadingConnectorScheduler`` (maximal prefix, sliding window)
  and ``get_sliding_window_size_in_chunks`` on generated inputs.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvref.impl.reference.offload import keys as rkeys
from kvref.impl.reference.offload.cpu_offloading_manager import CPUOffloadingManager
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

NUM_HASHES = 8
KEYS = [rkeys.make_offload_key(bytes([h]) * 4, g) for h in range(NUM_HASHES) for g in range(2)]


@pytest.fixture(scope="module")
def V():
    require_vllm()
    from vllm.v1.kv_offload import base
    from vllm.v1.kv_offload.cpu import manager

    return type("V", (), {"base": base, "manager": manager})


# --------------------------------------------------------------------------------------------
# CPUOffloadingManager


@st.composite
def manager_ops(draw):
    """A trace over a small key universe (small so ghosts, re-stores and evictions recur)."""
    nkeys = draw(st.integers(2, len(KEYS)))
    op = st.tuples(
        st.sampled_from(["store", "store", "store", "complete", "complete", "load", "load", "unload", "touch",
                         "finish", "finish", "reset"]),
        st.integers(0, 3),  # request slot
        st.lists(st.integers(0, nkeys - 1), min_size=1, max_size=6),  # key indices
        st.integers(0, 10**6),  # job pick
        st.sampled_from([True, True, True, False]))  # success flag for completions
    return draw(st.lists(op, min_size=3, max_size=50))


OPS = manager_ops()


def _vstate(vm):
    pol = vm._policy
    if hasattr(pol, "chunks"):
        items = pol.chunks.items()
    else:
        items = list(pol.t1.items()) + list(pol.t2.items())
    return {k: (c.chunk_id, c.ref_cnt) for k, c in items}


def _vevents(vm):
    return [(list(e.keys), e.removed, e.metadata_only) for e in vm.take_events()]


def _run_manager_trace(V, policy, num_chunks, threshold, positions_seed, ops):
    ref = CPUOffloadingManager(num_chunks, policy, enable_events=True, store_threshold=threshold,
                               max_tracker_size=6)
    vm = V.manager.CPUOffloadingManager(num_chunks, cache_policy=policy, enable_events=True,
                                        store_threshold=threshold, max_tracker_size=6)
    gen = [0] * 4
    rctx, vctx = {}, {}

    def ctx(slot):
        if slot not in rctx:
            rid = f"r{slot}.{gen[slot]}"
            rctx[slot], vctx[slot] = rkeys.RequestContext(rid), V.base.ReqContext(rid)
            # Positions for some keys (policies order a request's keys head-to-tail by them).
            for i, k in enumerate(KEYS):
                if (i * 7 + slot + positions_seed) % 3:
                    p = 16 * (1 + (i * 5 + positions_seed) % NUM_HASHES)
                    rctx[slot].set_offload_key_position(k, p)
                    vctx[slot].set_offload_key_position(k, p)
            ref.on_new_request(rctx[slot])
            vm.on_new_request(vctx[slot])
        return rctx[slot], vctx[slot]

    stores: list[list[bytes]] = []  # outstanding store jobs (keys)
    loads: list[list[bytes]] = []  # outstanding load jobs
    for op, slot, idxs, pick, flag in ops:
        keys = [KEYS[i] for i in idxs]
        if op == "store":
            keys = list(dict.fromkeys(keys))
            rc, vc = ctx(slot)
            out_r = ref.prepare_store(keys, rc)
            out_v = vm.prepare_store(keys, vc)
            assert (out_r is None) == (out_v is None), (op, keys)
            if out_r is not None:
                assert out_r.keys_to_store == list(out_v.keys_to_store)
                assert out_r.chunk_ids == [int(x) for x in out_v.store_spec.block_ids]
                assert out_r.evicted_keys == list(out_v.evicted_keys)
                if out_r.keys_to_store:
                    stores.append(out_r.keys_to_store)
        elif op == "complete" and stores:
            job = stores.pop(pick % len(stores))
            ref.complete_store(job, None, success=flag)
            vm.complete_store(job, None, success=flag)
        elif op == "load":
            rc, vc = ctx(slot)
            ready = [k for k in dict.fromkeys(keys) if ref.lookup(k) is rkeys.LookupResult.HIT]
            if ready:
                assert ref.prepare_load(ready, rc) == [int(x) for x in vm.prepare_load(ready, vc).block_ids]
                loads.append(ready)
        elif op == "unload" and loads:
            job = loads.pop(pick % len(loads))
            ref.complete_load(job)
            vm.complete_load(job, None)
        elif op == "touch":
            rc, vc = ctx(slot)
            ref.touch(keys, rc)
            vm.touch(keys, vc)
        elif op == "finish" and slot in rctx:
            ref.on_request_finished(rctx[slot])
            vm.on_request_finished(vctx[slot])
            del rctx[slot], vctx[slot]
            gen[slot] += 1
        elif op == "reset":
            ref.reset_cache()
            vm.reset_cache()
            stores.clear()
            loads.clear()
        ref.check_invariants()
        assert ref.chunk_state() == _vstate(vm), op
        assert [(e.keys, e.removed, e.metadata_only) for e in ref.take_events()] == _vevents(vm), op
        for k in KEYS:
            assert ref.lookup(k).name == vm.lookup(k, None).name
    # The eviction order must agree too: evict everything that is evictable, one at a time.
    for _ in range(ref.num_evictable):
        a, b = ref.policy.evict(1, set()), vm._policy.evict(1, set())
        assert [k for k, _ in a] == [k for k, _ in b]


ARC_GHOST_TRACE = [  # reuse -> T2, evict from T1 to a B1 ghost, re-offer the ghost (target grows), evict again
    ("store", 0, [0, 1], 0, True), ("complete", 0, [0], 0, True), ("load", 1, [1], 0, True),
    ("unload", 1, [0], 0, True), ("finish", 1, [0], 0, True), ("store", 2, [2], 0, True),
    ("complete", 2, [0], 0, True), ("store", 3, [0], 0, True), ("complete", 3, [0], 0, True)]


@settings(max_examples=profile_examples(60, 300))
@example(policy="arc", num_chunks=2, threshold=1, positions_seed=0, ops=ARC_GHOST_TRACE)
@given(policy=st.sampled_from(["lru", "arc"]), num_chunks=st.integers(1, 6), threshold=st.sampled_from([1, 1, 2]),
       positions_seed=st.integers(0, 5), ops=OPS)
def test_cpu_offloading_manager_matches_vllm(V, policy, num_chunks, threshold, positions_seed, ops):
    _run_manager_trace(V, policy, num_chunks, threshold, positions_seed, ops)


# --------------------------------------------------------------------------------------------
# Lookup primitives of OffloadingConnectorScheduler

from kvref.impl.reference.offload import lookup as rlookup  # noqa: E402

RESULTS = ["HIT", "HIT", "HIT", "HIT", "MISS", "HIT_PENDING", "RETRY"]


@st.composite
def lookup_cases(draw):
    tokens_per_hash = 4
    groups = []
    pool = draw(st.sampled_from([["HIT"] * 12 + ["MISS"], ["HIT"] * 6 + ["MISS", "HIT_PENDING"], RESULTS]))
    for _ in range(draw(st.integers(1, 4))):
        tpc = tokens_per_hash * draw(st.sampled_from([1, 2, 4]))
        kind = draw(st.sampled_from(["fa", "sw", "sw", "sw", "local"]))
        if kind == "fa":
            groups.append(("fa", tpc, None, 0))
        elif kind == "sw":
            groups.append(("sw", tpc, draw(st.integers(1, 24)), draw(st.sampled_from([0, 0, 3]))))
        else:
            groups.append(("local", tpc, draw(st.sampled_from([4, 8, 16, 32])), 0))
    num_tokens = draw(st.integers(1, 96))
    num_computed = tokens_per_hash * draw(st.integers(0, num_tokens // tokens_per_hash))
    status = {}
    keys = []
    for gi, (_, tpc, _, _) in enumerate(groups):
        ks = [rkeys.make_offload_key(f"h{(j + 1) * tpc}".encode(), gi) for j in range(num_tokens // tpc)]
        keys.append(ks)
        for k in ks:
            status[k] = draw(st.sampled_from(pool))
    loading = set(draw(st.lists(st.sampled_from([k for ks in keys for k in ks]), max_size=2))) \
        if any(keys) and draw(st.booleans()) else None
    max_new = draw(st.one_of(st.none(), st.integers(0, 64)))
    return groups, num_tokens, num_computed, keys, status, loading, max_new


def _vllm_lookup(V2, groups, num_tokens, num_computed, keys, status, loading, max_new):
    import torch
    from types import SimpleNamespace

    spec_kw = dict(num_kv_heads=1, head_size=1, dtype=torch.float32)
    cfgs = []
    for gi, (kind, tpc, w, extra) in enumerate(groups):
        if kind == "fa":
            spec, win = V2.FullAttentionSpec(block_size=tpc, **spec_kw), None
        elif kind == "sw":
            spec = V2.SlidingWindowSpec(block_size=tpc, sliding_window=w, extra_retained_tokens=extra, **spec_kw)
            win = V2.get_sliding_window_size_in_chunks(spec, tpc)
        else:
            spec = V2.ChunkedLocalAttentionSpec(block_size=tpc, attention_chunk_size=w, **spec_kw)
            win = V2.get_sliding_window_size_in_chunks(spec, tpc)
        cfgs.append(V2.GroupOffloadConfig(group_idx=gi, tokens_per_block=tpc, tokens_per_chunk=tpc,
                                          hashes_per_chunk=tpc // 4, kv_event_group_spec=None,
                                          sliding_window_size_in_chunks=win, kv_cache_spec=spec,
                                          manager_cls=None))
    s = object.__new__(V2.OffloadingConnectorScheduler)
    s.config = SimpleNamespace(kv_group_configs=tuple(cfgs))
    fa = [i for i, c in enumerate(cfgs) if c.sliding_window_size_in_chunks is None]
    sw = sorted((i for i, c in enumerate(cfgs) if c.sliding_window_size_in_chunks is not None),
                key=lambda i: cfgs[i].sliding_window_size_in_chunks, reverse=True)
    s._full_attention_groups, s._sliding_window_groups = tuple(fa), tuple(sw)
    s._lookup_groups = tuple(fa) + tuple(sw)
    s._mamba_align_size = None
    s._chunks_being_loaded = set(loading) if loading is not None else None
    s._events_tracker = SimpleNamespace(record_lookup=lambda *a: None)
    R = V2.LookupResult
    s.manager = SimpleNamespace(lookup=lambda k, ctx: getattr(R, status[k]))
    req_status = SimpleNamespace(
        num_locally_computed_tokens=num_computed, req=SimpleNamespace(num_tokens=num_tokens, request_id="r"),
        max_load_tokens=None, req_context=None,
        group_states=[SimpleNamespace(offload_keys=list(ks), lookup_hit_end_chunk_idx=0) for ks in keys])
    return s._lookup_complete_chunks(req_status, max_new), cfgs


@pytest.fixture(scope="module")
def V2():
    require_vllm()
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import config as oc
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler as osch
    from vllm.v1 import kv_cache_interface as kvi
    from vllm.v1.kv_offload.base import LookupResult

    return type("V2", (), dict(
        OffloadingConnectorScheduler=osch.OffloadingConnectorScheduler, GroupOffloadConfig=osch.GroupOffloadConfig,
        get_sliding_window_size_in_chunks=staticmethod(oc.get_sliding_window_size_in_chunks),
        LookupResult=LookupResult, FullAttentionSpec=kvi.FullAttentionSpec,
        SlidingWindowSpec=kvi.SlidingWindowSpec, ChunkedLocalAttentionSpec=kvi.ChunkedLocalAttentionSpec))


def _ref_groups(groups, cfgs):
    out = []
    for (kind, tpc, w, extra), c in zip(groups, cfgs):
        out.append(rlookup.LookupGroup(tpc, c.sliding_window_size_in_chunks,
                                       w if kind == "sw" else None, extra if kind == "sw" else 0))
    return out


def _case(groups, num_tokens, rows):
    keys = [[rkeys.make_offload_key(f"h{(j + 1) * tpc}".encode(), gi) for j in range(num_tokens // tpc)]
            for gi, (_, tpc, _, _) in enumerate(groups)]
    names = {"H": "HIT", "M": "MISS", "P": "HIT_PENDING", "R": "RETRY"}
    status = {k: names[c] for ks, row in zip(keys, rows) for k, c in zip(ks, row.split())}
    return groups, num_tokens, 0, keys, status, None, None


# A later, narrower window shrinks the boundary; the wider window must be re-checked there (vLLM PR #41228).
FIXED_POINT_RECHECK = _case([("sw", 4, 8, 0), ("sw", 4, 4, 0)], 33, ["H H M H H M H H", "H H H H H H M M"])
# A pending chunk past the final boundary must not defer the request.
DEFER_DROPPED = _case([("fa", 4, None, 0), ("sw", 4, 4, 0)], 33, ["H H H H H P H H", "H H M M M M M M"])


@settings(max_examples=profile_examples(150, 800))
@example(case=FIXED_POINT_RECHECK)
@example(case=DEFER_DROPPED)
@given(case=lookup_cases())
def test_lookup_complete_chunks_matches_vllm(V2, case):
    groups, num_tokens, num_computed, keys, status, loading, max_new = case
    expected, cfgs = _vllm_lookup(V2, *case)
    got = rlookup.lookup_complete_chunks(_ref_groups(groups, cfgs), keys, num_tokens, num_computed,
                                         lambda k: getattr(rkeys.LookupResult, status[k]),
                                         set(loading) if loading is not None else None, max_new)
    assert got == expected


@settings(max_examples=profile_examples(150, 600))
@given(results=st.lists(st.sampled_from(RESULTS), max_size=12), window=st.integers(1, 5),
       initial=st.one_of(st.none(), st.integers(1, 7)))
def test_sliding_window_and_prefix_lookup_match_vllm(V2, results, window, initial):
    from types import SimpleNamespace

    keys = [bytes([i]) * 5 for i in range(len(results))]
    status = dict(zip(keys, results))
    s = object.__new__(V2.OffloadingConnectorScheduler)
    s.manager = SimpleNamespace(lookup=lambda k, ctx: getattr(V2.LookupResult, status[k]))
    s._events_tracker = SimpleNamespace(record_lookup=lambda *a: None)
    ref = lambda k: getattr(rkeys.LookupResult, status[k])  # noqa: E731
    assert rlookup.sliding_window_lookup(keys, window, ref, initial) == \
        s._sliding_window_lookup(keys, window, None, initial)
    assert rlookup.maximal_prefix_lookup(keys, ref) == s._maximal_prefix_lookup(keys, None, None, None, 0)


@settings(max_examples=profile_examples(100, 300))
@given(kind=st.sampled_from(["fa", "sw", "local"]), w=st.integers(1, 200), extra=st.integers(0, 8),
       tpc=st.integers(1, 64))
def test_sliding_window_size_in_chunks_matches_vllm(V2, kind, w, extra, tpc):
    import torch

    from kvref.spec import kv_cache_interface as ours

    kw = dict(num_kv_heads=1, head_size=1)
    if kind == "fa":
        v, r = V2.FullAttentionSpec(block_size=16, dtype=torch.float32, **kw), \
            ours.FullAttentionSpec(block_size=16, dtype="float32", **kw)
    elif kind == "sw":
        v = V2.SlidingWindowSpec(block_size=16, dtype=torch.float32, sliding_window=w, extra_retained_tokens=extra, **kw)
        r = ours.SlidingWindowSpec(block_size=16, dtype="float32", sliding_window=w, extra_retained_tokens=extra, **kw)
    else:
        v = V2.ChunkedLocalAttentionSpec(block_size=16, dtype=torch.float32, attention_chunk_size=w, **kw)
        r = ours.ChunkedLocalAttentionSpec(block_size=16, dtype="float32", attention_chunk_size=w, **kw)
    assert rkeys.get_sliding_window_size_in_chunks(r, tpc) == V2.get_sliding_window_size_in_chunks(v, tpc)


# --------------------------------------------------------------------------------------------
# SimpleCPUOffloadScheduler (bound to a GPU block pool) on generated engine traces

from kvref.models.offload.simple_cpu_world import SimpleOffloadConfig, SimpleOffloadWorld  # noqa: E402
from kvref.models.offload.traces import (  # noqa: E402
    FA_ONLY,
    PR42903,
    apply_offloading_op,
    apply_op,
    pre_fix_41289_trace,
    random_ops,
    run_pr42903,
)

@st.composite
def simple_offload_cases(draw):
    cfg = SimpleOffloadConfig(
        block_size=4, num_gpu_blocks=draw(st.integers(8, 16)), num_cpu_blocks=draw(st.sampled_from([40, 24, 40, 8, 3, 1])),
        sliding_window=draw(st.sampled_from([None, None, 4, 8, 12])), lazy=draw(st.booleans()),
        world_size=draw(st.integers(1, 2)), max_num_batched_tokens=draw(st.sampled_from([8, 16])))
    return cfg, random_ops(draw(st.randoms(use_true_random=True)), draw(st.integers(30, 70)))


@settings(max_examples=profile_examples(40, 150))
@given(case=simple_offload_cases())
def test_simple_cpu_offload_scheduler_matches_vllm(V, case):
    cfg, ops = case
    ref = SimpleOffloadWorld(cfg, "reference", check_no_double_store=False)
    vll = SimpleOffloadWorld(cfg, "vllm", check_no_double_store=False)
    for op in ops:
        assert apply_op(ref, op) == apply_op(vll, op), op
        assert ref.observe() == vll.observe(), op
    assert ref.metas == vll.metas
    assert ref.duplicate_stores == vll.duplicate_stores


def test_pr42903_trace_on_vllm(V):
    """Open vLLM PR 42903 asks whether 0.33.0 can still store one GPU block twice within one request's
    scan. It can: the trace below (docs/offload.md) makes vLLM 0.33.0 itself issue store event 1 with
    GPU block 5 twice; the reference agrees call for call."""
    vll = run_pr42903(SimpleOffloadWorld(PR42903, "vllm", check_no_double_store=False))
    ref = run_pr42903(SimpleOffloadWorld(PR42903, "reference", check_no_double_store=False))
    assert vll.metas[2][3:6] == (1, [7, 5, 6, 5], [1, 2, 3, 4])
    assert vll.duplicate_stores == ref.duplicate_stores == [(1, 5)]
    assert vll.metas == ref.metas and vll.observe() == ref.observe()


def test_pre_41289_trace_is_deduplicated_by_vllm(V):
    w = SimpleOffloadWorld(FA_ONLY, "vllm")
    pre_fix_41289_trace(w)  # would raise OffloadInvariantError on a duplicate store
    assert w.duplicate_stores == [] and sorted(w.b.in_flight_set()) == [1, 2, 3]


# --------------------------------------------------------------------------------------------
# OffloadingConnectorScheduler + CPUOffloadingManager on generated engine traces

from kvref.models.offload.offloading_connector_world import OffloadingConfig, OffloadingWorld  # noqa: E402


@st.composite
def offloading_cases(draw):
    cfg = OffloadingConfig(
        block_size=4, blocks_per_chunk=draw(st.sampled_from([1, 1, 2])), num_gpu_blocks=draw(st.integers(10, 18)),
        num_cpu_chunks=draw(st.sampled_from([16, 6, 32, 2])), sliding_window=draw(st.sampled_from([None, 4, 8, 12])),
        cache_policy=draw(st.sampled_from(["lru", "arc"])), num_workers=draw(st.integers(1, 2)),
        offload_prompt_only=draw(st.booleans()))
    return cfg, random_ops(draw(st.randoms(use_true_random=True)), draw(st.integers(30, 70)))


@settings(max_examples=profile_examples(40, 150))
@given(case=offloading_cases())
def test_offloading_connector_scheduler_matches_vllm(V, case):
    cfg, ops = case
    ref, vll = OffloadingWorld(cfg, "reference", strict=False), OffloadingWorld(cfg, "vllm", strict=False)
    for op in ops:
        got = apply_offloading_op(ref, op)
        try:
            want = apply_offloading_op(vll, op)
        except KeyError:
            # vLLM 0.33.0 crashes completing a job that lists a fenced block twice (docs/offload.md,
            # "KeyError after a connector reset"); the reference finishes it. Nothing to compare after.
            assert any(len(set(b)) < len(b) for m in ref.metas for _, _, _, b, _ in m[1])
            return
        assert got == want, op
        assert ref.observe() == vll.observe(), op
        assert ref.violations == vll.violations


# A connector reset while a sliding-window request runs: its stored-chunk cursor restarts at 0 but
# its copy of the block table still holds a block that left the window and was re-allocated to a
# later slot, so one store job reads that block twice (for the wrong chunk, too), and vLLM's
# completion path raises KeyError in _remove_pending_job.
RESET_SWA_CFG = OffloadingConfig(block_size=4, blocks_per_chunk=2, num_gpu_blocks=12, num_cpu_chunks=32,
                                 sliding_window=4, num_workers=2)
RESET_SWA_OPS = [("add", 0, 20, 2, 0, 1, 0, 1, False), ("add", 2, 13, 1, 0, 1, 0, 1, False),
                 ("step", 0, 0, 0, 8, 2, 0, 1, False), ("reset", 0, 0, 0, 0, 1, 0, 1, False),
                 ("abort", 0, 0, 0, 0, 1, 0, 1, False), ("step", 0, 0, 0, 4, 1, 0, 1, False)]


RESET_CORRUPT_CFG = OffloadingConfig(block_size=4, num_gpu_blocks=20, num_cpu_chunks=16, sliding_window=12,
                                     num_workers=2, offload_prompt_only=False)
RESET_CORRUPT_OPS = [("add", 0, 20, 1, 0, 1, 0, 1, False), ("step", 0, 0, 0, 12, 1, 0, 1, False),
                     ("add", 0, 30, 2, 0, 1, 0, 1, False), ("step", 0, 0, 0, 8, 3, 0, 1, False),
                     ("reset", 0, 0, 0, 0, 1, 0, 1, False), ("abort", 0, 0, 0, 0, 1, 1, 1, False),
                     ("step", 0, 0, 0, 4, 1, 0, 1, False)]


def test_reset_with_running_swa_request_crashes_vllm_not_the_reference(V):
    ref, vll = OffloadingWorld(RESET_SWA_CFG, "reference"), OffloadingWorld(RESET_SWA_CFG, "vllm")
    for op in RESET_SWA_OPS:
        assert apply_offloading_op(ref, op) == apply_offloading_op(vll, op)
    job = [j for j in vll.metas[-1][1] if j[1] == "r0"][0]
    assert job[3] == [1, 2, 9, 10, 3, 4, 11, 3]  # block 3: SW slot 0 (stale) and SW slot 3
    with pytest.raises(KeyError):
        while vll.jobs:
            vll.complete(0, 2)
    # The same reset makes vLLM store another request's block under a chunk key (KV corruption).
    ref2, vll2 = (OffloadingWorld(RESET_CORRUPT_CFG, b, strict=False) for b in ("reference", "vllm"))
    for op in RESET_CORRUPT_OPS:
        assert apply_offloading_op(ref2, op) == apply_offloading_op(vll2, op)
    assert vll2.violations == ref2.violations
    assert "store job 4 reads GPU block 5, which holds ('partial', 'r1', 1, 8)" in vll2.violations[0]
    while ref.jobs:
        ref.complete(0, 2)
    ref.b.check_invariants()
    assert ref.b.conn._block_id_to_pending_jobs == {} and ref.b.conn._jobs == {}
