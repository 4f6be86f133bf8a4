"""``kvref verify``'s second process (kvref.verify_ahead, #22): same rows, same order, same inputs.

The whole default run with and without it is compared in BENCHMARKS.md (session 17); these tests
pin the parts that decide it: which reads of Hypothesis' constant pool are counted, the order of
the rows whatever order they finish in, the wait of a pool-reading check for the rows before it,
the run again of a check that read the pool where it should not have, and a real second process.
About 10 s at CI=true (three second processes, each running the ``spec`` check).
"""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from kvref.check_context import Check
from kvref.checks import AHEAD, CHECKS, DRAWS_CONSTANTS
from kvref.report import FAILED, PASSED, CheckResult
from kvref.verify_ahead import AheadRun, _PoolReads, local_modules, run_verify_ahead


def _draw_many() -> None:
    @settings(max_examples=30, database=None, deadline=None)
    @given(st.lists(st.integers(0, 10**6), min_size=5))
    def t(xs):
        pass

    t()


def test_pool_reads_count_the_constant_pool_and_not_the_switched_off_runs():
    from kvref.models.hypothesis_runs.reproducible import same_inputs_in_every_process

    with _PoolReads() as reads:
        _draw_many()
        drawn = reads.count
        with same_inputs_in_every_process():
            _draw_many()
        assert reads.count == drawn  # the machine runners' pool-free runs are not counted
    assert drawn > 0
    from hypothesis.internal.conjecture import providers

    assert providers._get_local_constants.__name__ == "_get_local_constants"  # restored


def test_the_split_names_checks_that_exist_and_no_pool_reader_runs_ahead():
    names = {c.name for c in CHECKS}
    assert set(AHEAD) <= names and set(DRAWS_CONSTANTS) <= names
    assert not set(AHEAD) & set(DRAWS_CONSTANTS)


class FakeAhead:
    """The second process' side of the loop: rows come in ``arrivals`` order, one per ``ready``."""

    def __init__(self, names, results, pool_reader=()):
        self.names = list(names)
        self.results = results
        self.arrived: list[str] = []
        self.pending = list(names)
        self.taken: list[str] = []
        self.notes: list[str] = []
        self.closed = False
        self.pool_reader = set(pool_reader)
        self.events: list[str] = []

    def ready(self, name):
        return name in self.arrived

    def take(self, name):
        while name not in self.arrived:  # a blocking take: everything up to it arrives
            self.arrived.append(self.pending.pop(0))
        self.taken.append(name)
        self.events.append(f"take {name}")
        return None if name in self.pool_reader else self.results[name]

    def close(self):
        self.closed = True


def _checks(*names):
    return [Check(n, n, lambda ctx: None) for n in names]


def _run(checks, ahead, statuses=None, exitfirst=False, here_reads=None):
    statuses = statuses or {}
    ran, reported = [], []

    def run_here(check):
        ran.append(check.name)
        ahead.events.append(f"run {check.name}")
        if here_reads and check.name in here_reads and ran.count(check.name) == 1:
            _draw_many()  # reads the pool (the test runs under the loop's counter)
        return CheckResult(check.name, statuses.get(check.name, PASSED), "here", examined=1)

    def report(result):
        reported.append(result.name)
        return exitfirst and result.failing

    said = []
    rows, interrupted = run_verify_ahead(checks, ahead, run_here, report, lambda i, c: None,
                                         lambda r: said.append(r.name))
    ahead.said = said
    return rows, interrupted, ran, reported


def test_rows_come_in_the_checks_order_and_a_pool_reader_waits_for_the_rows_before_it():
    checks = _checks("spec", "proofs", "machine-reference", "conform-scheduler", "conform-kv-manager",
                     "conform-tiering", "conform-offload")
    ahead = FakeAhead(["proofs", "conform-scheduler", "conform-tiering"],
                      {n: CheckResult(n, PASSED, "ahead", examined=1)
                       for n in ("proofs", "conform-scheduler", "conform-tiering")})
    rows, interrupted, ran, reported = _run(checks, ahead)
    assert interrupted is None and ahead.closed
    assert [r.name for r in rows] == reported == [c.name for c in checks]
    assert ran == ["spec", "machine-reference", "conform-kv-manager", "conform-offload"]
    # conform-kv-manager draws from the pool: proofs and conform-scheduler were taken (their modules
    # imported) before it ran; machine-reference ran without waiting; conform-tiering came after
    ev = ahead.events
    assert ev.index("run machine-reference") < ev.index("take proofs")
    assert ev.index("take conform-scheduler") < ev.index("run conform-kv-manager") < ev.index("take conform-tiering")


def test_exitfirst_stops_at_the_first_failing_row_in_order():
    checks = _checks("spec", "proofs", "machine-reference", "conform-offload")
    ahead = FakeAhead(["proofs"], {"proofs": CheckResult("proofs", FAILED, "ahead", examined=1)})
    rows, interrupted, ran, reported = _run(checks, ahead, statuses={"conform-offload": FAILED}, exitfirst=True)
    # conform-offload ran meanwhile (it failed too), but the report stops at the first failing row in order
    assert [r.name for r in rows] == reported == ["spec", "proofs"] and rows[-1].status == FAILED
    assert ahead.closed and ahead.said == ["conform-offload"]  # its finding was said when it was made


def test_a_check_that_read_the_pool_over_there_runs_here():
    checks = _checks("spec", "proofs", "machine-reference")
    ahead = FakeAhead(["proofs"], {}, pool_reader={"proofs"})
    rows, _, ran, _ = _run(checks, ahead)
    assert [r.name for r in rows] == ["spec", "proofs", "machine-reference"]
    assert rows[1].summary == "here" and "proofs" in ran


def test_a_check_here_that_read_the_pool_with_rows_before_it_out_runs_again_in_its_turn():
    checks = _checks("spec", "proofs", "machine-reference")
    ahead = FakeAhead(["proofs"], {"proofs": CheckResult("proofs", PASSED, "ahead", examined=1)})
    rows, _, ran, _ = _run(checks, ahead, here_reads={"machine-reference"})
    assert ran == ["spec", "machine-reference", "machine-reference"]
    assert any("machine-reference drew Hypothesis constants" in n for n in ahead.notes)
    assert [r.name for r in rows] == ["spec", "proofs", "machine-reference"]


def test_a_real_second_process_reports_what_this_one_would(tmp_path):
    import sys

    import kvref.baseline  # noqa: F401  (kvref verify has loaded them when it starts the second process)
    import kvref.quiet  # noqa: F401
    from kvref.baseline import Baseline
    from kvref.check_context import VerifyContext
    from kvref.checks import check_named
    from kvref.verify import run_check

    ctx = VerifyContext(out_dir=str(tmp_path))
    run = AheadRun(["spec"], ctx, None, False)
    try:
        assert not run.notes  # it started with no kvref module this process lacks
        got = run.take("spec")
    finally:
        run.close()
    here = run_check(check_named("spec"), ctx, Baseline())
    assert got is not None and (got.status, got.summary, got.examined) == (here.status, here.summary, here.examined)
    assert "kvref.verify_ahead" in local_modules()
    # a second process that loaded a kvref module this one had not: its rows would come with a pool
    # this process never had, so every check runs here
    saved = sys.modules.pop("kvref.quiet")
    try:
        run = AheadRun(["spec"], ctx, None, False)
        assert run.take("spec") is None and "kvref.quiet" in run.notes[0]
    finally:
        run.close()
        sys.modules["kvref.quiet"] = saved


def test_kvref_verify_with_a_second_process_reports_the_one_process_rows(monkeypatch, capsys, tmp_path):
    import json

    from kvref import checks, cli

    monkeypatch.setattr(checks, "AHEAD", ("spec",))  # the second process runs spec (its own registry's)
    argv = ["verify", "--only", "spec", "machine-offload", "--json", "--out", str(tmp_path)]
    reports = []
    for jobs in ("2", "1"):
        assert cli.main([*argv, "--jobs", jobs]) == 0
        out, err = capsys.readouterr()
        assert "second process:" not in err  # it ran spec: no note that it gave up or ran it here
        reports.append(json.loads(out)["checks"])
    two, one = ([(c["name"], c["status"], c["summary"], c["examined"]) for c in r] for r in reports)
    assert two == one and [row[0] for row in two] == ["spec", "machine-offload"]


def test_jobs_auto_takes_a_second_process_only_where_the_load_leaves_a_core(monkeypatch):
    import os

    from kvref.cli.verify import jobs_for

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    for load, want in ((0.3, 2), (1.7, 2), (2.0, 1), (5.5, 1)):
        monkeypatch.setattr(os, "getloadavg", lambda load=load: (load, load, load))
        n, why = jobs_for("auto")
        assert n == want and f"{load:.2f}" in why
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert jobs_for("auto")[0] == 1
    assert jobs_for("2") == (2, "") and jobs_for("1") == (1, "")
