"""The explorer over the SimpleCPU offload path: transfer completions in every order."""

from __future__ import annotations

import pytest

from kvref.models.explorer_offload import OFFLOAD_SCOPES, OffloadScope, OffloadSystem, explore_offload
from kvref.models.mutants_catalogue import CATALOGUE


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
    from kvref.models.explorer import explore

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
