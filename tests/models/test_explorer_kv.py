"""The explorer over the real reference stack: clean scopes pass, broken ones are found."""

from __future__ import annotations

import pytest

from kvref.models.explorer.engine import explore, render_trace
from kvref.models.explorer.kv import SCOPES, KVSystem, Scope, campaign_scopes, explore_scope
from kvref.models.mutants.catalogue import CATALOGUE


@pytest.mark.parametrize("name", ["default", "tight", "small", "swa", "full", "chunked"])
def test_startup_sized_scopes_have_no_violation_or_deadlock(name):
    res = explore_scope(name)
    assert res.complete and res.ok, [f.message for f in res.findings]
    assert res.states > 5 and res.depth > 5


def test_default_scope_is_what_the_issue_asks_for():
    s = SCOPES["default"]
    assert s.pool_config().num_blocks <= 8 and len(s.prompts) <= 3
    assert all(len(p) + m <= 12 for p, m in zip(s.prompts, s.max_tokens))
    assert [g.kv_cache_spec.manager_name for g in s.groups()] == ["FullAttentionManager", "SlidingWindowManager"]
    assert s.num_blocks is None or s.num_blocks == s.startup_num_blocks()


def test_liveness_holds_on_the_tight_scope():
    res = explore_scope("tight", check_liveness=True)
    assert res.ok and res.complete


def test_undersized_pool_deadlocks_at_the_head_of_the_queue():
    """A pool one block smaller than startup sizing: the gate never admits (vLLM #39734 shape)."""
    res = explore_scope("undersized")
    (f,) = res.findings
    assert f.kind == "deadlock"
    assert f.trace.length == 1 and f.trace.steps[-1].action == ("arrive", "r0")
    assert "arrive r0" in render_trace(f.trace)


@pytest.mark.parametrize("name,kind,text", [
    ("manager.gate_without_cap", "deadlock", ""),            # vLLM #39734
    ("manager.swa_skip_one_too_many", "violation", "window"),
    ("manager.chunked_skip_one_block_too_many", "violation", "window"),
    ("kvm.computed_basis_for_frees", "violation", "window"),
    ("hash.not_chained", "violation", "content"),
    ("hash.salt_ignored", "violation", "content"),
    ("pool.touch_no_ref", "violation", "ref_cnt"),
])
def test_explorer_finds_the_fault_each_mutant_plants(name, kind, text):
    with CATALOGUE[name].applied():
        found = []
        for scope in campaign_scopes():
            res = explore_scope(scope)
            found += res.findings
            if res.findings:
                break
    assert found and found[0].kind == kind and text in found[0].message
    # and the clean reference is fine again afterwards (the patch was restored)
    assert explore_scope("tight").ok


def test_counterexample_trace_replays_to_the_finding():
    with CATALOGUE["manager.swa_skip_one_too_many"].applied():
        res = explore_scope("tight")
    (f,) = res.findings
    assert f.trace.steps[0].action is None
    assert all(s.action is not None for s in f.trace.steps[1:])
    assert f.trace.length == len(f.trace.steps) - 1


def test_copies_are_independent():
    system = KVSystem(SCOPES["small"])
    (s0,) = system.initial_states()
    s1 = system.step(s0, ("arrive", "r0"))
    s2 = system.step(s1, ("schedule",))
    assert system.key(s0) != system.key(s1) != system.key(s2)
    assert not s1.in_flight and s2.in_flight  # s1 was not mutated by stepping from it
    assert system.key(system.step(s1, ("schedule",))) == system.key(s2)  # deterministic


def test_bad_scope_is_rejected():
    with pytest.raises(ValueError, match="prompts"):
        Scope(prompts=((1,) * 12,), max_tokens=(1,), max_model_len=12)
    with pytest.raises(ValueError, match="max_tokens"):
        Scope(prompts=((1, 2),), max_tokens=(1, 2))
    with pytest.raises(ValueError, match="scope"):
        explore_scope("no-such-scope")
    # without chunked prefill vLLM needs a budget of at least max_model_len
    with pytest.raises(ValueError, match="max_num_batched_tokens=4 .*max_model_len=12"):
        Scope(enable_chunked_prefill=False, max_num_batched_tokens=4)


def test_no_per_request_state_outlives_its_request():
    with CATALOGUE["kvm.free_keeps_hashes"].applied():
        res = explore_scope("tight")
    (f,) = res.findings
    assert "hasher still holds finished requests" in f.message


def test_symmetry_reduction_over_identical_requests_keeps_verdicts():
    from dataclasses import replace

    twins = SCOPES["twins"]
    plain = explore_scope(replace(twins, symmetry=False), check_liveness=True)
    sym = explore_scope(twins, check_liveness=True)
    assert plain.ok and sym.ok and plain.complete and sym.complete
    assert sym.states * 3 < plain.states  # 3 identical requests: up to 3! renamings merge
    assert sym.depth == plain.depth
    with CATALOGUE["manager.swa_skip_one_too_many"].applied():
        a = explore_scope(replace(twins, symmetry=False))
        b = explore_scope(twins)
    assert a.findings and b.findings
    assert a.findings[0].trace.length == b.findings[0].trace.length
    assert a.findings[0].message.split(":")[0] == b.findings[0].message.split(":")[0]


def test_no_symmetry_between_requests_that_differ():
    system = KVSystem(SCOPES["small"])
    assert system.perms == []  # different prompts: nothing to merge
    assert len(KVSystem(SCOPES["twins"]).perms) == 6


#: (scope, symmetry) -> (states, transitions, depth, findings), recorded on the pickle-copying
#: explorer before the fast-copy work: any speed-up must visit exactly the same states.
RECORDED_COUNTS = {
    ("default", True): (473, 878, 15, 0),
    ("default", False): (473, 878, 15, 0),
    ("tight", True): (10, 9, 9, 0),
    ("small", True): (133, 206, 12, 0),
    ("swa", True): (165, 239, 16, 0),
    ("full", True): (1694, 4154, 19, 0),
    ("undersized", True): (2, 2, 1, 1),
    ("chunked", True): (57, 92, 10, 0),
    ("twins", True): (63, 124, 13, 0),
    ("twins", False): (296, 588, 13, 0),
    ("large", True): (4466, 8717, 19, 0),
    ("whole-prompts", True): (364, 583, 10, 0),
}


@pytest.mark.parametrize("name,symmetry", sorted(RECORDED_COUNTS))
def test_state_counts_match_the_recorded_ones(name, symmetry):
    from dataclasses import replace

    res = explore_scope(replace(SCOPES[name], symmetry=symmetry), stop_at_first=False)
    assert (res.states, res.transitions, res.depth, len(res.findings)) == RECORDED_COUNTS[(name, symmetry)]


def test_consuming_the_last_successor_gives_the_same_states_as_copying():
    """The engine may hand a state's last action a state it no longer needs (no copy)."""
    system = KVSystem(SCOPES["small"])
    (s0,) = system.initial_states()
    s1 = system.step(s0, ("arrive", "r0"))
    s2 = system.step(system.step(s1, ("arrive", "r1")), ("schedule",))
    for a in system.actions(s2):
        copied = system.step(s2, a)
        k_before = system.key(s2)
        owned = system.step(system.step(s1, ("arrive", "r1")), ("schedule",))
        consumed = system.step_consuming(owned, a)
        assert system.key(consumed) == system.key(copied)
        assert system.key(s2) == k_before  # stepping with a copy left s2 alone
        system.check(consumed)


@pytest.mark.parametrize("name", ["default", "full", "chunked"])
def test_stepping_a_copy_never_changes_the_source(name):
    """Copies share frozen configs, steps in flight and shadow slot tuples: stepping one must
    leave the source (and its other copies) exactly as they were — checked on every state."""
    import copy
    import pickle

    system = KVSystem(SCOPES[name])
    frontier = system.initial_states()
    seen = set()
    checked = 0
    while frontier and checked < 400:
        nxt = []
        for s in frontier:
            before_key, before_blob = system.key(s), pickle.dumps(s.scheduler)
            content_before = copy.deepcopy(s.content)
            succs = [system.step(s, a) for a in system.actions(s)]
            assert system.key(s) == before_key
            assert pickle.dumps(s.scheduler) == before_blob
            assert s.content == content_before
            checked += 1
            for t in succs:
                k = system.key(t)
                if k not in seen:
                    seen.add(k)
                    nxt.append(t)
        frontier = nxt
    assert checked > 50


def test_a_schedule_that_only_preempts_is_a_transition_on_copies_too():
    """Regression: a ``schedule`` that preempts to make room and then schedules nothing changed
    the state, but on a copy the explorer returned the unchanged source (copy and in-place steps
    disagreed). With SWA never freeing (a mutant), tight's request runs out of blocks at c6 and
    the scheduler preempts it: both ways of stepping must show that."""
    with CATALOGUE["manager.swa_never_frees"].applied():
        system = KVSystem(SCOPES["tight"])
        s = system.initial_states()[0]
        for a in [("arrive", "r0")] + [("schedule",), ("complete",)] * 3:
            s = system.step(s, a)
        copied = system.step(s, ("schedule",))
        assert copied is not s and "pree" in system.describe(copied)["requests"]
        in_place = system.step_consuming(s, ("schedule",))
        assert system.key(copied) == system.key(in_place)
