"""The first hour of a new user (issue #25): no vLLM log line leaks from a command, a wrong name is
reported under the flag the user typed, the reset-swa connector finding replays on vLLM too."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvref.cli import main
from tests.vllm_env import require_vllm

#: vLLM 0.33.0 vLLM's reset-swa finding (``kvref explore --scope reset-swa --out``): a connector
#: reset after an abort, then a store job reads a partial block
RESET_SWA_ACTIONS = [["arrive", 0], ["arrive", 1], ["step"], ["step"], ["step"], ["step"], ["abort", 1],
                     ["reset"], ["step"]]
#: lines vLLM, its CPU platform and the OffloadingConnector log on a machine without a GPU
NOISE = ("cannot store chunks", "CPU backend prefers", "Triton is not installed", "Failed to import from vllm._C",
         "Model Runner V2 requires Triton")


def _reset_swa(tmp_path) -> str:
    path = tmp_path / "explore-reset-swa-violation-1.json"
    path.write_text(json.dumps({"format": "kvref-explorer-trace", "version": 1, "scope": "reset-swa", "toy": False,
                                "set": [], "max_depth": 9, "kind": "violation", "message": "",
                                "actions": RESET_SWA_ACTIONS}))
    return str(path)


@pytest.mark.vllm
def test_replay_on_vllm_leaks_no_vllm_log_line(tmp_path) -> None:
    """Driving vLLM's OffloadingConnector logs "cannot store chunks" per refused store; replay is
    quiet like verify (it was not: every command but verify left vLLM's logging on)."""
    require_vllm()
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    env.pop("VLLM_LOGGING_LEVEL", None)
    proc = subprocess.run([sys.executable, "-m", "kvref.cli", "replay", _reset_swa(tmp_path)], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-2000:]
    assert [n for n in NOISE if n in proc.stderr] == [], proc.stderr[-2000:]
    assert "REPRODUCED (violation) on the reference" in proc.stdout
    assert "on vLLM: vLLM's world broke a rule: store job" in proc.stdout  # vLLM 0.33.0 has the bug too


def test_mutants_only_names_the_flag(capsys) -> None:
    assert main(["mutants", "--list", "--only", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert "--only='nosuch'" in err and "mutant=" not in err


class _Item:
    def __init__(self, marks, parametrized=True) -> None:
        self.callspec = object() if parametrized else None
        self._marks = [m.mark for m in marks]

    def iter_markers(self, name):
        return [m for m in self._marks if m.name == name]


def test_nightly_only_parametrizations_are_not_collected() -> None:
    """tests/conftest.py deselects a parametrized case whose skipif says the profile will not run
    it (8,350 of them printed ~120 lines of `s` in `make test`); every other case is kept."""
    from tests.conftest import _profile_only_skip

    nightly_only = pytest.mark.skipif(True, reason="nightly profile only")
    assert _profile_only_skip(_Item([nightly_only])) == "nightly profile only"
    assert _profile_only_skip(_Item([pytest.mark.skipif(False, reason="nightly profile only")])) is None  # runs
    assert _profile_only_skip(_Item([pytest.mark.skipif(True, reason="no CUDA device")])) is None  # a real skip
    assert _profile_only_skip(_Item([nightly_only], parametrized=False)) is None  # one visible `s`, kept


def test_the_collection_line_reports_what_was_left_out() -> None:
    env = {**os.environ, "KVREF_HYPOTHESIS_PROFILE": "fast"}
    run = subprocess.run([sys.executable, "-m", "pytest", "tests/hardening/test_cli_flag_fuzz.py", "--collect-only",
                          "-q", "-p", "no:cacheprovider"], capture_output=True, text=True, env=env, timeout=600,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert run.returncode == 0, run.stdout[-2000:]
    assert "nightly-only parametrized cases not collected under the 'fast' profile" in run.stdout
    assert "test_flag_walk_case_nightly" not in run.stdout and "deselected" in run.stdout


class _HeartbeatLog:
    """Replaces ``Progress.heartbeat``: records which heartbeats are open, so a test can ask whether
    the slow part of a command ran under one (no timing involved)."""

    def __init__(self, monkeypatch) -> None:
        from contextlib import contextmanager

        from kvref import progress

        self.open: list[str] = []
        self.seen: list[str] = []
        log = self

        def heartbeat(self, status="running"):
            @contextmanager
            def beating():
                log.open.append(f"{self.label}: {status}")
                log.seen.append(f"{self.label}: {status}")
                try:
                    yield self
                finally:
                    log.open.pop()
            return beating()

        monkeypatch.setattr(progress.Progress, "heartbeat", heartbeat)


@pytest.mark.vllm
def test_size_against_vllm_reports_progress_while_vllm_imports(monkeypatch, capsys) -> None:
    """`kvref size --against vllm` was silent for 26-34 s: vLLM was imported (vllm_available) before
    the progress heartbeat started."""
    require_vllm()
    import kvref.impl.vllm as kv

    beats = _HeartbeatLog(monkeypatch)
    real = kv.vllm_available
    under: list[list[str]] = []

    def watched():
        under.append(list(beats.open))
        return real()

    monkeypatch.setattr(kv, "vllm_available", watched)
    assert main(["size", "--example", "gemma3_27b_like", "--available-memory", "16GiB", "--against", "vllm"]) == 0
    assert under and under[0] and under[0][0].startswith("size --against vllm: importing vLLM"), under


@pytest.mark.vllm
def test_replay_on_vllm_reports_progress_while_vllm_imports(monkeypatch, tmp_path, capsys) -> None:
    require_vllm()
    from tests.hardening.cli_cases import GOOD_TRACE

    beats = _HeartbeatLog(monkeypatch)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(GOOD_TRACE))
    assert main(["replay", str(path), "--kinds", "reference,vllm"]) == 0
    assert beats.seen == ["replay: on reference,vllm (importing vLLM takes seconds)"]
    assert main(["replay", str(path), "--kinds", "reference"]) == 0
    assert len(beats.seen) == 1  # nothing slow: no heartbeat


def test_every_command_runs_quiet(monkeypatch) -> None:
    """Every subcommand runs with vLLM's, transformers' and torch's logging quieted (verify does it
    itself, with --verbose to show them): each subcommand's run is replaced by a probe that records
    whether the quiet came first."""
    import kvref.cli as cli
    import kvref.quiet as quiet

    calls: list[bool] = []
    real = quiet.quiet_third_party
    monkeypatch.setattr(quiet, "quiet_third_party", lambda verbose=False: calls.append(verbose) or real(True))
    seen: dict[str, list[bool]] = {}
    build = cli.build_parser

    def probed():
        parser = build()
        sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
        for name, p in sub.choices.items():
            p.set_defaults(_run=lambda args, name=name: seen.setdefault(name, list(calls)) and 0)
        return parser

    monkeypatch.setattr(cli, "build_parser", probed)
    argv = {"replay": ["x.json"], "check-run": ["x.kvtrace.gz"], "watch": ["tcp://127.0.0.1:1"]}
    names = [m.rsplit(".", 1)[1].replace("_", "-") for m in cli.SUBCOMMAND_MODULES]
    for name in names:
        calls.clear()
        cli.main([name, *argv.get(name, [])])
    assert sorted(seen) == sorted(names)
    assert {n: c for n, c in seen.items() if n != "verify" and c != [False]} == {}
