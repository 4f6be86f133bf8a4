"""The GPU benchmark scripts: one command each, a clear refusal without CUDA, and their CPU
(interpreter) mode produces the table on a tiny shape with a checked result."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install triton==3.9.0, requirements/test.txt)")

import torch  # noqa: E402

from tests.impl.torch.triton_support import needs_interpreter, needs_triton  # noqa: E402

pytestmark = needs_triton
BENCH = Path(__file__).resolve().parents[3] / "benchmarks"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: the benchmark would run")
@pytest.mark.parametrize("name,args", [("bench_triton_attention", []), ("bench_triton_attention", ["--check-only"]),
                                       ("bench_triton_offload", [])])
def test_gpu_benchmarks_refuse_without_cuda_with_exit_2(name, args, capsys):
    assert _load(name).main(args) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "--interpreter" in err


@needs_interpreter
def test_attention_benchmark_interpreter_mode_reports_a_checked_table(capsys):
    rc = _load("bench_triton_attention").main(["--interpreter", "--batch", "2", "--context", "40", "--kv-heads", "1",
                                               "--head-size", "16", "--block-size", "4", "--window", "24",
                                               "--repeats", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    err = float(re.search(r"max\|triton - torch path\|=(\S+)", out).group(1))
    assert err <= 1e-5  # float32
    assert "| triton kernel (interpreted) |" in out and "| torch path (gather + matmul) |" in out
    # issue #24: the peer (SDPA on dense K/V) timed in the same run, every output vs float64
    rows = re.findall(r"^\| (triton kernel \(interpreted\)|torch path \(gather \+ matmul\)|PyTorch SDPA, dense "
                      r"contiguous K/V) \|.*\| (\S+) \| (\S+) \|$", out, re.M)
    assert [r[0][:5] for r in rows] == ["trito", "torch", "PyTor"], out
    assert float(rows[2][1]) == 1.0 and all(float(r[2]) <= 1e-5 for r in rows), rows


@needs_interpreter
def test_attention_benchmark_fails_when_an_output_is_off_the_float64_reference(capsys, monkeypatch):
    import kvref.impl.torch.triton_kernels.attention as attn

    real = attn.paged_attention_triton
    monkeypatch.setattr(attn, "paged_attention_triton", lambda *a, **k: real(*a, **k) * 1.01)
    rc = _load("bench_triton_attention").main(["--interpreter", "--batch", "1", "--context", "20", "--kv-heads", "1",
                                               "--head-size", "16", "--block-size", "4", "--repeats", "1"])
    out = capsys.readouterr().out
    assert rc == 1 and "FAIL: relative error vs float64" in out and "triton" in out.split("FAIL")[1], out


@needs_interpreter
def test_offload_benchmark_interpreter_mode_verifies_round_trips(capsys):
    rc = _load("bench_triton_offload").main(["--interpreter", "--blocks", "3", "--layers", "1", "--page-kib", "4",
                                             "--repeats", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "bit-exact round trips verified" in out
    assert len(re.findall(r"^\| (triton \(interpreted\)|torch) \| (contiguous|scattered) \|", out, re.M)) == 4
    # the same jobs as (n, 2) id arrays, with the host time of a store
    assert len(re.findall(r"^\| (triton \(interpreted\)|torch) \| (contiguous|scattered), id array \|( [^|]+ \|){4} \d+ \|$",
                          out, re.M)) == 4, out


@pytest.mark.parametrize("name,args", [("bench_triton_attention", ["--batch", "0"]),
                                       ("bench_triton_attention", ["--window", "-1"]),
                                       ("bench_triton_attention", ["--sweep", "-1"]),
                                       ("bench_triton_offload", ["--blocks", "-3"])])
def test_benchmarks_reject_bad_arguments_with_exit_2(name, args):
    with pytest.raises(SystemExit) as exc:
        _load(name).main(args)
    assert exc.value.code == 2


@needs_interpreter
def test_the_tuning_sweeps_time_checked_tunings_within_their_budget(capsys, monkeypatch):
    """``--sweep`` (decode) times tunings fastest first, each output checked against float64, and
    stops at its budget; a tuning whose output is off fails the run. The offload sweep prints one
    row per tuning, checked bit-exact through the round trips before it."""
    bench = _load("bench_triton_attention")
    monkeypatch.setattr(bench, "SWEEP", [(16, 4, 2, 1), (32, 4, 2, 1), (32, 4, 2, 2)])
    argv = ["--interpreter", "--batch", "1", "--context", "20", "--kv-heads", "1", "--head-size", "16",
            "--block-size", "4", "--repeats", "1", "--sweep", "600"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (\d+) \| (\d+) \| (\d+) \| (\d+) \| ([\d.]+) ms \|", out, re.M)
    assert len(rows) == 3 and "sweep best: tile" in out, out
    times = [float(r[4]) for r in rows]
    assert times == sorted(times)
    import kvref.impl.torch.triton_kernels.attention as attn

    real = attn.paged_attention_triton
    monkeypatch.setattr(attn, "paged_attention_triton",
                        lambda *a, **k: real(*a, **k) * (1.05 if k.get("tile") == 32 else 1.0))
    bench = _load("bench_triton_attention")
    monkeypatch.setattr(bench, "SWEEP", [(16, 4, 2, 1), (32, 4, 2, 1)])
    assert bench.main(argv) == 1
    assert "FAIL: 1 sweep tunings above the relative tolerance" in capsys.readouterr().out
    assert _load("bench_triton_offload").main(["--interpreter", "--blocks", "2", "--layers", "1", "--page-kib", "4",
                                               "--repeats", "1", "--sweep"]) == 0
    assert len(re.findall(r"^\| chunk \d+ words", capsys.readouterr().out, re.M)) == 3
