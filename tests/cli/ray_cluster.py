"""The one place the ``--ray`` tests (tests/cli/test_ray*.py) start their Ray cluster and run kvref.

* :func:`ray_cluster` (a fixture each test module imports): a local cluster for the module, 2 CPUs,
  no dashboard, on 127.0.0.1 only (a start costs 4-8 s on the 2 shared cores).
* :func:`run_kvref` / :func:`local_and_ray` / :func:`interrupt_when`: ``kvref ARGV`` in a fresh process, as
  a user runs it (a seed's Hypothesis inputs depend on the modules a process has loaded,
  kvref.ray_inputs, and this test process has loaded others).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before Ray's import: every address 127.0.0.1
ray = pytest.importorskip("ray", reason="Ray not installed: pip install 'kvref[ray]' (requirements/test.txt pins it)")

#: the environment the Makefile gives vLLM; the cluster's workers inherit it
VLLM_QUIET = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_LOGGING_LEVEL": "WARNING", "HF_HUB_OFFLINE": "1",
              "TRANSFORMERS_OFFLINE": "1"}

def start_cluster() -> str:
    """A local cluster for this process; its address (127.0.0.1:port)."""
    from kvref.ray_runner import loopback_only

    for k, v in VLLM_QUIET.items():
        os.environ.setdefault(k, v)
    loopback_only(ray)
    if ray.is_initialized():  # a cluster an in-process run of another module left behind
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             logging_level="warning")
    address = ray.get_runtime_context().gcs_address
    assert address.startswith("127.0.0.1:") and {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
    return address


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    """The module's cluster address, for ``--ray ADDRESS`` in a subprocess (autouse: the tests that
    call kvref.ray_runner in-process need Ray initialised). A fresh cluster per module: the workers
    one module kills and cancels on purpose do not reach the next (a cancel test of
    test_ray_explore.py timed out once on a cluster test_ray.py had used)."""
    yield start_cluster()
    ray.shutdown()


KVREF = [sys.executable, "-c", "import sys; from kvref.cli import main; sys.exit(main(sys.argv[1:]))"]


def run_kvref(*argv: str, timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``kvref ARGV`` in a fresh process (``env``: added to this one's environment)."""
    return subprocess.run([*KVREF, *argv], capture_output=True, text=True, timeout=timeout,
                          env=None if env is None else {**os.environ, **env})


def report(proc: subprocess.CompletedProcess) -> dict:
    """A ``--json`` run's report (stdout, or its last line where progress came first), or a failure
    that shows what came out."""
    for text in (proc.stdout, proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""):
        try:
            return json.loads(text)
        except ValueError:
            continue
    pytest.fail(f"no JSON report (exit {proc.returncode}); stdout: {proc.stdout[-2000:]!r}; "
                f"stderr: {proc.stderr[-2000:]!r}")


def local_and_ray(argv: list[str], address: str, returncode: int = 0) -> tuple[dict, dict, str]:
    """``kvref ARGV --json`` locally, then with ``--ray ADDRESS``: both must exit ``returncode``;
    their reports, and the Ray run's stderr."""
    local = run_kvref(*argv)
    assert local.returncode == returncode, local.stderr[-3000:]
    remote = run_kvref(*argv, "--ray", address)
    assert remote.returncode == returncode, remote.stderr[-3000:]
    return report(local), report(remote), remote.stderr


def _sigint_as_from_a_shell() -> None:
    """In the child before exec: SIGINT delivered and at its default, as a shell starts a command.
    (In a full run of these modules the children once ignored SIGINT: ignored or blocked in the
    pytest process by then, both inherited through exec; kvref then rightly leaves SIGINT alone.)"""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupt_when(argv: list[str], line: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``kvref ARGV`` sent SIGINT (Ctrl-C) once its stderr shows ``line``: what it wrote, and its
    exit status."""
    proc = subprocess.Popen([*KVREF, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_sigint_as_from_a_shell)
    try:
        seen = []
        for got in proc.stderr:
            seen.append(got)
            if line in got:
                break
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(argv, proc.returncode, out, "".join(seen) + err)
