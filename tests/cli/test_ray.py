"""``--ray`` (issue #27): the same verdicts as a local run, a dead worker retried once then an
error, Ctrl-C cancelling the remote work, a clear exit 2 without Ray or with mismatched workers.

One local Ray cluster for the module (tests/cli/ray_cluster.py): 2 CPUs, no dashboard, on 127.0.0.1 only.
"""

from __future__ import annotations

import os
import time

import pytest

from tests.cli.ray_cluster import (interrupt_when, local_and_ray, ray, ray_cluster,  # noqa: F401  (the module's cluster)
                                   report, run_kvref)

from kvref import cli
from kvref.ray_runner import Unit, check_versions, run_units
from kvref.spec.errors import InvalidFieldError


def _rows(report: dict) -> list[tuple]:
    """What a verify --json report found, without the timings."""
    return [(c["name"], c["status"], c["summary"], c.get("examined")) for c in report["checks"]]


def _junit(path) -> list[tuple]:
    """A JUnit report's test cases: name, and what they carry (failure, error, skipped) with its message."""
    import xml.etree.ElementTree as ET

    return [(case.get("name"), [(child.tag, child.get("message")) for child in case
                                if child.tag in ("failure", "error", "skipped")])
            for case in ET.parse(path).iter("testcase")]


def test_verify_on_ray_draws_the_local_traces_and_names_the_workers(ray_cluster, tmp_path):
    """Two generated-trace checks with a seed: the same traces (op counts, preemptions...) on Ray,
    merged into the same JSON and JUnit report, which names the workers' versions."""
    argv = ["verify", "--only", "spec", "machine-reference", "machine-scheduler", "--json", "--seed", "3",
            "--out", str(tmp_path)]
    local = run_kvref(*argv, "--junit-xml", str(tmp_path / "local.xml"))
    assert local.returncode == 0, local.stderr
    remote = run_kvref(*argv, "--junit-xml", str(tmp_path / "ray.xml"), "--ray", ray_cluster)
    assert remote.returncode == 0, remote.stderr
    local, remote = report(local), report(remote)
    assert _rows(remote) == _rows(local) and len(_rows(local)) == 3
    assert _junit(tmp_path / "ray.xml") == _junit(tmp_path / "local.xml")
    probe = remote["ray"]
    from kvref import __version__

    assert probe["driver"]["kvref"] == __version__ and probe["nodes"][0]["kvref"] == __version__
    assert probe["nodes"][0]["python"] == probe["driver"]["python"] and probe["cpus"] == 2
    assert probe["nodes"][0]["vllm"] == probe["driver"]["vllm"] and "ray" not in local


def _mutant_rows(report: dict) -> list[tuple]:
    return [(r["mutant"], r["killed"], r["by"], r["reason"]) for r in report["mutants"]]


def test_mutants_on_ray_kill_what_the_local_campaign_kills(ray_cluster):
    """Planted faults (a pool and a spec mutant) and a mutant the selection cannot kill: same rows."""
    argv = ["mutants", "--only", "pool.touch_no_ref", "spec.cdiv_floor", "sched.fcfs_victim_oldest",
            "--checks", "spec-formulas", "pool-machine", "--budget", "20", "--json"]
    local, remote, err = local_and_ray(argv, ray_cluster)
    assert _mutant_rows(remote) == _mutant_rows(local)
    assert [r[1] for r in _mutant_rows(local)] == ["yes", "yes", "NO"]  # the blind one survives
    assert "on Ray: 1 node(s), 2 CPU(s)" in err  # the workers' versions, named


def test_a_mutant_whose_unit_died_twice_is_an_error_not_a_survivor_or_a_kill(monkeypatch):
    from kvref import ray_mutants
    from kvref.models.mutants.catalogue import CATALOGUE
    from kvref.ray_runner import RunOutcome, UnitOutcome

    def fake_run_units(units, on_done=None, max_retries=1, modules=None):
        outs = [UnitOutcome(u.key, value=None) if u.fn is ray_mutants.baseline_unit else
                UnitOutcome(u.key, error="WorkerCrashedError on Ray after 2 attempt(s)") for u in units]
        for o in outs:
            if on_done is not None:
                on_done(o)
        return RunOutcome(outs)

    monkeypatch.setattr(ray_mutants, "run_units", fake_run_units)
    res, errors = ray_mutants.run_reference_mutants([CATALOGUE["spec.cdiv_floor"]], ["spec-formulas"], 5, False, False)
    assert errors == {"spec.cdiv_floor": "WorkerCrashedError on Ray after 2 attempt(s)"}
    [row] = res.results
    assert not row.killed and row.reason.startswith("error on Ray: WorkerCrashedError")


@pytest.mark.vllm
def test_a_vllm_source_fault_on_ray_is_caught_as_locally(ray_cluster):
    """``--target vllm``: the clean vLLM and a planted source fault each a unit on a worker (its
    own overlay of the worker's vLLM): the clean vLLM survives and the fault is killed by the same
    check as in the local campaign."""
    from tests.vllm_env import require_vllm

    require_vllm()
    argv = ["mutants", "--target", "vllm", "--faults", "pool.free_count_off_by_one", "--checks",
            "conform-kv-manager", "--json"]
    local, remote, err = local_and_ray(argv, ray_cluster)

    def verdicts(r):
        return ([(f["id"], f["outcome"], f["killed_by"], f["checks"]) for f in [r["baseline"], *r["faults"]]],
                r["dropped_checks"], r["checks"])

    assert verdicts(remote) == verdicts(local)
    assert verdicts(local)[0] == [("(clean)", "survived", None, {"conform-kv-manager": "passed"}),
                                  ("pool.free_count_off_by_one", "killed", "conform-kv-manager",
                                   {"conform-kv-manager": "failed"})]
    assert "clean vLLM (baseline) on Ray" in err and "clean vLLM: survived" in err and "on Ray: 1 node(s)" in err


def test_a_failing_check_on_the_clean_reference_stops_the_campaign_on_ray_too(capsys, monkeypatch):
    """The clean-reference rule holds on Ray: a baseline unit that fails means no mutant runs."""
    from kvref import ray_mutants
    from kvref.ray_runner import UnitOutcome

    def fake_run_units(units, on_done=None, max_retries=1):
        from kvref.ray_runner import RunOutcome

        return RunOutcome([UnitOutcome(u.key, error="WorkerCrashedError on Ray after 2 attempt(s)") for u in units])

    monkeypatch.setattr(ray_mutants, "run_units", fake_run_units)
    res, errors = ray_mutants.run_reference_mutants([], ["spec-formulas"], 5, False, False)
    assert res.baseline_failures == {"spec-formulas": "error on Ray: WorkerCrashedError on Ray after 2 attempt(s)"}
    assert res.results == [] and errors == {}


# --------------------------------------------------------------------------------------------
# units: retry, error, interrupt (module-level functions: the workers import them)


def exit_on_first_attempt(marker_dir: str, name: str) -> str:
    """Kills its worker process the first ``fail_times`` attempts (each attempt leaves a file)."""
    attempts = len([f for f in os.listdir(marker_dir) if f.startswith(name)])
    with open(os.path.join(marker_dir, f"{name}.{attempts}"), "w"):
        pass
    if name.startswith("always") or attempts == 0:
        os._exit(17)
    return f"{name} done on attempt {attempts + 1}"


def raises(x: int) -> int:
    raise ValueError(f"bad unit {x}")


def sleeps(seconds: float, marker: str) -> str:
    time.sleep(seconds)
    with open(marker, "w") as fh:  # reached only if the unit was not cancelled
        fh.write("finished")
    return "slept"


def quick(x: int) -> int:
    return x * 2


def test_a_dead_worker_is_retried_once_then_an_error_never_a_pass(tmp_path):
    run = run_units([Unit("flaky", exit_on_first_attempt, (str(tmp_path), "flaky")),
                     Unit("always", exit_on_first_attempt, (str(tmp_path), "always")),
                     Unit("raises", raises, (7,)), Unit("fine", quick, (21,))])
    flaky, always, raised, fine = run.outcomes
    assert flaky.ok and flaky.value == "flaky done on attempt 2"
    assert not always.ok and always.value is None and "2 attempt(s)" in always.error
    assert sorted(os.listdir(tmp_path)) == ["always.0", "always.1", "flaky.0", "flaky.1"]  # retried once each
    assert not raised.ok and "ValueError: bad unit 7" in raised.error  # an exception is not retried
    assert fine.ok and fine.value == 42
    assert not run.interrupted


def test_ctrl_c_cancels_the_remote_work_and_says_which_units_did_not_finish(tmp_path):
    marker = tmp_path / "slow-finished"
    seen = []

    def on_done(o):
        seen.append(o.key)
        raise KeyboardInterrupt  # Ctrl-C as the first result arrives

    run = run_units([Unit("slow", sleeps, (120.0, str(marker))), Unit("quick", quick, (1,))], on_done=on_done)
    assert run.interrupted
    slow, fast = run.outcomes
    assert seen == ["quick"] and fast.ok and fast.value == 2
    assert slow.cancelled and "interrupted (Ctrl-C)" in slow.error
    with pytest.raises(ray.exceptions.TaskCancelledError):  # ray.cancel reached it: it never finished
        ray.get(run.refs[0], timeout=60)
    assert not marker.exists()


def test_ctrl_c_during_verify_on_ray_writes_the_partial_report_and_exits_130(ray_cluster, tmp_path):
    """SIGINT once a quick check has reported, while a nightly-profile check (minutes) still runs
    on its worker: exit 130, the finished row kept, the running one an interrupted error."""
    junit = tmp_path / "r.xml"
    done = interrupt_when(["verify", "--only", "spec", "machine-scheduler", "--profile", "nightly", "--json",
                           "--junit-xml", str(junit), "--out", str(tmp_path), "--ray", ray_cluster], "spec: passed")
    assert done.returncode == 130, done.stderr
    got = report(done)
    assert got["interrupted"] is True and "ray" in got
    assert [(c["name"], c["status"]) for c in got["checks"]] == [("spec", "passed"), ("machine-scheduler", "error")]
    assert "cancelled on Ray" in got["checks"][1]["summary"]
    assert [n for n, _ in _junit(junit)] == ["spec", "machine-scheduler"]


def test_ctrl_c_during_a_mutant_campaign_on_ray_exits_130(ray_cluster):
    """SIGINT while the clean-reference unit (a huge budget: minutes) runs on a worker: exit 130,
    no table (the campaign did not finish)."""
    done = interrupt_when(["mutants", "--only", "pool.touch_no_ref", "--checks", "pool-machine", "--budget",
                           "1000000", "--json", "--ray", ray_cluster], "on Ray: 1 node(s)")
    assert done.returncode == 130, done.stderr
    assert done.stdout.strip() == ""


def test_a_check_whose_unit_died_twice_is_an_error_row_never_a_pass(monkeypatch):
    from kvref import ray_verify
    from kvref.baseline import Baseline
    from kvref.check_context import VerifyContext
    from kvref.checks import check_named
    from kvref.ray_runner import RunOutcome, UnitOutcome
    from kvref.report import ERROR, PASSED, CheckResult

    def fake(units, on_done=None, max_retries=1):
        outs = [UnitOutcome("spec", value=CheckResult("spec", PASSED, "ok", examined=1)),
                UnitOutcome("proofs", error="WorkerCrashedError on Ray after 2 attempt(s): died", seconds=3.0)]
        for o in outs:
            on_done(o)
        return RunOutcome(outs)

    monkeypatch.setattr(ray_verify, "run_units", fake)
    rows, interrupted = ray_verify.run_verify([check_named("spec"), check_named("proofs")], VerifyContext(),
                                              Baseline(), False, False, lambda s: None)
    assert interrupted is None and [(r.name, r.status) for r in rows] == [("spec", PASSED), ("proofs", ERROR)]
    assert rows[1].failing and rows[1].summary.startswith("WorkerCrashedError on Ray after 2 attempt(s)")


def _replaying(order: list[int], values: list):
    """A stand-in for run_units that finishes the units in ``order`` and honours on_done's stop."""
    from kvref.ray_runner import RunOutcome, UnitOutcome

    def fake(units, on_done=None, max_retries=1):
        outs = [None] * len(units)
        for i in order:
            outs[i] = UnitOutcome(units[i].key, value=values[i])
            if on_done(outs[i]):
                break
        return RunOutcome([o or UnitOutcome(u.key, error="not run: an earlier unit failed (--exitfirst)",
                                            cancelled=True) for o, u in zip(outs, units)])
    return fake


def test_exitfirst_reports_up_to_the_first_failing_check_in_order(monkeypatch):
    """Units finish in any order; the report is the local one: checks in order, cut after the first
    failing one, even when a later check finished (or failed) first."""
    from kvref import ray_verify
    from kvref.baseline import Baseline
    from kvref.check_context import VerifyContext
    from kvref.checks import check_named
    from kvref.report import FAILED, PASSED, CheckResult

    checks = [check_named(n) for n in ("spec", "proofs", "machine-reference", "explorer")]
    values = [CheckResult("spec", PASSED, "ok", examined=1), CheckResult("proofs", FAILED, "bad"),
              CheckResult("machine-reference", FAILED, "bad too"), CheckResult("explorer", PASSED, "ok", examined=1)]
    monkeypatch.setattr(ray_verify, "run_units", _replaying([2, 3, 1, 0], values))
    results, interrupted = ray_verify.run_verify(checks, VerifyContext(), Baseline(), False, True, lambda s: None)
    assert interrupted is None and [(r.name, r.status) for r in results] == [("spec", PASSED), ("proofs", FAILED)]
    monkeypatch.setattr(ray_verify, "run_units", _replaying([3, 2, 1, 0], values))
    results, _ = ray_verify.run_verify(checks, VerifyContext(), Baseline(), False, False, lambda s: None)
    assert [r.name for r in results] == ["spec", "proofs", "machine-reference", "explorer"]  # the checks' order


# --------------------------------------------------------------------------------------------
# bad input: exit 2, one line


def test_without_ray_the_flag_is_a_one_line_exit_2_error(monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    assert cli.main(["verify", "--only", "spec", "--ray"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'kvref[ray]'" in err[0] and "--ray" in err[0]


def test_a_worker_with_another_vllm_is_an_exit_2_error_naming_it():
    here = {"python": "3.11.7", "kvref": "0.1.0", "vllm": "0.33.0", "ray": "2.60.0", "host": "driver"}
    check_versions(here, [dict(here, host="w1", python="3.11.9")], "auto")  # same major.minor: fine
    with pytest.raises(InvalidFieldError, match=r"vllm 0.33.0 \(node w2 has 0.34.0\)"):
        check_versions(here, [dict(here, host="w1"), dict(here, host="w2", vllm="0.34.0")], "auto")
    with pytest.raises(InvalidFieldError, match="kvref"):
        check_versions(here, [dict(here, kvref="0.0.9")], "auto")


def test_an_unreachable_or_malformed_address_is_an_exit_2_error_at_once(capsys):
    assert cli.main(["verify", "--only", "spec", "--ray", "127.0.0.1:1"]) == 2  # nothing listens on port 1
    assert "a reachable Ray cluster" in capsys.readouterr().err
    assert cli.main(["verify", "--only", "spec", "--ray", "no-port"]) == 2
    assert "HOST:PORT" in capsys.readouterr().err


def test_ray_and_reach_do_not_mix(capsys):
    assert cli.main(["verify", "--only", "spec", "--reach", "--ray"]) == 2
    assert "--reach" in capsys.readouterr().err


def test_auto_joins_the_running_cluster_or_starts_its_own_on_127_0_0_1(ray_cluster):
    """``--ray`` (auto): the cluster RAY_ADDRESS names; one whose address refuses connections is
    passed over for a local cluster the run starts and ends; a malformed KVREF_RAY_RUNTIME_ENV is
    an exit-2 error naming it."""
    argv = ("verify", "--only", "spec", "--json", "--ray")
    joined = run_kvref(*argv, env={"RAY_ADDRESS": ray_cluster})
    assert joined.returncode == 0, joined.stderr
    assert report(joined)["ray"]["cluster"] == f"the running Ray cluster at {ray_cluster} (auto)"
    own = run_kvref(*argv, env={"RAY_ADDRESS": "127.0.0.1:1"})
    assert own.returncode == 0, own.stderr
    info = report(own)["ray"]
    assert info["cluster"] == "a local Ray cluster on 127.0.0.1 (auto)" and info["owned"] is True
    bad = run_kvref(*argv, env={"RAY_ADDRESS": "127.0.0.1:1", "KVREF_RAY_RUNTIME_ENV": "{pip: vllm"})
    assert bad.returncode == 2 and "KVREF_RAY_RUNTIME_ENV" in bad.stderr and "a JSON object" in bad.stderr
