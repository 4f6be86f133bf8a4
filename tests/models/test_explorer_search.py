"""The explorer's search finds exactly what a textbook FIFO breadth-first search finds, in one
process and spread over workers.

``search`` is called with ``min_parallel_level=1`` (or 8: the first levels in this process, then
handed over) so that even the small scopes go through forked workers and the in-order merge.
"""

from __future__ import annotations

import pytest

from kvref.models.explorer.engine import ExplorationResult, explore
from kvref.models.explorer.kv import SCOPES, KVSystem
from kvref.models.explorer.simple_cpu import OFFLOAD_SCOPES, OffloadSystem
from kvref.models.explorer.search import fork_available, resolve_workers, search
from kvref.models.explorer.toy import ToyPool
from kvref.models.mutants.catalogue import CATALOGUE
from kvref.spec.errors import InvalidFieldError

from .fifo_bfs import fifo_explore

needs_fork = pytest.mark.skipif(not fork_available(), reason="the parallel explorer needs the fork start method")


def _parallel(system, workers=2, min_parallel_level=1, **kw):
    args = dict(max_states=None, max_seconds=None, stop_at_first=True, check_deadlocks=True,
                check_liveness=False, max_findings=10, max_depth=None)
    args.update(kw)
    return search(system, ExplorationResult(), workers=workers, min_parallel_level=min_parallel_level, **args)


def _searches(make, workers=2, min_parallel_level=1, **kw):
    """The search in this process, and (where fork exists) spread over workers."""
    yield explore(make(), workers=1, **kw)
    if fork_available():
        yield _parallel(make(), workers=workers, min_parallel_level=min_parallel_level, **kw)


def _same(a, b):
    assert (a.states, a.transitions, a.depth, a.complete) == (b.states, b.transitions, b.depth, b.complete)
    assert [(f.kind, f.message, f.failed_action) for f in a.findings] == \
        [(f.kind, f.message, f.failed_action) for f in b.findings]
    for fa, fb in zip(a.findings, b.findings):
        assert [(s.action, s.state) for s in fa.trace.steps] == [(s.action, s.state) for s in fb.trace.steps]


@pytest.mark.parametrize("name", ["default", "tight", "small", "swa", "full", "chunked", "twins"])
@pytest.mark.parametrize("workers,min_level", [(2, 1), (3, 8)])
def test_every_scope_gives_the_states_of_a_fifo_search(name, workers, min_level):
    """min_level 8: the first levels are expanded here, then handed to the workers mid-search."""
    seq = fifo_explore(KVSystem(SCOPES[name]))
    assert seq.ok and seq.states > 5
    for res in _searches(lambda: KVSystem(SCOPES[name]), workers, min_level):
        _same(seq, res)


def test_a_deadlock_is_found_with_the_same_shortest_trace():
    seq = fifo_explore(KVSystem(SCOPES["undersized"]))
    assert [f.kind for f in seq.findings] == ["deadlock"] and "#39734" in seq.findings[0].message
    for res in _searches(lambda: KVSystem(SCOPES["undersized"])):
        _same(seq, res)


@pytest.mark.parametrize("name", ["manager.swa_skip_one_too_many", "hash.not_chained", "pool.touch_no_ref"])
def test_a_violation_is_found_with_the_same_shortest_trace(name):
    """The mutant must be active in the workers too: they are forked while it is patched in."""
    with CATALOGUE[name].applied():
        for scope in ("small", "swa", "full", "default"):
            seq = fifo_explore(KVSystem(SCOPES[scope]))
            if seq.findings:
                break
        assert seq.findings and seq.findings[0].kind == "violation"
        for res in _searches(lambda: KVSystem(SCOPES[scope])):
            _same(seq, res)


def test_all_findings_mode_and_toy_deadlocks_match():
    make = lambda: ToyPool(num_blocks=7, needs=(3, 3, 3, 3), symmetry=False)  # noqa: E731
    seq = fifo_explore(make(), stop_at_first=False)
    assert len(seq.findings) > 1
    for res in _searches(make, stop_at_first=False):
        _same(seq, res)


def test_livelocks_and_liveness_edges_match():
    for make in (lambda: ToyPool(num_blocks=4, needs=(3, 3), preempt=True), lambda: KVSystem(SCOPES["tight"]),
                 lambda: ToyPool(num_blocks=4, needs=(2, 2), preempt=True, leak=False)):
        seq = fifo_explore(make(), check_liveness=True)
        for res in _searches(make, check_liveness=True):
            _same(seq, res)


def test_a_livelock_is_reported_like_the_fifo_search_does():
    from kvref.models.explorer.toy import ToyPool as Toy

    class Cycling(Toy):  # grab and release forever, never finish: only cycles
        def is_final(self, s):
            return False

    make = lambda: Cycling(num_blocks=3, needs=(2,), preempt=True)  # noqa: E731
    seq = fifo_explore(make(), check_liveness=True, check_deadlocks=False)
    assert [f.kind for f in seq.findings] == ["livelock"]
    for res in _searches(make, check_liveness=True, check_deadlocks=False):
        _same(seq, res)


def test_limits_and_bounded_depth_match():
    seq = fifo_explore(KVSystem(SCOPES["full"]), max_states=300)
    assert not seq.complete
    for res in _searches(lambda: KVSystem(SCOPES["full"]), max_states=300):
        _same(seq, res)
    sc = OFFLOAD_SCOPES["offload"]
    seq = fifo_explore(OffloadSystem(sc), max_depth=6, check_deadlocks=False)
    assert not seq.complete and seq.states > 20
    for res in _searches(lambda: OffloadSystem(sc), max_depth=6, check_deadlocks=False):
        _same(seq, res)


@needs_fork
def test_explore_uses_the_workers_it_is_given():
    seq = fifo_explore(KVSystem(SCOPES["full"]))
    _same(seq, explore(KVSystem(SCOPES["full"]), workers=1))
    _same(seq, explore(KVSystem(SCOPES["full"]), workers=2))


@pytest.mark.parametrize("bad", [-1, 1.5, "two", True])
def test_bad_worker_counts_are_rejected(bad):
    with pytest.raises(InvalidFieldError, match="workers"):
        resolve_workers(bad)
    with pytest.raises(InvalidFieldError, match="workers"):
        explore(ToyPool(), workers=bad)


def test_auto_means_one_worker_per_cpu():
    assert resolve_workers("auto") >= 1 and resolve_workers(0) == resolve_workers(None) == resolve_workers("auto")
    assert resolve_workers(3) == 3


def test_content_identities_do_not_depend_on_discovery_order():
    """Keys must be equal in every process: the shadow-content numbering comes from the workload."""
    a, b = KVSystem(SCOPES["default"]), KVSystem(SCOPES["default"])
    explore(a)  # a has now met every identity in some order; b has met none
    assert a._kv_ids == b._kv_ids and len(a._kv_values) > 10
    s = a.initial_states()[0]
    for act in a.actions(s)[:1] + [("schedule",)]:
        s = a.step(s, act)
    assert a.key(s) == b.key(s)


def test_a_dumped_state_loads_with_working_steps_in_flight():
    sys_ = KVSystem(SCOPES["default"])
    s = sys_.initial_states()[0]
    for act in [("arrive", "r0"), ("schedule",), ("schedule",)]:
        s = sys_.step(s, act)
    t = sys_.load(sys_.dump(s))
    assert sys_.key(t) == sys_.key(s) and len(t.in_flight) == 2
    assert set(t.scheduler._in_flight) == {id(o) for o in t.in_flight}
    u = sys_.step(t, ("complete",))  # completes the loaded step: the scheduler finds it by id
    assert len(u.in_flight) == 1 and sys_.key(u) != sys_.key(t)


@needs_fork
def test_cli_workers_flag_gives_the_same_figures(capsys):
    import json

    from kvref.cli import main

    assert main(["explore", "--scope", "small", "--json"]) == 0
    one = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert main(["explore", "--scope", "small", "--json", "--workers", "2"]) == 0
    two = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert (one["workers"], two["workers"]) == (1, 2)
    assert (one["states"], one["transitions"], one["depth"]) == (two["states"], two["transitions"], two["depth"])
    assert main(["explore", "--scope", "small", "--workers", "-3"]) == 2
    assert "workers" in capsys.readouterr().err
