"""CPU offloading manager: chunk life cycle, all-or-nothing eviction, bad input."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvref.impl.reference.offload.cpu_offloading_manager import CPUOffloadingManager
from kvref.impl.reference.offload.keys import (
    LookupResult,
    OffloadStateError,
    RequestContext,
    make_offload_key,
)
from kvref.spec.errors import InvalidFieldError, KVRefError
from tests.conftest import profile_examples

K = [make_offload_key(bytes([i]) * 8, 0) for i in range(10)]


def ctx(name="r"):
    return RequestContext(name)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_write_pending_chunk_is_not_readable_until_store_completes(policy):
    m = CPUOffloadingManager(4, policy)
    out = m.prepare_store(K[:2], ctx())
    assert out.keys_to_store == K[:2] and out.chunk_ids == [0, 1] and out.evicted_keys == []
    assert m.lookup(K[0]) is LookupResult.HIT_PENDING
    with pytest.raises(OffloadStateError):
        m.prepare_load([K[0]], ctx())
    m.complete_store(K[:2])
    assert m.lookup(K[0]) is LookupResult.HIT
    assert m.prepare_load([K[0]], ctx()) == [0]
    m.check_invariants()


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_eviction_is_all_or_nothing_and_spares_pinned_and_offered_keys(policy):
    m = CPUOffloadingManager(2, policy)
    m.prepare_store(K[:2], ctx())
    m.complete_store(K[:2])
    m.prepare_load([K[0]], ctx())  # pinned
    before = m.chunk_state()
    # Two new keys need two evictions, only one chunk is evictable: nothing changes.
    assert m.prepare_store([K[2], K[3]], ctx()) is None
    assert m.chunk_state() == before
    # Offering K[1] (resident) with a new key: K[1] is protected, K[0] pinned -> no room.
    assert m.prepare_store([K[1], K[2]], ctx()) is None
    assert m.chunk_state() == before
    out = m.prepare_store([K[2]], ctx())
    assert out.evicted_keys == [K[1]] and out.chunk_ids == [1]
    m.check_invariants()


def test_failed_store_frees_its_chunk_and_a_late_completion_is_ignored():
    m = CPUOffloadingManager(1, "lru", enable_events=True)
    m.prepare_store([K[0]], ctx())
    m.complete_store([K[0]], success=False)
    assert m.lookup(K[0]) is LookupResult.MISS and m.num_free_chunks == 1
    m.complete_store([K[0]])  # unknown now: ignored, as in vLLM
    assert m.chunk_state() == {}
    assert [(e.removed, e.metadata_only) for e in m.take_events()] == [(True, True)]
    m.check_invariants()


def test_lru_evicts_a_requests_tail_before_its_head():
    m = CPUOffloadingManager(3, "lru")
    c = ctx()
    for i in range(3):
        c.set_offload_key_position(K[i], 16 * (i + 1))
    m.prepare_store(K[:3], c)
    m.complete_store(K[:3])
    assert m.policy.eviction_order() == [K[2], K[1], K[0]]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_capacity_must_be_positive(bad):
    with pytest.raises(InvalidFieldError, match="num_chunks"):
        CPUOffloadingManager(bad)


def test_bad_arguments_name_the_field():
    with pytest.raises(InvalidFieldError, match="cache_policy"):
        CPUOffloadingManager(2, "fifo")
    m = CPUOffloadingManager(2)
    with pytest.raises(InvalidFieldError, match="keys"):
        m.prepare_store([K[0], K[0]], ctx())
    with pytest.raises(InvalidFieldError, match="keys"):
        m.prepare_store(b"abcdef", ctx())
    with pytest.raises(InvalidFieldError, match="keys"):
        m.prepare_store(["str-key"], ctx())
    with pytest.raises(OffloadStateError, match="load pins"):
        m.complete_load([K[0]])
    assert m.chunk_state() == {}


@settings(max_examples=profile_examples(50, 200))
@given(policy=st.sampled_from(["lru", "arc"]), n=st.integers(1, 4),
       ops=st.lists(st.tuples(st.sampled_from(["store", "complete", "fail", "load", "unload", "finish", "reset"]),
                              st.lists(st.integers(0, 5), max_size=4)), max_size=40))
def test_fuzz_rejected_calls_change_nothing_and_invariants_hold(policy, n, ops):
    m = CPUOffloadingManager(n, policy)
    c = ctx()
    for op, idx in ops:
        keys = [K[i] for i in idx]
        before = (m.chunk_state(), m.num_free_chunks, m.num_evictable, m.num_write_pending)
        try:
            if op == "store":
                m.prepare_store(keys, c)
            elif op in ("complete", "fail"):
                m.complete_store(keys, success=op == "complete")
            elif op == "load":
                m.prepare_load(keys, c)
            elif op == "unload":
                m.complete_load(keys)
            elif op == "finish":
                m.on_request_finished(c)
                c = ctx(c.req_id + "'")
            else:
                m.reset_cache()
        except KVRefError:
            assert (m.chunk_state(), m.num_free_chunks, m.num_evictable, m.num_write_pending) == before
        m.check_invariants()
        # A chunk that is being written is never reported as readable.
        for k, (_, ref) in m.chunk_state().items():
            assert (m.lookup(k) is LookupResult.HIT) == (ref >= 0)
