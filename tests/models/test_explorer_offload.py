"""The explorer over the SimpleCPU offload path: transfer completions in every order."""

from __future__ import annotations

import pytest

from kvref.models.explorer.simple_cpu import OFFLOAD_SCOPES, OffloadScope, OffloadSystem, explore_offload
from kvref.models.mutants.catalogue import CATALOGUE

from tests.models.key_audit import OFFSET, explored_keys, ints


def test_reference_offload_path_is_clean_at_the_bounded_scope():
    res = explore_offload("offload")
    assert res.ok and res.states > 100
    assert res.depth == OFFLOAD_SCOPES["offload"].max_depth


def test_stores_and_loads_happen_in_the_scope():
    system = OffloadSystem(OffloadScope(max_depth=12))
    seen = {"stores": 0, "loads": 0, "partial": 0}
    check = system.check

    def counting(s):
        check(s)
        w = s[0]
        seen["stores"] += bool(w.stores)
        seen["loads"] += bool(w.loads)
        seen["partial"] += any(0 < t.reported < w.cfg.world_size for t in w.stores.values())
    system.check = counting
    from kvref.models.explorer.engine import explore

    assert explore(system, max_depth=12, check_deadlocks=False).ok
    assert seen["stores"] and seen["loads"] and seen["partial"]  # one worker reported, the other not yet


@pytest.mark.parametrize("name,text,max_len", [
    ("offload.in_flight_not_deduped", "two in-flight stores", 6),   # vLLM #41289
    ("offload.in_flight_not_drained", "in-flight set", 6),
])
def test_explorer_finds_offload_faults_with_short_traces(name, text, max_len):
    with CATALOGUE[name].applied():
        res = explore_offload("offload")
    (f,) = res.findings
    assert text in f.message and f.trace.length <= max_len


def test_bad_offload_scope_is_rejected():
    with pytest.raises(ValueError, match="world_size"):
        OffloadScope(world_size=0)
    with pytest.raises(ValueError, match="scope"):
        explore_offload("nope")


def _walk(system, actions):
    s = system.initial_states()[0]
    for a in actions:
        assert a in system.actions(s), (a, system.actions(s))
        s = system.step(s, a)
    return s


def test_the_lazy_scope_is_explored_completely_with_deadlock_checks():
    """Event ids renamed by rank make the state space finite: no depth bound is needed."""
    res = explore_offload("offload-lazy")
    assert OFFLOAD_SCOPES["offload-lazy"].max_depth is None
    assert res.complete and res.ok and res.states > 1000 and res.depth > 15


def test_event_counters_are_not_in_the_key_but_the_ids_in_use_are_by_rank():
    import pickle

    system = OffloadSystem(OFFLOAD_SCOPES["offload"])
    s = _walk(system, [("arrive", 0), ("step",), ("step",)])
    w = s[0]
    assert w.stores, "a store is in flight"
    t = pickle.loads(pickle.dumps(s))
    conn = t[0].b.conn
    conn._store_event_counter += 7  # a state that issued (and finished) more transfers before
    conn._load_event_counter += 3
    assert system.key(t) == system.key(s)
    # two stores in flight: which one a worker completed is visible (rank 0 vs rank 1)
    s2 = _walk(system, [("arrive", 0), ("arrive", 1), ("arrive", 2), ("step",), ("step",), ("step",)])
    assert len(s2[0].stores) >= 2
    a, b = system.step(s2, ("store_done", 0)), system.step(s2, ("store_done", 1))
    assert system.key(a) != system.key(b)


def test_the_key_sees_the_free_queue_order_and_ref_counts():
    import pickle

    system = OffloadSystem(OFFLOAD_SCOPES["offload"])
    s = _walk(system, [("arrive", 0), ("step",)])
    t = pickle.loads(pickle.dumps(s))
    pool = t[0].b.gpu_pool
    first = next(iter(pool.free_block_queue.iter_blocks()))
    pool.free_block_queue.remove(first)  # the same free blocks, another eviction order
    pool.free_block_queue.append(first)
    assert system.key(t) != system.key(s)
    u = pickle.loads(pickle.dumps(s))
    used = next(b for b in u[0].b.gpu_pool.blocks[1:] if b.ref_cnt > 0)
    used.ref_cnt += 1
    assert system.key(u) != system.key(s)


def test_the_key_is_the_same_for_a_copy_of_the_state():
    """Regression: renamed containers are temporaries; an id-keyed memo must not outlive them."""
    import pickle
    import random

    system = OffloadSystem(OFFLOAD_SCOPES["offload"])
    rnd = random.Random(0)
    for _ in range(40):
        s = system.initial_states()[0]
        for _ in range(8):
            acts = system.actions(s)
            if not acts:
                break
            s = system.step(s, rnd.choice(acts))
            assert system.key(s) == system.key(pickle.loads(pickle.dumps(s))) == system.key(s)


def test_event_ids_are_renamed_wherever_they_live():
    """An audit independent of the renaming's tables: with store and load ids offset by 10^7, no
    id may reach a key, and the keys are those of the system that numbers from 0."""
    from dataclasses import replace

    class Offset(OffloadSystem):
        def initial_states(self):
            (w, arrived), = super().initial_states()
            w.b.conn._store_event_counter = w.b.conn._load_event_counter = OFFSET
            return [(w, arrived)]

    scope = replace(OFFLOAD_SCOPES["offload"], max_depth=9)
    keys = {cls: explored_keys(cls(scope), scope.max_depth) for cls in (OffloadSystem, Offset)}
    assert keys[OffloadSystem] == keys[Offset]
    assert max(max(ints(k)) for k in keys[Offset]) < OFFSET
