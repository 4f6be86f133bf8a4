"""``--ray`` (issue #27): the same verdicts as a local run, a dead worker retried once then an
error, Ctrl-C cancelling the remote work, a clear exit 2 without Ray or with mismatched workers.

One local Ray cluster for the module: 2 CPUs, no dashboard, on 127.0.0.1 only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before Ray's import: every address 127.0.0.1 (ray_runner.loopback_only)
ray = pytest.importorskip("ray", reason="Ray not installed: pip install 'kvref[ray]' (requirements/test.txt pins it)")

from kvref import cli  # noqa: E402
from kvref.ray_runner import Unit, check_versions, run_units  # noqa: E402
from kvref.spec.errors import InvalidFieldError  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def cluster():
    """The module's Ray cluster; yields its address (127.0.0.1:port) for ``--ray`` in a subprocess."""
    for k, v in {"VLLM_TARGET_DEVICE": "cpu", "VLLM_LOGGING_LEVEL": "WARNING", "HF_HUB_OFFLINE": "1",
                 "TRANSFORMERS_OFFLINE": "1"}.items():
        os.environ.setdefault(k, v)
    from kvref.ray_runner import loopback_only

    loopback_only(ray)
    if ray.is_initialized():  # a cluster another test's in-process run left behind
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             logging_level="warning")
    address = ray.get_runtime_context().gcs_address
    assert address.startswith("127.0.0.1:") and {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
    yield address
    ray.shutdown()


def _kvref(*argv: str) -> subprocess.CompletedProcess:
    """``kvref ARGV`` in a fresh process, as a user runs it (a seed's Hypothesis inputs depend on
    the modules a process has loaded: kvref.ray_inputs; this test process has loaded others)."""
    return subprocess.run([sys.executable, "-c", "import sys; from kvref.cli import main; sys.exit(main(sys.argv[1:]))",
                           *argv], capture_output=True, text=True, timeout=300)


def _rows(out: str) -> list[tuple]:
    """What a verify --json report found, without the timings."""
    return [(c["name"], c["status"], c["summary"], c.get("examined")) for c in json.loads(out)["checks"]]


def test_verify_on_ray_draws_the_local_traces_and_names_the_workers(cluster, tmp_path):
    """Two generated-trace checks with a seed: the same traces (op counts, preemptions...) on Ray."""
    argv = ["verify", "--only", "spec", "machine-reference", "machine-scheduler", "--json", "--seed", "3",
            "--out", str(tmp_path)]
    local = _kvref(*argv)
    assert local.returncode == 0, local.stderr
    remote = _kvref(*argv, "--ray", cluster)
    assert remote.returncode == 0, remote.stderr
    assert _rows(remote.stdout) == _rows(local.stdout)
    probe = json.loads(remote.stdout)["ray"]
    from kvref import __version__

    assert probe["driver"]["kvref"] == __version__ and probe["nodes"][0]["kvref"] == __version__
    assert probe["nodes"][0]["python"] == probe["driver"]["python"] and probe["cpus"] == 2


def _mutant_rows(out: str) -> list[tuple]:
    return [(r["mutant"], r["killed"], r["by"], r["reason"]) for r in json.loads(out)["mutants"]]


def test_mutants_on_ray_kill_what_the_local_campaign_kills(cluster):
    """Planted faults (a pool and a spec mutant) and a mutant the selection cannot kill: same rows."""
    argv = ["mutants", "--only", "pool.touch_no_ref", "spec.cdiv_floor", "sched.fcfs_victim_oldest",
            "--checks", "spec-formulas", "pool-machine", "--budget", "20", "--json"]
    local = _kvref(*argv)
    assert local.returncode == 0, local.stderr
    remote = _kvref(*argv, "--ray", cluster)
    assert remote.returncode == 0, remote.stderr
    assert _mutant_rows(remote.stdout) == _mutant_rows(local.stdout)
    assert [r[1] for r in _mutant_rows(local.stdout)] == ["yes", "yes", "NO"]  # the blind one survives
    assert "on Ray: 1 node(s), 2 CPU(s)" in remote.stderr  # the workers' versions, named


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
def test_a_vllm_source_fault_on_ray_is_caught_as_locally(cluster):
    """``--target vllm``: the clean vLLM and a planted source fault each a unit on a worker (its
    own overlay of the worker's vLLM): the baseline survives, the fault is killed by the check
    that kills it locally (BENCHMARKS.md: conform-kv-manager on this fault, seed 0)."""
    from tests.vllm_env import require_vllm

    require_vllm()
    r = _kvref("mutants", "--target", "vllm", "--faults", "pool.free_count_off_by_one", "--checks",
               "conform-kv-manager", "--json", "--ray", cluster)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [(f["id"], f["outcome"], f["killed_by"]) for f in rows["faults"]] == [
        ("pool.free_count_off_by_one", "killed", "conform-kv-manager")]
    assert "clean vLLM: survived" in r.stderr and "on Ray: 1 node(s)" in r.stderr


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


def test_ctrl_c_during_verify_on_ray_writes_the_partial_report_and_exits_130(cluster, tmp_path):
    """SIGINT once a quick check has reported, while a nightly-profile check (minutes) still runs
    on its worker: exit 130, the finished row kept, the running one an interrupted error."""
    import signal

    junit = tmp_path / "r.xml"
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from kvref.cli import main; sys.exit(main(sys.argv[1:]))",
                             "verify", "--only", "spec", "machine-scheduler", "--profile", "nightly", "--json",
                             "--junit-xml", str(junit), "--out", str(tmp_path), "--ray", cluster],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:
            if "spec: passed" in line:
                break
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    report = json.loads(out)
    assert report["interrupted"] is True and "ray" in report
    assert [(c["name"], c["status"]) for c in report["checks"]] == [("spec", "passed"), ("machine-scheduler", "error")]
    assert "cancelled on Ray" in report["checks"][1]["summary"]
    assert junit.exists()


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
