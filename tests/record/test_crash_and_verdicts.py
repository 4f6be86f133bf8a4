"""A crashed, killed or empty run is never "agrees" (issue #28, issue #25): one verdict, on stdout.

The recorder writes an ``error`` record when vLLM raises inside a recorded call; check-run replays
up to it and says whether the reference raises too or what it would have done instead.
"""

from __future__ import annotations

import json

from kvref.models.run_check import check_trace

from kvref import cli
from tests.record.traces import add, full_setup, header_for, sched, update, write_trace


def _err(call: str, step: int, **inputs) -> dict:
    return {"t": "error", "call": call, "step": step, "type": "ValueError", "message": "Cannot get 3 free blocks",
            **inputs}


def test_a_crash_where_the_reference_would_have_scheduled_says_what_it_would_have_done(tmp_path):
    pool, cfg = full_setup()
    recs = [add("a", [1, 2, 3, 4, 5]), sched(0, [["a", "n", 5, 0, [[1, 2]]]]), update(0, {"a": [9]}),
            _err("schedule", 1)]
    r = check_trace(write_trace(tmp_path / "t.jsonl", header_for(pool, cfg), recs))
    assert r.crash is not None and r.crash.step == 1 and r.crash.call == "schedule" and r.crash.line == 5
    assert not r.crash.reference_raised and r.crash.reference.startswith("schedules 1 request(s)")
    assert [row[0] for row in r.crash.reference_rows] == ["a"] and r.steps_compared == 1
    assert r.verdict == "CRASH" and not r.ok and not r.followed


def test_a_crash_where_the_reference_raises_too_says_so(tmp_path):
    pool, cfg = full_setup()  # synchronous: a second schedule() before the first update is refused
    recs = [add("a", [1, 2, 3, 4, 5]), sched(0, [["a", "n", 5, 0, [[1, 2]]]]), _err("schedule", 1)]
    r = check_trace(write_trace(tmp_path / "t.jsonl", header_for(pool, cfg), recs))
    assert r.crash.reference_raised and r.crash.reference.startswith("raises too")


def test_a_crash_in_update_from_output_replays_the_recorded_inputs(tmp_path):
    pool, cfg = full_setup()
    upd = {k: v for k, v in update(0, {"a": [9]}).items() if k != "fin"}
    recs = [add("a", [1, 2, 3, 4, 5]), sched(0, [["a", "n", 5, 0, [[1, 2]]]]),
            _err("update_from_output", 0, update=upd)]
    r = check_trace(write_trace(tmp_path / "t.jsonl", header_for(pool, cfg), recs))
    assert r.crash.call == "update_from_output" and r.crash.reference == "settles the step without raising"


def test_check_run_reports_a_crash_with_one_verdict_on_stdout(tmp_path, capsys):
    pool, cfg = full_setup()
    recs = [add("a", [1, 2, 3, 4, 5]), sched(0, [["a", "n", 5, 0, [[1, 2]]]]), update(0, {"a": [9]}),
            _err("schedule", 1)]
    path = write_trace(tmp_path / "t.jsonl", header_for(pool, cfg), recs)  # an end record: shutdown() ran
    assert cli.main(["check-run", path, "--out", str(tmp_path / "cex")]) == 1
    out, err = capsys.readouterr()
    assert "CRASH: vLLM raised ValueError in schedule of step 1" in out and "reference at that point" in out
    assert out.count("verdict:") == 1 and "verdict: CRASH" in out and "verdict" not in err
    assert cli.main(["check-run", path, "--json", "--out", str(tmp_path / "cex")]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"] == "CRASH" and doc["crash"]["step"] == 1 and doc["ok"] is False


def test_a_killed_run_is_incomplete_unless_checked_live(tmp_path, capsys):
    pool, cfg = full_setup()
    recs = [add("a", [1, 2, 3, 4, 5]), sched(0, [["a", "n", 5, 0, [[1, 2]]]]), update(0, {"a": [9]})]
    path = write_trace(tmp_path / "t.jsonl", header_for(pool, cfg), recs, end=False)
    assert cli.main(["check-run", path]) == 1
    out = capsys.readouterr().out
    assert "INCOMPLETE" in out and out.strip().endswith("verdict: INCOMPLETE")
    assert cli.main(["check-run", path, "--live"]) == 0
    assert capsys.readouterr().out.strip().endswith("verdict: agrees so far")


def test_an_empty_trace_is_nothing_checked(tmp_path, capsys):
    pool, cfg = full_setup()
    path = write_trace(tmp_path / "t.jsonl", header_for(pool, cfg), [add("a", [1, 2, 3])])
    assert cli.main(["check-run", path]) == cli.EXIT_NOTHING_CHECKED
    out = capsys.readouterr().out
    assert "EMPTY" in out and out.strip().endswith("verdict: EMPTY")
    r = check_trace(path)
    assert r.empty and not r.ok
