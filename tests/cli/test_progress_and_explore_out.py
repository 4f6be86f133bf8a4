"""Progress on long runs (``kvref explore``, ``kvref mutants``), ``kvref explore --out`` with
``kvref replay`` of its findings, and ``--workers auto`` from idle cores (issue #16)."""

from __future__ import annotations

import io
import json
import os

import pytest

import kvref.progress
from kvref.cli import main
from kvref.progress import Progress, format_seconds


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_silent_at_first_then_paced():
    clock, out = FakeClock(), io.StringIO()
    p = Progress("explore x", out, start_after=2.0, interval=10.0, clock=clock)
    p.update("1 state")
    clock.now += 1.9
    p.update("2 states")
    assert out.getvalue() == ""  # a short run prints nothing extra
    clock.now += 0.2
    p.update("3 states")
    clock.now += 5
    p.update("4 states")  # not due yet
    clock.now += 6
    p.update("5 states")
    assert out.getvalue().splitlines() == ["explore x: 3 states (2 s)", "explore x: 5 states (13 s)"]
    p.update("6 states", force=True)
    assert out.getvalue().splitlines()[-1] == "explore x: 6 states (13 s)"


def test_progress_rewrites_one_line_in_a_terminal():
    clock, out = FakeClock(), Tty()
    p = Progress("mutants", out, start_after=0, interval=0.5, clock=clock)
    p.update("a long status line")
    clock.now += 1
    p.update("short")
    p.close()
    text = out.getvalue()
    assert text.startswith("\rmutants: a long status line (0 s)") and "\rmutants: short (1 s)" in text
    assert text.endswith("\n") and text.count("\n") == 1
    assert format_seconds(125) == "2 min 05 s"


def test_heartbeat_reports_while_the_caller_is_busy():
    out = io.StringIO()
    p = Progress("campaign", out, start_after=0, interval=0.01)
    with p.heartbeat("checking the clean reference"):
        for _ in range(500):  # wait (bounded) until the thread has reported; no timing asserted
            if p.lines:
                break
            import time

            time.sleep(0.01)
    assert "campaign: checking the clean reference" in out.getvalue()


@pytest.fixture
def eager_progress(monkeypatch):
    """Progress lines from the first update (the CLIs wait 2 s before the first)."""
    real = Progress

    class Eager(real):
        def __init__(self, label, stream=None, **kwargs):
            kwargs.update(start_after=0.0, interval=0.0)
            super().__init__(label, stream, **kwargs)

    monkeypatch.setattr(kvref.progress, "Progress", Eager)


def test_explore_reports_states_depth_rate(capsys, eager_progress):
    assert main(["explore", "--scope", "tight"]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("explore scope tight: ")]
    assert lines and "states" in lines[-1] and "depth" in lines[-1] and "/s" in lines[-1]


def test_explore_quiet_prints_no_progress(capsys, eager_progress):
    assert main(["explore", "--scope", "tight", "--quiet"]) == 0
    assert "explore scope tight:" not in capsys.readouterr().err


def test_explore_out_writes_a_replayable_finding(capsys, tmp_path):
    out = tmp_path / "findings"
    assert main(["explore", "--toy", "--out", str(out)]) == 1
    printed = capsys.readouterr().out
    files = sorted(os.listdir(out))
    assert files == ["explore-toy-deadlock-1.json", "explore-toy-deadlock-1.txt"]
    assert "kvref replay " + str(out / "explore-toy-deadlock-1.json") in printed
    trace = json.loads((out / "explore-toy-deadlock-1.json").read_text())
    assert trace["format"] == "kvref-explorer-trace" and trace["kind"] == "deadlock" and trace["actions"]
    assert main(["replay", str(out / "explore-toy-deadlock-1.json")]) == 1
    assert "REPRODUCED (deadlock)" in capsys.readouterr().out
    # one action fewer: the deadlock is not reached, the replay says so and exits 0
    trace["actions"] = trace["actions"][:-1]
    (out / "shorter.json").write_text(json.dumps(trace))
    assert main(["replay", str(out / "shorter.json")]) == 0
    assert "NOT REPRODUCED" in capsys.readouterr().out


def test_replay_of_a_kv_scope_trace_in_lock_step_with_torch(capsys, tmp_path):
    """A KV scope's finding replays on the reference and, with --kinds, on the torch manager in
    lock step; a hand-made trace of the tight scope's first actions reproduces nothing."""
    pytest.importorskip("torch")
    from kvref.models.explorer.kv import SCOPES, KVSystem

    system = KVSystem(SCOPES["tight"])
    state = next(iter(system.initial_states()))
    actions = []
    for _ in range(6):
        a = system.actions(state)[0]
        actions.append(list(a) if isinstance(a, tuple) else a)
        state = system.step(state, a)
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"format": "kvref-explorer-trace", "version": 1, "scope": "tight", "toy": False,
                                "set": [], "kind": "violation", "message": "", "actions": actions}))
    assert main(["replay", str(path), "--kinds", "reference,torch"]) == 0
    out = capsys.readouterr().out
    assert "NOT REPRODUCED" in out and "torch agree" in out
    assert main(["replay", str(path), "--kinds", "reference,gpu9"]) == 2


def test_explore_out_must_be_writable(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["explore", "--toy", "--out", str(blocker)]) == 2
    assert "--out" in capsys.readouterr().err


def test_workers_auto_counts_idle_cores(monkeypatch, capsys):
    from kvref.cli.explore import auto_workers

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.9, 1.0, 1.0))
    assert auto_workers() == 1
    assert "load average 1.90 -> 1 worker" in capsys.readouterr().err
    monkeypatch.setattr(os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    assert auto_workers() == 2
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(os, "getloadavg", lambda: (3.4, 1.0, 1.0))
    assert auto_workers() == 13


def test_mutants_report_each_result(capsys, eager_progress):
    assert main(["mutants", "--only", "spec.cdiv_floor", "spec.full_pages_floor", "--checks", "spec-formulas"]) == 0
    err = capsys.readouterr().err
    assert "mutants (2): 1 done, 1 killed; last: spec.cdiv_floor killed by spec-formulas" in err
    assert "mutants (2): 2 done, 2 killed; last: spec.full_pages_floor killed by spec-formulas" in err
