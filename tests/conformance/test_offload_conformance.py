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
