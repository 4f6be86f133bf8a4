"""The explorer over the OffloadingConnector path: job completions, preemptions, aborts and
resets in every order; the reset bug of docs/offload.md is re-found with its shortest trace."""

from __future__ import annotations

import json

import pytest

from kvref.models.explorer import explore, render_trace
from kvref.models.explorer_connector import CONNECTOR_SCOPES, ConnectorScope, ConnectorSystem, explore_connector


def test_the_clean_connector_scope_has_stores_loads_and_no_violation():
    system = ConnectorSystem(CONNECTOR_SCOPES["connector"])
    seen = {"store": 0, "load": 0, "partial": 0}
    check = system.check

    def counting(s):
        check(s)
        for job in s[0].jobs.values():
            seen["store" if job["store"] else "load"] += 1
            seen["partial"] += 0 < job["reported"] < s[0].cfg.num_workers
    system.check = counting
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
    from kvref.models.explorer_offload import explore_offload

    with pytest.raises(ValueError, match="scope=3"):
        explore_connector(3)
    with pytest.raises(ValueError, match="scope=3"):
        explore_offload(3)
