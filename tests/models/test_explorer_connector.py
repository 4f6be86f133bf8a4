"""The explorer over the OffloadingConnector path: job completions, preemptions, aborts and
resets in every order; the reset bug of docs/offload.md is re-found with its shortest trace."""

from __future__ import annotations

import json

import pytest

from kvref.models.explorer.engine import explore, render_trace
from kvref.models.explorer.offloading_connector import CONNECTOR_SCOPES, ConnectorScope, ConnectorSystem, explore_connector

from tests.models.key_audit import OFFSET, explored_keys, ints


def _count_jobs(system: ConnectorSystem) -> dict[str, int]:
    """Counts, over every checked state, the jobs in flight by kind: stores, loads, partially
    reported ones (some workers of several) and flushed ones."""
    seen = {"store": 0, "load": 0, "partial": 0, "flushed": 0}
    check = system.check

    def counting(s):
        check(s)
        for job in s[0].jobs.values():
            seen["store" if job["store"] else "load"] += 1
            seen["partial"] += 0 < job["reported"] < s[0].cfg.num_workers
            seen["flushed"] += bool(job.get("flushed"))
    system.check = counting
    return seen


def test_the_clean_connector_scope_has_stores_loads_and_no_violation():
    system = ConnectorSystem(CONNECTOR_SCOPES["connector"])
    seen = _count_jobs(system)
    res = explore(system, max_depth=CONNECTOR_SCOPES["connector"].max_depth, check_deadlocks=False)
    assert res.ok and res.states > 1000 and res.depth == 9
    assert seen["store"] and seen["load"] and seen["partial"]  # a CPU hit loads; one worker of two reported


def test_a_reset_while_a_sliding_window_request_runs_is_found_with_the_shortest_trace():
    """vLLM 0.33.0 (and the reference, which issues the same jobs): after a connector reset a
    store job reads a GPU block that has been re-allocated — docs/offload.md, 'Found'."""
    res = explore_connector("reset-swa")
    (f,) = res.findings
    assert f.kind == "violation" and "store job" in f.message and "reads GPU block" in f.message
    actions = [st.action for st in f.trace.steps[1:]]
    assert ("reset",) in actions and actions[-1] == ("step",) and len(actions) == 9
    assert "reset" in render_trace(f.trace)
    # without resets the same scope is clean to the same depth
    from dataclasses import replace

    clean = explore_connector(replace(CONNECTOR_SCOPES["reset-swa"], resets=False), max_depth=7)
    assert clean.ok and clean.states > 500


def test_bad_connector_scopes_are_rejected():
    with pytest.raises(ValueError, match="num_workers"):
        ConnectorScope(num_workers=0)
    with pytest.raises(ValueError, match="prompts"):
        ConnectorScope(prompts=((),))
    with pytest.raises(ValueError, match="scope"):
        explore_connector("nope")


def test_cli_explores_the_connector_scope(capsys):
    from kvref.cli import main

    assert main(["explore", "--scope", "connector", "--max-depth", "6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert out["states"] > 100 and out["depth"] == 6 and out["findings"] == []


def test_a_scope_of_the_wrong_type_is_rejected_with_the_field_named():
    from kvref.models.explorer.simple_cpu import explore_offload

    with pytest.raises(ValueError, match="scope=3"):
        explore_connector(3)
    with pytest.raises(ValueError, match="scope=3"):
        explore_offload(3)


def test_the_complete_scope_is_explored_completely_with_stores_loads_and_flushes():
    """Job ids renamed by rank make the connector's state space finite: every state, deadlock checks."""
    scope = CONNECTOR_SCOPES["connector-complete"]
    assert scope.max_depth is None
    system = ConnectorSystem(scope)
    seen = _count_jobs(system)
    res = explore(system, check_deadlocks=True)
    assert res.complete and res.ok and res.states > 5000 and res.depth > 20
    assert seen["store"] and seen["load"] and seen["flushed"]


class _OffsetJobIds(ConnectorSystem):
    """The same system whose job ids (and reset threshold) start at ``OFFSET`` instead of 0."""

    def initial_states(self):
        (w, arrived), = super().initial_states()
        w.b.conn._job_counter = w.b.conn._stale_job_threshold = OFFSET
        return [(w, arrived)]


@pytest.mark.parametrize("name,depth", [("reset-swa", 6), ("connector-complete", 11)])
def test_job_ids_are_renamed_wherever_they_live(name, depth):
    """An audit independent of the renaming's tables: with ids offset by 10^7, no id may reach a
    key (every place an id lives is renamed), and the keys and the state count are those of the
    system that numbers from 0 — states that differ only by the ids' values are merged (resets
    included: the threshold is renamed with them)."""
    from dataclasses import replace

    scope = replace(CONNECTOR_SCOPES[name], max_depth=depth)
    fenced = []  # jobs from before a reset still out
    keys = {cls: explored_keys(cls(scope), depth, lambda s: fenced.append(bool(s[0].b.conn._reset_fence)))
            for cls in (ConnectorSystem, _OffsetJobIds)}
    assert any(fenced) == scope.resets
    assert keys[ConnectorSystem] == keys[_OffsetJobIds]
    assert max(max(ints(k)) for k in keys[_OffsetJobIds]) < OFFSET


def test_a_reset_threshold_is_part_of_the_key():
    """Reports of jobs from before a reset only count down the reset fence: whether a live job
    is below the threshold changes what its report does, so the key must tell them apart."""
    import pickle
    from dataclasses import replace

    system = ConnectorSystem(replace(CONNECTOR_SCOPES["reset-swa"], max_depth=None))
    s = system.initial_states()[0]
    for a in [("arrive", 0), ("step",), ("step",)]:
        s = system.step(s, a)
    assert s[0].jobs, "a job is in flight"
    t = pickle.loads(pickle.dumps(s))
    t[0].b.conn._stale_job_threshold = max(t[0].jobs) + 1  # the live job now counts as pre-reset
    assert system.key(t) != system.key(s)
    u = pickle.loads(pickle.dumps(s))
    u[0].b.conn._job_counter += 5  # more jobs issued (and finished) before: not visible
    assert system.key(u) == system.key(s)
