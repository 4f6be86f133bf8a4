"""``kvref explore`` and ``kvref mutants`` subcommand modules (wired by kvref/cli/__init__.py)."""

from __future__ import annotations

import argparse
import json

import pytest

from kvref.cli import explore as cli_explore, mutants as cli_mutants


def _run(argv):
    p = argparse.ArgumentParser()
    sub = p.add_subparsers()
    for m in (cli_explore, cli_mutants):
        m.add_parser(sub).set_defaults(_run=m.run)
    args = p.parse_args(argv)
    return args._run(args)


def test_explore_default_scope_reports_figures(capsys):
    assert _run(["explore", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["complete"] and out["states"] > 100 and out["depth"] > 5 and out["findings"] == []


def test_explore_prints_the_shortest_deadlock_table(capsys):
    assert _run(["explore", "--scope", "undersized"]) == 1
    out = capsys.readouterr().out
    assert "deadlock" in out and "arrive r0" in out


def test_explore_toy_and_overrides(capsys):
    assert _run(["explore", "--toy"]) == 1
    assert _run(["explore", "--scope", "small", "--set", "aborts=true", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["states"] > 0
    with pytest.raises(ValueError, match="--set"):
        _run(["explore", "--set", "nonsense=1"])


def test_mutants_list_and_a_single_run(capsys):
    assert _run(["mutants", "--list"]) == 0
    assert "manager.gate_without_cap" in capsys.readouterr().out
    assert _run(["mutants", "--only", "manager.gate_without_cap", "--checks", "explorer", "--json",
                 "--min-rate", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kill_rate"] == 1.0 and out["mutants"][0]["by"] == "explorer"


def test_verify_explorer_check_passes_and_writes_traces_on_failure(tmp_path):
    from kvref.cli.explore import check_explorer
    from kvref.models.mutants.catalogue import CATALOGUE
    from kvref.verify import VerifyContext

    ctx = VerifyContext(profile="fast", out_dir=str(tmp_path))
    ok = check_explorer(ctx)
    assert ok.status == "passed" and "states" in ok.summary and len(ok.details) == 3
    with CATALOGUE["manager.gate_without_cap"].applied():
        bad = check_explorer(ctx)
    assert bad.status == "failed" and bad.artifacts
    assert "deadlock" in open(bad.artifacts[0]).read()


def test_explore_offload_scope_from_the_cli(capsys):
    assert _run(["explore", "--scope", "offload", "--max-depth", "6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["depth"] == 6 and out["states"] > 10 and not out["complete"]  # bounded


def test_explore_against_torch_compares_every_transition(capsys):
    assert _run(["explore", "--scope", "small", "--against", "torch", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["targets"] == ["torch"] and out["divergence"] is None and out["complete"]
    assert out["transitions"] == 206 and out["calls"] >= out["transitions"]


def test_explore_against_reports_a_divergence_with_exit_status_1(capsys):
    from kvref.models.mutants.catalogue import CATALOGUE

    with CATALOGUE["manager.free_head_first"].applied():
        assert _run(["explore", "--scope", "small", "--against", "torch", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert "free_block_queue" in out["divergence"]["message"] and out["divergence"]["path"]


def test_explore_against_needs_a_kv_scope():
    from kvref.spec.errors import InvalidFieldError

    with pytest.raises(InvalidFieldError, match="--scope='offload'"):
        _run(["explore", "--scope", "offload", "--against", "torch"])


def test_explore_against_applies_set_overrides(capsys):
    assert _run(["explore", "--scope", "small", "--against", "torch", "--set", "enable_caching=false",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["divergence"] is None and out["transitions"] != 206  # another graph without caching
    with pytest.raises(ValueError, match="--set"):
        _run(["explore", "--scope", "small", "--against", "torch", "--set", "nonsense=1"])
