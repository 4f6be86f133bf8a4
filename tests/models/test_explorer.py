"""The explorer engine on a toy system whose reachable states and failures are known by hand."""

from __future__ import annotations

from itertools import product

import pytest

from kvref.models.explorer.engine import explore, render_trace
from kvref.models.explorer.toy import ToyPool


def _naive_reachable(toy: ToyPool) -> set:
    """Reachable raw states by a plain DFS (independent of the engine, no symmetry)."""
    seen = set()
    stack = list(toy.initial_states())
    while stack:
        s = stack.pop()
        if s in seen:
            continue
        seen.add(s)
        stack.extend(toy.step(s, a) for a in toy.actions(s))
    return seen


def test_hold_and_wait_deadlock_is_found_with_the_shortest_trace():
    res = explore(ToyPool(num_blocks=4, needs=(3, 3)))
    assert [f.kind for f in res.findings] == ["deadlock"]
    trace = res.findings[0].trace
    # each request must hold 2 of the 4 blocks: 4 grabs is the minimum
    assert trace.length == 4
    assert trace.steps[-1].state["free"] == "0"
    assert sorted(a for a in (s.action for s in trace.steps[1:])) == [("grab", 0)] * 2 + [("grab", 1)] * 2


def test_preemption_removes_the_deadlock_and_everything_is_visited():
    toy = ToyPool(num_blocks=4, needs=(3, 3), preempt=True, symmetry=False)
    res = explore(toy, check_liveness=True)
    assert res.ok and res.complete
    assert res.states == len(_naive_reachable(toy))


@pytest.mark.parametrize("num_blocks,needs", [(5, (2, 3, 3)), (6, (3, 3, 2, 2)), (3, (1, 1, 1, 1))])
def test_state_count_matches_naive_enumeration(num_blocks, needs):
    toy = ToyPool(num_blocks=num_blocks, needs=needs, preempt=True, symmetry=False)
    res = explore(toy, stop_at_first=False, max_findings=10**6)
    assert res.states == len(_naive_reachable(toy))
    # depth: all requests done at the end; the longest shortest path grabs every block once
    assert res.ok
    assert res.depth == sum(needs) + len(needs)


@pytest.mark.parametrize("num_blocks,needs", [(5, (2, 2, 3)), (6, (3, 3, 3)), (4, (3, 3))])
def test_symmetry_reduction_keeps_verdicts_and_shrinks_the_space(num_blocks, needs):
    plain = explore(ToyPool(num_blocks, needs, preempt=False, symmetry=False), stop_at_first=False)
    sym = explore(ToyPool(num_blocks, needs, preempt=False, symmetry=True), stop_at_first=False)
    assert bool(plain.deadlocks) == bool(sym.deadlocks)
    if plain.deadlocks:
        assert plain.deadlocks[0].trace.length == sym.deadlocks[0].trace.length
    assert sym.states <= plain.states
    if len(set(needs)) < len(needs):
        assert sym.states < plain.states


def test_invariant_violation_is_reported_after_the_action_that_broke_it():
    res = explore(ToyPool(num_blocks=6, needs=(3, 3), leak=True))
    (f,) = res.findings
    assert f.kind == "violation"
    assert "blocks lost" in f.message
    assert f.trace.length == 4  # 3 grabs, then the leaking finish
    assert f.trace.steps[-1].action == ("finish", 0)


def test_livelock_is_found_when_actions_only_cycle():
    res = explore(ToyPool(num_blocks=4, needs=(5,), preempt=True), check_liveness=True)
    assert [f.kind for f in res.findings] == ["livelock"]
    assert not res.deadlocks
    # without the liveness pass this system looks fine: preempt always changes the state
    assert explore(ToyPool(num_blocks=4, needs=(5,), preempt=True)).ok


class _Raising(ToyPool):
    def step(self, s, a):
        if a == ("grab", 1) and s[0][0] == 2:
            raise ValueError("Cannot get 1 free blocks from the pool")
        return super().step(s, a)


def test_exception_in_a_step_is_a_violation_with_the_failing_action():
    res = explore(_Raising(num_blocks=8, needs=(3, 3), symmetry=False))
    (f,) = res.violations
    assert f.failed_action == ("grab", 1)
    assert "Cannot get 1 free blocks" in f.message
    assert f.trace.length == 3  # grab 0, grab 0, then the failing grab 1
    assert "error" in f.trace.steps[-1].state


def test_step_table_names_every_action_and_column():
    res = explore(ToyPool(num_blocks=4, needs=(3, 3)))
    text = render_trace(res.findings[0].trace, title="deadlock")
    assert "deadlock (4 steps)" in text
    assert "grab 0" in text and "grab 1" in text and "(initial)" in text
    assert "free" in text and "held" in text


def test_limits_stop_the_search_and_mark_it_incomplete():
    toy = ToyPool(num_blocks=20, needs=(4, 4, 4, 4), preempt=True, symmetry=False)
    res = explore(toy, max_states=100)
    assert not res.complete and 100 <= res.states < 200


def test_bad_toy_configuration_is_rejected():
    with pytest.raises(ValueError, match="num_blocks"):
        ToyPool(num_blocks=0)
    with pytest.raises(ValueError, match="needs"):
        ToyPool(needs=(0,))


def test_gc_thresholds_are_restored_after_exploring():
    import gc

    before = gc.get_threshold()
    res = explore(ToyPool(num_blocks=4, needs=(2, 2)))
    assert res.states > 1
    assert gc.get_threshold() == before


class _LastStepCounter:
    """A counter system: tells which calls went to ``step`` and which to ``step_consuming``."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def initial_states(self):
        return [[0]]

    def actions(self, s):
        return ["inc", "dbl"] if s[0] < 5 else []

    def _apply(self, s, a):
        s[0] = s[0] + 1 if a == "inc" else s[0] * 2 + 1
        return s

    def step(self, s, a):
        self.calls.append("step")
        return self._apply(list(s), a)

    def step_consuming(self, s, a):
        self.calls.append("consume")
        return self._apply(s, a)

    def key(self, s):
        return s[0]

    def check(self, s):
        pass

    def is_final(self, s):
        return s[0] >= 5

    def describe(self, s):
        return {"n": str(s[0])}


def test_the_last_action_of_a_state_may_consume_it():
    sys_ = _LastStepCounter()
    res = explore(sys_)
    # 0 -> {1, 1}; 1 -> {2, 3}; 2 -> {3, 5}; 3 -> {4, 7}; 4 -> {5, 9}: states 0,1,2,3,4,5,7,9
    assert res.ok and res.states == 8 and res.transitions == 10
    assert sys_.calls.count("consume") == 5 and sys_.calls.count("step") == 5


def test_every_named_scope_is_in_the_explorer_docs_table():
    """docs/explorer.md's scope table is the user's index: a new scope must be documented there."""
    import pathlib

    from kvref.models.explorer.offloading_connector import CONNECTOR_SCOPES
    from kvref.models.explorer.kv import SCOPES
    from kvref.models.explorer.simple_cpu import OFFLOAD_SCOPES

    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "explorer.md").read_text()
    rows = {line.split("|")[1].strip().strip("`") for line in text.splitlines() if line.startswith("| `")}
    missing = (set(SCOPES) | set(OFFLOAD_SCOPES) | set(CONNECTOR_SCOPES)) - rows
    assert not missing, f"scopes missing from docs/explorer.md: {sorted(missing)}"
