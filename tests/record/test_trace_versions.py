"""Trace format versions (issue #28): the reader takes every older version it can read and refuses a
newer one by its header, with the version named (``kvref check-run``: exit 2). Version 5 (session
14) marks session 13's ``stats.skip`` and adds the stop inputs on ``add``; version 6 (session 16)
records streaming-input sessions (``add.resumable``); the version-4 traces
checked in beside these tests were written by the version-4 recorder (vLLM 0.33.0)."""

from __future__ import annotations

import glob
import gzip
import json
import os

import pytest

from kvref import cli
from kvref.impl.run_trace import TraceReader
from kvref.impl.run_trace.format import VERSION, TraceFormatError
from kvref.models.run_check import check_trace
from kvref.models.run_check.generate import generate_trace
from tests.record.traces import hybrid_setup, read_lines, rewrite

DATA = os.path.join(os.path.dirname(__file__), "data")
V4_TRACES = sorted(glob.glob(os.path.join(DATA, "*.kvtrace.gz")))


def test_the_writer_writes_version_7():
    assert VERSION == 7


@pytest.mark.parametrize("path", V4_TRACES, ids=os.path.basename)
def test_a_version_4_trace_written_by_the_v4_recorder_reads_and_checks(path):
    with TraceReader(path) as reader:
        assert reader.header["version"] == 4
        records = [rec for _, rec in reader.records()]
    assert records and records[-1]["t"] == "end"
    assert not any("eos" in rec or "rep" in rec for rec in records if rec["t"] == "add")
    r = check_trace(path)
    assert r.steps_compared > 0 and r.verdict in ("agrees", "FINDINGS", "CRASH", "properties hold")


def test_session_13s_skip_key_reads_in_a_version_4_trace(tmp_path):
    """Session 13's recorder wrote ``stats.skip`` under version 4 (a session-12 reader refused the
    key by line): this reader takes it in both versions, and a replay of the same run agrees."""
    pool, cfg = hybrid_setup(num_blocks=None)
    src = str(tmp_path / "src.kvtrace.gz")
    generate_trace(src, pool, cfg, steps=120, seed=5)

    def with_stats(rec):
        if rec["t"] == "update":
            rec["stats"] = {"skip": 0}
        return rec

    for version in (4, 5, 6):  # version 6 (streaming sessions) reads both older versions' skip key
        out = rewrite(src, tmp_path / f"v{version}.kvtrace.gz", with_stats, version=version)
        with TraceReader(out) as reader:
            assert reader.header["version"] == version
            assert all(rec["stats"] == {"skip": 0} for _, rec in reader.records() if rec["t"] == "update")


def test_a_version_4_trace_keeps_its_eos_in_stop_and_replays_as_version_5_does(tmp_path):
    """A version-4 ``add`` has no ``eos`` (its ``stop`` holds the EOS id, as the recorder merged
    them): the same run written as version 5 with the id also named ``eos`` checks the same, stops
    included (check_stop tests both before the length caps, so either gives reason ``stop``)."""
    pool, cfg = hybrid_setup(num_blocks=None)
    src = str(tmp_path / "src.kvtrace.gz")
    generate_trace(src, pool, cfg, steps=300, seed=7)
    assert any(why == "stop" for rec in read_lines(src)[1:] if rec["t"] == "update" for _, why in rec["fin"])

    def named_eos(rec):
        if rec["t"] == "add" and rec["stop"]:
            rec["eos"] = rec["stop"][0]
        return rec

    v5 = rewrite(src, tmp_path / "v5.kvtrace.gz", named_eos)
    v4 = rewrite(src, tmp_path / "v4.kvtrace.gz", lambda rec: rec, version=4)
    r5, r4 = check_trace(v5, check_invariants_every=1), check_trace(v4, check_invariants_every=1)
    assert r5.ok and r5.followed and r5.summary["finished"].get("stop"), r5.divergence and r5.divergence.table()
    assert (r4.ok, r4.followed, r4.steps_compared, r4.summary) == (r5.ok, r5.followed, r5.steps_compared, r5.summary)


def _newer(tmp_path) -> str:
    pool, cfg = hybrid_setup(num_blocks=None)
    src = str(tmp_path / "src.kvtrace.gz")
    generate_trace(src, pool, cfg, steps=20, seed=1)
    lines = read_lines(src)
    out = str(tmp_path / "newer.kvtrace.gz")
    with gzip.open(out, "wt", encoding="utf-8") as f:  # by hand: kvref's writer refuses it too
        for rec in [{**lines[0], "version": VERSION + 1}] + lines[1:]:
            f.write(json.dumps(rec) + "\n")
    return out


def test_a_newer_version_is_refused_by_its_header_with_the_version_named(tmp_path):
    path = _newer(tmp_path)
    with pytest.raises(TraceFormatError) as e:
        TraceReader(path)
    msg = str(e.value)
    assert isinstance(e.value, ValueError) and "version" in msg and str(VERSION + 1) in msg
    assert f"at most {VERSION}" in msg and path in msg


def test_check_run_exits_2_on_a_newer_version(tmp_path, capsys):
    path = _newer(tmp_path)
    assert cli.main(["check-run", path]) == 2
    err = capsys.readouterr().err
    assert "version" in err and f"at most {VERSION}" in err and "Traceback" not in err


def test_a_version_5_add_with_bad_stop_inputs_is_named(tmp_path):
    pool, cfg = hybrid_setup(num_blocks=None)
    src = str(tmp_path / "src.kvtrace.gz")
    generate_trace(src, pool, cfg, steps=10, seed=2)
    for key, value in (("eos", -1), ("min", 10_000), ("rep", [1, 2, 3]), ("rep", [2, 0, 1])):
        def bad(rec, key=key, value=value):
            if rec["t"] == "add":
                rec[key] = value
            return rec

        out = rewrite(src, tmp_path / f"bad-{key}.kvtrace.gz", bad)
        with pytest.raises(TraceFormatError) as e, TraceReader(out) as reader:
            for _ in reader.records():
                pass
        assert key in str(e.value) and json.dumps(value) .replace(" ", "") in str(e.value).replace(" ", "")
