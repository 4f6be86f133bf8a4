"""``kvref check-run`` on traces the reference wrote (no vLLM needed): agreement, the first
divergence at the edited step with a reproducer, each run property, unmodelled features, exit codes."""

from __future__ import annotations

import json

import pytest
from kvref.models.run_check import check_trace, write_reproducer
from kvref.models.run_check.generate import generate_trace

from kvref import cli
from tests.record.traces import (
    add,
    full_setup,
    header_for,
    hybrid_setup,
    read_lines,
    rewrite,
    sched,
    sched_rows,
    update,
    write_trace,
)


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("traces")
    out = {}
    for name, (pool, cfg) in {"sync": hybrid_setup(), "async": hybrid_setup(async_scheduling=True),
                              "tight": hybrid_setup(num_blocks=None)}.items():
        path = str(d / f"{name}.kvtrace.gz")
        generate_trace(path, pool, cfg, steps=400, seed=7)
        out[name] = path
    return out


@pytest.mark.parametrize("name", ["sync", "async", "tight"])
def test_a_trace_the_reference_wrote_agrees_with_the_reference(traces, name):
    r = check_trace(traces[name], check_invariants_every=1)
    assert r.ok and r.followed and r.steps_compared == 400, r.divergence and r.divergence.table()
    s = r.summary
    assert s["steps"] == 400 and s["requests"] > 50 and sum(s["finished"].values()) > 40
    if name == "tight":
        assert s["preemptions"] > 0


def test_a_pool_startup_should_have_refused_starves_and_is_reported(tmp_path):
    """24 blocks cannot hold one 64-token request here: the reference (like vLLM 0.33.0) keeps the
    head-of-line hang, and the run property reports it."""
    pool, cfg = hybrid_setup(num_blocks=24)
    path = str(tmp_path / "t.kvtrace.gz")
    generate_trace(path, pool, cfg, steps=60, seed=7)
    r = check_trace(path)
    assert r.followed and r.divergence is None  # the reference agrees with itself...
    assert [f.kind for f in r.findings] == ["starvation"]  # ...and the run starves


def _first_sched_with_blocks(path, min_step=20):
    for rec in read_lines(path)[1:]:
        if rec["t"] == "sched" and rec["step"] >= min_step:
            for row in sched_rows(rec):
                if row[4] and any(row[4]):
                    return rec["step"], row[0]
    raise AssertionError("no step allocated blocks")


def test_an_edited_block_id_is_the_first_divergence_and_the_reproducer_reproduces_it(traces, tmp_path, capsys):
    step, rid = _first_sched_with_blocks(traces["sync"])

    def edit(rec):
        if rec["t"] == "sched" and rec["step"] == step:
            tables = [e[2] for e in rec["new"] if e[0] == rid]
            tables += [b for i, b in zip(rec["cached"][0], rec["cached"][2]) if i == rid]
            g = next(i for i, ids in enumerate(tables[0]) if ids)
            tables[0][g][-1] += 1000  # a block the reference did not hand out
    bad = rewrite(traces["sync"], tmp_path / "bad.kvtrace.gz", edit)
    r = check_trace(bad)
    assert r.divergence is not None and r.divergence.step == step and r.divergence.call == "schedule"
    assert rid in r.divergence.message and r.steps_compared == step
    table = r.divergence.table()
    assert "recorded" in table and "reference" in table and f"*{rid}" in table
    # 1000+ is beyond the 40-block pool; the recorded free count then has a block no live request holds
    assert [f.kind for f in r.findings] == ["block_out_of_pool", "conservation"]
    repro = write_reproducer(bad, r.divergence, tmp_path / "repro.kvtrace.gz")
    r2 = check_trace(repro)
    assert r2.divergence is not None and r2.divergence.step == step and r2.divergence.line == r.divergence.line
    assert r2.summary["steps"] == step + 1 and not r2.truncated
    # the CLI: exit 1, the table, a reproducer under --out
    assert cli.main(["check-run", bad, "--out", str(tmp_path / "out")]) == 1
    out = capsys.readouterr().out
    assert "DIVERGENCE" in out and f"step {step}" in out and "reproducer:" in out
    assert list((tmp_path / "out").glob("*.kvtrace.gz"))


def test_changed_sampled_tokens_diverge_at_the_finish(tmp_path):
    """A stop token the recorded engine sampled but did not stop on: the finishes differ."""
    pool, cfg = full_setup()
    h = header_for(pool, cfg)
    h_stop = [add("a", [1, 2, 3], max_tokens=5)]
    h_stop[0]["stop"] = [9]
    recs = h_stop + [
        sched(0, [["a", "n", 3, 0, [[1]]]]),
        update(0, {"a": [9]}),  # 9 is a stop token: must finish
    ]
    r = check_trace(write_trace(tmp_path / "t.jsonl", h, recs))
    assert r.divergence is not None and r.divergence.call == "update_from_output"
    assert r.divergence.reference_extra == {"finished": {"a": "stop"}}


def test_starvation_while_idle_is_reported_without_the_reference(tmp_path):
    pool, cfg = full_setup()
    recs = [add("a", [1] * 20)] + [rec for k in range(5) for rec in (sched(k, []), update(k, {}))]
    path = write_trace(tmp_path / "t.jsonl", header_for(pool, cfg), recs)
    r = check_trace(path, properties_only=True)
    assert [f.kind for f in r.findings] == ["starvation"] and "#39734" in r.findings[0].message
    assert r.divergence is None and not r.followed and r.summary["longest_wait_steps"] == 4
    assert check_trace(path, properties_only=True, starvation_steps=6).ok  # 5 idle steps < 6
    r = check_trace(path)  # the reference admits "a" at once: a divergence at step 0 as well
    assert r.divergence is not None and r.divergence.step == 0


def test_idle_waits_outside_the_scheduler_are_not_starvation(tmp_path):
    """A grammar compiling (structured output) or a remote KV load (connector) keeps a request
    waiting while nothing runs; that is not the #39734 hang."""
    pool, cfg = full_setup()
    idle = [rec for k in range(5) for rec in (sched(k, []), update(k, {}))]
    path = write_trace(tmp_path / "t.jsonl", header_for(pool, cfg), [add("a", [1] * 20, x=["structured_output"])] + idle)
    assert check_trace(path).ok
    h = header_for(pool, cfg)
    h["unmodelled"] = ["kv_connector"]
    r = check_trace(write_trace(tmp_path / "t2.jsonl", h, [add("a", [1] * 20)] + idle))
    assert r.ok and r.summary["starvation_check"].startswith("off: kv_connector")
    # version 3 records the pending remote loads: the check is on, except while a load is pending
    loading = [rec for k in range(5) for rec in (dict(sched(k, []), loading=1), update(k, {}))]
    assert check_trace(write_trace(tmp_path / "t3.jsonl", h, [add("a", [1] * 20)] + loading)).ok
    loaded = [rec for k in range(5) for rec in (dict(sched(k, []), loading=0), update(k, {}))]
    r = check_trace(write_trace(tmp_path / "t4.jsonl", h, [add("a", [1] * 20)] + loaded))
    assert [f.kind for f in r.findings] == ["starvation"] and r.summary["starvation_check"].startswith("on")


def test_a_block_shared_outside_a_prefix_hit_is_reported(tmp_path):
    pool, cfg = full_setup()
    recs = [add("a", [1, 2, 3, 4, 5]), add("b", [6, 7, 8, 9, 10]),
            sched(0, [["a", "n", 5, 0, [[1, 2]]], ["b", "n", 5, 0, [[2, 3]]]])]
    r = check_trace(write_trace(tmp_path / "t.jsonl", header_for(pool, cfg), recs), properties_only=True)
    assert [f.kind for f in r.findings] == ["reused_while_needed"] and "block 2" in r.findings[0].message


def test_a_prefix_hit_may_share_blocks(tmp_path):
    pool, cfg = full_setup()
    recs = [add("a", [1, 2, 3, 4, 5]),
            sched(0, [["a", "n", 5, 0, [[1, 2]]]]),
            update(0, {"a": [11]}),
            add("b", [1, 2, 3, 4, 6]),  # shares a's first (full, cached) block
            sched(1, [["a", "c", 1, 5, None], ["b", "n", 1, 4, [[1, 3]]]]),
            update(1, {"a": [12], "b": [13]})]
    r = check_trace(write_trace(tmp_path / "t.jsonl", header_for(pool, cfg), recs), check_invariants_every=1)
    assert r.ok and r.followed, (r.findings, r.divergence and r.divergence.table())
    assert r.summary["prefix_hits"] == 1 and r.summary["prefix_hit_rate"] == pytest.approx(4 / 10)


def test_an_unmodelled_feature_stops_the_replay_not_the_properties(tmp_path, capsys):
    pool, cfg = full_setup()
    recs = [add("a", [1, 2, 3], x=["structured_output"]),
            sched(0, [["a", "n", 3, 0, [[1]]]]),  # block 1: the free queue's head
            update(0, {"a": [4]})]
    path = write_trace(tmp_path / "t.jsonl", header_for(pool, cfg), recs)
    r = check_trace(path)
    assert r.ok and not r.followed and "structured_output" in r.stopped_because and r.stopped_at_line == 2
    assert cli.main(["check-run", path]) == 0
    assert "cannot follow" in capsys.readouterr().out
    h = header_for(pool, cfg)
    h["unmodelled"] = ["spec_decode"]
    r = check_trace(write_trace(tmp_path / "t2.jsonl", h, recs[1:] and [add("a", [1, 2, 3])] + recs[1:]))
    assert r.ok and not r.followed and r.stopped_because == "spec_decode"


def test_cli_exit_codes_and_json(traces, tmp_path, capsys):
    assert cli.main(["check-run", traces["async"], "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["followed"] and out["summary"]["steps"] == 400
    junk = tmp_path / "junk.gz"
    junk.write_bytes(b"\x1f\x8bnot really gzip")
    assert cli.main(["check-run", str(junk)]) == 2
    assert "junk.gz" in capsys.readouterr().err
    assert cli.main(["check-run", str(tmp_path / "missing.gz")]) == 2
    assert cli.main(["check-run", traces["async"], "--starvation-steps", "0"]) == 2
