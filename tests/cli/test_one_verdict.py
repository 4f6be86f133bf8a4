"""One verdict, one stream (issue #25): every command that ends with a verdict prints it once, on
stdout; stderr carries progress only (`check-run` printed "verdict: agrees" on stdout and
"verdict: FINDINGS" on stderr for the same run). Also: check-run's reproducer of a reproducer keeps
one ``-divergence-stepN`` suffix."""

from __future__ import annotations

import json
import os
import re

import pytest

from kvref.cli import main
from tests.hardening.cli_cases import GOOD_TRACE

#: the words a verdict line starts with, in every command
VERDICT = re.compile(r"^(verdict: |OK: |OK$|FINDINGS|NOTHING CHECKED|DIVERGENCE|REPRODUCED|NOT REPRODUCED|"
                     r"COUNTEREXAMPLE|EMPTY|INCOMPLETE|CRASH)", re.M)


#: check-run's report has sections (DIVERGENCE, CRASH, ...) and ends with one ``verdict:`` line
CHECK_RUN_VERDICT = re.compile(r"^verdict: ", re.M)


def _verdicts(capsys, argv, pattern) -> tuple[int, list[str], list[str]]:
    rc = main(argv)
    cap = capsys.readouterr()
    return rc, pattern.findall(cap.out), VERDICT.findall(cap.err) + CHECK_RUN_VERDICT.findall(cap.err)


def _one(capsys, argv, expected_rc: int, pattern=VERDICT) -> str:
    rc, out, err = _verdicts(capsys, argv, pattern)
    assert rc == expected_rc, (argv, rc, out, err)
    assert err == [], f"{argv}: a verdict on stderr: {err}"
    assert len(out) == 1, f"{argv}: {len(out)} verdicts on stdout: {out}"
    return out[0]


@pytest.fixture(scope="module")
def run_traces(tmp_path_factory):
    """A clean reference-written run trace and the same with one block id edited (a divergence)."""
    from kvref.models.run_check.generate import generate_trace
    from tests.record.traces import full_setup, read_lines, rewrite, sched_rows

    d = tmp_path_factory.mktemp("runs")
    pool, cfg = full_setup()
    clean = str(d / "run.kvtrace.gz")
    generate_trace(clean, pool, cfg, steps=60, seed=3)
    target = next((rec["step"], row[0]) for rec in read_lines(clean)[1:] if rec["t"] == "sched" and rec["step"] >= 5
                  for row in sched_rows(rec) if row[4] and any(row[4]))

    def edit(rec):
        if rec["t"] == "sched" and rec["step"] == target[0]:
            tables = [e[2] for e in rec["new"] if e[0] == target[1]]
            tables += [b for i, b in zip(rec["cached"][0], rec["cached"][2]) if i == target[1]]
            g = next(i for i, ids in enumerate(tables[0]) if ids)
            tables[0][g][-1] += 1000

    bad = rewrite(clean, d / "bad.kvtrace.gz", edit)
    return clean, bad, target[0]


def test_watch_has_one_verdict_on_stdout(capsys) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert _one(capsys, ["watch", f"tcp://127.0.0.1:{port}", "--seconds", "0.2"], 3) == "NOTHING CHECKED"


def test_replay_has_one_verdict_on_stdout(capsys, tmp_path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(GOOD_TRACE))
    assert _one(capsys, ["replay", str(path), "--kinds", "reference"], 0) == "OK: "
    path.write_text(json.dumps({**GOOD_TRACE, "ops": []}))
    assert _one(capsys, ["replay", str(path), "--kinds", "reference"], 3) == "NOTHING CHECKED"
    out = tmp_path / "findings"
    assert main(["explore", "--toy", "--out", str(out), "--quiet"]) == 1
    capsys.readouterr()
    assert _one(capsys, ["replay", str(out / "explore-toy-deadlock-1.json")], 1) == "REPRODUCED"


def test_check_run_has_one_verdict_on_stdout(capsys, run_traces, tmp_path) -> None:
    clean, bad, _ = run_traces
    assert _one(capsys, ["check-run", clean, "--out", str(tmp_path)], 0, CHECK_RUN_VERDICT) == "verdict: "
    assert _one(capsys, ["check-run", bad, "--out", str(tmp_path)], 1, CHECK_RUN_VERDICT) == "verdict: "


def test_a_reproducer_of_a_reproducer_keeps_one_suffix(capsys, run_traces, tmp_path) -> None:
    _, bad, step = run_traces
    first = tmp_path / "first"
    assert main(["check-run", bad, "--out", str(first)]) == 1
    assert os.listdir(first) == [f"bad-divergence-step{step}.kvtrace.gz"]
    repro = str(first / f"bad-divergence-step{step}.kvtrace.gz")
    second = tmp_path / "second"
    assert main(["check-run", repro, "--out", str(second)]) == 1
    assert os.listdir(second) == [f"bad-divergence-step{step}.kvtrace.gz"]  # not ...-step9-divergence-step9
    capsys.readouterr()
    assert main(["check-run", repro, "--out", str(first)]) == 1  # in place: it is its own reproducer
    assert f"reproducer: {repro} " in capsys.readouterr().out
    assert os.listdir(first) == [f"bad-divergence-step{step}.kvtrace.gz"]


def test_check_run_of_a_trace_with_no_step_is_never_agrees(capsys, tmp_path) -> None:
    """No false green (issue #25): a trace whose run never scheduled checked nothing."""
    from tests.record.traces import full_setup, header_for, write_trace

    pool, cfg = full_setup()
    empty = write_trace(str(tmp_path / "empty.kvtrace.gz"), header_for(pool, cfg), [])
    rc = main(["check-run", empty, "--out", str(tmp_path)])
    cap = capsys.readouterr()
    assert rc != 0 and len(CHECK_RUN_VERDICT.findall(cap.out)) == 1 and "verdict:" not in cap.err
    verdict = next(line for line in cap.out.splitlines() if line.startswith("verdict: "))
    assert "agrees" not in verdict and "hold" not in verdict, verdict
