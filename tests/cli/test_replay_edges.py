"""``kvref replay`` edges (issue #25): a trace with nothing in it is "nothing checked" (exit 3),
never OK; explorer findings replay on vLLM by default where a vLLM class exists for the scope
(offload/connector scopes too), say where they run on the reference only, and ``--table`` on one
is an input error rather than silently ignored."""

from __future__ import annotations

import json

import pytest

from kvref.cli import EXIT_NOTHING_CHECKED, main
from tests.hardening.cli_cases import GOOD_TRACE
from tests.vllm_env import require_vllm


def _explorer_trace(tmp_path, scope: str, n: int, system) -> str:
    """The first ``n`` enabled actions of ``scope`` (each the first enabled one): no finding."""
    state = next(iter(system.initial_states()))
    actions = []
    for _ in range(n):
        a = system.actions(state)[0]
        actions.append(list(a) if isinstance(a, tuple) else a)
        state = system.step(state, a)
    path = tmp_path / f"{scope}.json"
    path.write_text(json.dumps({"format": "kvref-explorer-trace", "version": 1, "scope": scope, "toy": False,
                                "set": [], "kind": "violation", "message": "", "actions": actions}))
    return str(path)


def test_a_trace_with_no_op_is_nothing_checked(tmp_path, capsys) -> None:
    path = tmp_path / "empty.json"
    path.write_text(json.dumps({**GOOD_TRACE, "ops": []}))
    assert main(["replay", str(path), "--kinds", "reference"]) == EXIT_NOTHING_CHECKED == 3
    out = capsys.readouterr().out
    assert "NOTHING CHECKED" in out and "OK" not in out
    good = tmp_path / "good.json"
    good.write_text(json.dumps(GOOD_TRACE))
    assert main(["replay", str(good), "--kinds", "reference"]) == 0
    assert "OK: 3 ops" in capsys.readouterr().out


def test_a_trace_whose_ops_compare_nothing_is_nothing_checked(tmp_path, capsys) -> None:
    """Only an arrival, and an admission of a request that was never added (skipped): no manager
    call was compared, so no "OK"."""
    ops = [GOOD_TRACE["ops"][0], {**GOOD_TRACE["ops"][1], "rid": "ghost"}]
    path = tmp_path / "idle.json"
    path.write_text(json.dumps({**GOOD_TRACE, "ops": ops}))
    assert main(["replay", str(path), "--kinds", "reference"]) == 3
    assert "NOTHING CHECKED" in capsys.readouterr().out


def test_an_explorer_trace_with_no_action_is_nothing_checked(tmp_path, capsys) -> None:
    path = tmp_path / "e.json"
    path.write_text(json.dumps({"format": "kvref-explorer-trace", "version": 1, "scope": "tight", "toy": False,
                                "set": [], "kind": "violation", "message": "", "actions": []}))
    assert main(["replay", str(path), "--kinds", "reference"]) == 3
    assert "NOTHING CHECKED" in capsys.readouterr().out


def test_table_on_an_explorer_trace_is_refused_not_ignored(tmp_path, capsys) -> None:
    from kvref.models.explorer.kv import SCOPES, KVSystem

    path = _explorer_trace(tmp_path, "tight", 3, KVSystem(SCOPES["tight"]))
    assert main(["replay", path, "--table", "--kinds", "reference"]) == 2
    assert "--table" in capsys.readouterr().err


@pytest.mark.parametrize("kinds", ["reference", "reference,vllm"])
def test_an_explorer_trace_whose_actions_are_not_a_list_is_refused(tmp_path, capsys, kinds) -> None:
    """Both replays of a finding read it through one door (#26): beside vLLM's offload world too, a
    string of actions is an input error naming the field (it was walked character by character)."""
    path = tmp_path / "e.json"
    path.write_text(json.dumps({"format": "kvref-explorer-trace", "version": 1, "scope": "offload", "toy": False,
                                "set": [], "kind": "violation", "message": "", "actions": "step"}))
    assert main(["replay", str(path), "--kinds", kinds]) == 2
    err = capsys.readouterr().err
    assert "actions" in err and "a list of actions" in err


def test_the_toy_scope_says_it_replays_on_the_reference_only(tmp_path, capsys) -> None:
    out = tmp_path / "findings"
    assert main(["explore", "--toy", "--out", str(out)]) == 1
    capsys.readouterr()
    assert main(["replay", str(out / "explore-toy-deadlock-1.json")]) == 1
    assert "on the reference only" in capsys.readouterr().err


@pytest.mark.vllm
def test_a_kv_scope_trace_replays_on_vllm_by_default(tmp_path, capsys) -> None:
    require_vllm()
    from kvref.models.explorer.kv import SCOPES, KVSystem

    path = _explorer_trace(tmp_path, "tight", 6, KVSystem(SCOPES["tight"]))
    assert main(["replay", path]) == 0
    assert "vllm agree with the reference" in capsys.readouterr().out


@pytest.mark.vllm
@pytest.mark.parametrize("scope", ["offload", "connector"])
def test_an_offload_or_connector_trace_replays_on_vllm(scope, tmp_path, capsys) -> None:
    """The world over vLLM's own offload scheduler follows the same actions and observes the same."""
    require_vllm()
    from kvref.models.explorer.offloading_connector import CONNECTOR_SCOPES, ConnectorSystem
    from kvref.models.explorer.simple_cpu import OFFLOAD_SCOPES, OffloadSystem

    system = OffloadSystem(OFFLOAD_SCOPES[scope]) if scope == "offload" else ConnectorSystem(CONNECTOR_SCOPES[scope])
    path = _explorer_trace(tmp_path, scope, 7, system)
    assert main(["replay", path]) == 0
    assert "vllm agrees with the reference" in capsys.readouterr().out
    assert main(["replay", path, "--kinds", "reference,torch"]) == 2  # no torch world for offload: named


@pytest.mark.vllm
def test_a_connector_finding_reproduces_on_vllm_too(tmp_path, capsys, monkeypatch) -> None:
    """A planted fault in the reference world's invariant check (the finding) is reported with what
    vLLM did at that action; a fault only in vLLM's world is a divergence."""
    require_vllm()
    from kvref.models.explorer.offloading_connector import CONNECTOR_SCOPES, ConnectorSystem

    path = _explorer_trace(tmp_path, "connector", 6, ConnectorSystem(CONNECTOR_SCOPES["connector"]))
    from kvref.models.offload import offloading_connector_world as ocw

    real_observe = ocw.OffloadingWorld.observe

    def skewed(self):
        seen = real_observe(self)
        if type(self._b).__module__.startswith("kvref.impl.vllm"):
            seen = {**seen, "gpu_free": list(reversed(seen["gpu_free"]))}
        return seen

    monkeypatch.setattr(ocw.OffloadingWorld, "observe", skewed)
    assert main(["replay", path]) == 1
    assert "DIVERGENCE (reference,vllm)" in capsys.readouterr().out
