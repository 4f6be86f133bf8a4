"""``scripts/gpu-check.sh`` (issue #24): its argument handling, its plan, and its refusal without a
GPU, checked on CPU. What it does on a GPU is what it prints there (BENCHMARKS.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "gpu-check.sh"


def _run(*args, timeout=120):
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args,message", [
    (["--bogus"], "unknown option '--bogus'"),
    (["--budget", "x"], "--budget=x: expected a positive number"),
    (["--budget", "0"], "--budget=0: expected a positive number"),
    (["--budget"], "--budget needs seconds"),
    (["--wheel", "/nonexistent/kvref.whl"], "no such file"),
    (["--python", "/nonexistent/python"], "no python interpreter '/nonexistent/python'"),
    (["--only", "no such step"], "--only 'no such step' names no step"),
])
def test_bad_arguments_exit_2_naming_the_argument(args, message):
    out = _run(*args)
    assert out.returncode == 2 and message in out.stderr, (out.returncode, out.stderr)
    assert "| step |" not in out.stdout  # no table: nothing ran


def test_help_describes_the_exit_statuses():
    out = _run("--help")
    assert out.returncode == 0
    assert "Exit status: 0" in out.stdout and "2 no CUDA device" in out.stdout and "--no-index" in out.stdout


def test_the_plan_runs_every_kernel_and_gpu_test_the_check_and_the_benchmarks():
    out = _run("--plan", "--python", sys.executable)
    assert out.returncode == 0, out.stderr
    plan = out.stdout
    listed = {w for line in plan.splitlines() for w in line.split() if w.startswith("tests/") and "::" not in w}
    kernel_tests = {f"tests/impl/torch/{p.name}" for p in (ROOT / "tests/impl/torch").glob("test_triton_*.py")}
    gpu_tests = {f"tests/impl/torch/{p.name}" for p in (ROOT / "tests/impl/torch").glob("test_*.py")
                 if "pytest.mark.gpu" in p.read_text() and p.name != "test_gpu_check_script.py"}
    assert kernel_tests | gpu_tests <= listed, (kernel_tests | gpu_tests) - listed
    assert all((ROOT / p).is_file() for p in listed), listed
    for needed in ("bench_triton_attention.py --check-only", "--window 1024", "bench_triton_offload.py",
                   "bench_torch_offload.py --device cuda"):
        assert needed in plan, needed
    assert any(line.endswith("bench_triton_attention.py") for line in plan.splitlines())  # the default shape
    budgets = [int(line.split("[")[1].split(" s]")[0]) for line in plan.splitlines() if line.strip().startswith("[")]
    assert len(budgets) >= 8 and "budget 450 s" in plan  # the steps share a 450 s budget: < 8 min in all


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: the script would run")
def test_without_cuda_it_says_so_and_exits_2_before_building_anything(tmp_path):
    out = _run("--python", sys.executable, "--out", str(tmp_path / "out"))
    assert out.returncode == 2
    assert "no CUDA device here" in out.stderr and "interpreter" in out.stderr
    assert "| step |" not in out.stdout and not (tmp_path / "out").exists()


def test_past_the_cuda_check_it_installs_the_wheel_aside_and_reports_each_step(tmp_path):
    """The mechanics after the CUDA check, driven on CPU by an interpreter that *claims* a GPU in
    the prerequisites probe only: the wheel is built and installed into a scratch directory (the
    run imports kvref from there, not from the checkout), the selected step really runs — and
    fails, as a CUDA benchmark must on a CPU — and the table says so with exit 1."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/bash\n"
                    "if [ \"$1\" = \"-\" ]; then cat >/dev/null; printf 'cuda yes\\ndevice FakeGPU\\npython 3\\n"
                    "torch 2\\ntriton 3\\nnumpy 2\\npytest 8\\nhypothesis 6\\nsetuptools 80\\nwheel 0\\n'; exit 0; fi\n"
                    f"exec {sys.executable} \"$@\"\n")
    fake.chmod(0o755)
    out_dir = tmp_path / "out"
    out = _run("--python", str(fake), "--only", "offload, torch copier", "--out", str(out_dir), "--budget", "120",
               timeout=300)
    table = (out_dir / "table.md").read_text()
    assert out.returncode == 1, out.stdout + out.stderr
    assert "| wheel | ok |" in table and "kvref-0.1.0-py3-none-any.whl" in table, table
    assert "kvref import" not in table  # the run imported the wheel
    assert "| offload, torch copier | FAILED (exit 1) |" in table, table
    assert [line for line in table.splitlines() if line.startswith("| ") and "step" not in line][-1].startswith(
        "| offload, torch copier"), table
    assert "Torch not compiled with CUDA" in (out_dir / "step1.log").read_text()
