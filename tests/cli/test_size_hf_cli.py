"""``kvref size --hf-config`` (a model's own config.json), the vLLM memory flags, and
``kvref size --against vllm`` (kvref's plan beside vLLM's startup planner)."""

from __future__ import annotations

import json
import shutil
from importlib import resources

import pytest

from kvref.cli import main

HF = resources.files("kvref") / "examples" / "hf_configs"


def run_json(capsys, argv):
    rc = main(["size", *argv, "--json"])
    captured = capsys.readouterr()
    return rc, (json.loads(captured.out) if captured.out.strip() else None), captured.err


def test_packaged_name_file_and_folder_give_the_same_plan(capsys, tmp_path):
    # Llama-3.1-8B: 32 layers x 16 tokens x 8 heads x 256 x 2 B = 2 MiB per block; 16 GiB -> 8,192 blocks
    rc, by_name, _ = run_json(capsys, ["--hf-config", "llama-3.1-8b", "--kv-cache-memory", "16GiB",
                                       "--max-model-len", "8192"])
    assert rc == 0
    assert (by_name["bytes_per_block"], by_name["num_blocks"]) == (2 << 20, 8192)
    assert by_name["layout"]["architecture"] == "LlamaForCausalLM" and by_name["layout"]["layers"] == {"full": 32}
    folder = tmp_path / "Meta-Llama-3.1-8B"
    folder.mkdir()
    shutil.copy(str(HF / "llama-3.1-8b.json"), folder / "config.json")
    for path in (folder, folder / "config.json"):
        rc, plan, _ = run_json(capsys, ["--hf-config", str(path), "--kv-cache-memory", "16GiB", "--max-model-len", "8192"])
        assert rc == 0 and plan["name"] == "Meta-Llama-3.1-8B"
        assert {k: v for k, v in plan.items() if k != "name"} == {k: v for k, v in by_name.items() if k != "name"}


def test_gpu_memory_utilization_minus_model_memory(capsys):
    # 0.5 x 80 GiB - 24 GiB = 16 GiB -> 8,192 blocks of 2 MiB
    rc, plan, _ = run_json(capsys, ["--hf-config", "llama-3.1-8b", "--gpu-memory", "80GiB",
                                    "--gpu-memory-utilization", "0.5", "--model-memory", "24GiB", "--max-model-len", "8192"])
    assert rc == 0 and plan["memory_bytes"] == 16 << 30 and plan["num_blocks"] == 8192
    assert not any("upper bound" in n for n in plan["notes"])
    rc, plan, _ = run_json(capsys, ["--hf-config", "llama-3.1-8b", "--gpu-memory", "20GiB", "--max-model-len", "8192"])
    assert rc == 0 and plan["memory_bytes"] == int(0.9 * (20 << 30))  # vLLM's default utilization 0.9
    assert any("upper bound" in n for n in plan["notes"])


def test_engine_flags_reach_the_plan(capsys):
    rc, plan, _ = run_json(capsys, ["--hf-config", "gemma-3-27b-it", "--kv-cache-memory", "20GiB",
                                    "--max-model-len", "32768", "--max-num-batched-tokens", "4096",
                                    "--async-scheduling", "--block-size", "32", "--kv-cache-dtype", "fp8"])
    assert rc == 0
    assert plan["max_in_flight_tokens"] == 8192 and plan["scheduler_block_size"] == 32
    sliding = [g for g in plan["groups"] if g["kind"] == "SlidingWindowSpec"]
    # 1024-token window + 8,192 in flight -> cdiv(1023 + 8192, 32) + 1 = 289 blocks
    assert sliding and {g["admission_cap"] for g in sliding} == {289}
    rc, plan, _ = run_json(capsys, ["--hf-config", "llama-3.1-8b", "--num-gpu-blocks-override", "1000",
                                    "--max-model-len", "8192"])
    assert rc == 0 and plan["num_blocks"] == 1000


def test_hybrid_notes_and_layout(capsys):
    assert main(["size", "--hf-config", "qwen3-next-80b-a3b-instruct", "--kv-cache-memory", "30GiB",
                 "--max-model-len", "32768"]) == 0
    out = capsys.readouterr().out
    assert "36 mamba, 12 full" in out and "raised from 16 to 544 tokens" in out


@pytest.mark.parametrize("argv, needle", [
    (["--hf-config", "no/such/config.json", "--kv-cache-memory", "1GiB"], "--hf-config"),
    (["--hf-config", "llama-3.1-8b"], "--kv-cache-memory"),
    (["--hf-config", "llama-3.1-8b", "--kv-cache-memory", "1GiB", "--gpu-memory", "80GiB"], "--gpu-memory"),
    (["--hf-config", "llama-3.1-8b", "--gpu-memory", "80GiB", "--gpu-memory-utilization", "1.5"],
     "--gpu-memory-utilization"),
    (["--hf-config", "llama-3.1-8b", "--gpu-memory-utilization", "0.9"], "--gpu-memory"),
    (["--hf-config", "qwen3-8b", "--kv-cache-memory", "1GiB", "--max-model-len", "40961"], "--max-model-len"),
    (["--hf-config", "qwen3-8b", "--gpu-memory", "80GiB", "--gpu-memory-utilization", "nan"], "--gpu-memory-utilization"),
    (["--hf-config", "qwen3-8b", "--kv-cache-memory", "inf"], "--kv-cache-memory"),
    (["--hf-config", "qwen3-8b", "--kv-cache-memory", "1GiB", "--kernel-block-size", "0"], "kernel_block_size"),
    (["--hf-config", "qwen3-8b", "--kv-cache-memory", "1GiB", "--tensor-parallel-size", "0"], "tensor_parallel_size"),
    (["--hf-config", "llama-3.1-8b", "--example", "llama3_8b", "--kv-cache-memory", "1GiB"], "--hf-config"),
    (["--example", "llama3_8b", "--tensor-parallel-size", "2"], "--tensor-parallel-size"),
    (["--hf-config", "qwen3-next-80b-a3b-instruct", "--tensor-parallel-size", "3", "--kv-cache-memory", "1GiB"],
     "tensor_parallel_size"),
])
def test_bad_input_exits_2_naming_the_flag(capsys, argv, needle):
    assert main(["size", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_unsupported_architecture_names_it_and_the_supported_ones(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FalconForCausalLM"], "num_hidden_layers": 2}))
    assert main(["size", "--hf-config", str(tmp_path), "--kv-cache-memory", "1GiB"]) == 2
    err = capsys.readouterr().err
    assert "FalconForCausalLM" in err and "JambaForCausalLM" in err and "LlamaForCausalLM" in err


@pytest.mark.parametrize("text", ["{not json", "[" * 100_000, "[1, 2]", "\udcff"])
def test_broken_json_exits_2(capsys, tmp_path, text):
    (tmp_path / "config.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    assert main(["size", "--hf-config", str(tmp_path / "config.json"), "--kv-cache-memory", "1GiB"]) == 2
    err = capsys.readouterr().err
    assert "--hf-config" in err and "Traceback" not in err


@pytest.mark.vllm
def test_against_vllm_agrees_and_prints_both(capsys):
    from tests.vllm_env import require_vllm

    require_vllm()
    rc, plan, _ = run_json(capsys, ["--hf-config", "gpt-oss-20b", "--kv-cache-memory", "8GiB", "--max-model-len",
                                    "32768", "--against", "vllm"])
    assert rc == 0
    against = plan["against_vllm"]
    assert against["differences"] == []
    assert against["fields"]["num_blocks"] == {"kvref": f"{plan['num_blocks']:,}", "vllm": f"{plan['num_blocks']:,}"}
    assert main(["size", "--hf-config", "gpt-oss-20b", "--kv-cache-memory", "8GiB", "--max-model-len", "32768",
                 "--against", "vllm"]) == 0
    out = capsys.readouterr().out
    assert "kvref vs vLLM's startup planner" in out and "DIFFERS" not in out


@pytest.mark.vllm
def test_against_vllm_difference_exits_1_naming_the_field(capsys, monkeypatch):
    from tests.vllm_env import require_vllm

    require_vllm()
    from kvref.impl.vllm import planning

    real = planning.VllmPlanner.plan

    def off_by_one(self, *args, **kwargs):
        outcome = real(self, *args, **kwargs)
        outcome.fields["num_blocks"] += 1
        return outcome

    monkeypatch.setattr(planning.VllmPlanner, "plan", off_by_one)
    assert main(["size", "--hf-config", "llama-3.1-8b", "--kv-cache-memory", "4GiB", "--max-model-len", "8192",
                 "--against", "vllm"]) == 1
    captured = capsys.readouterr()
    assert "DIFFERS" in captured.out and "differ on num_blocks" in captured.err


@pytest.mark.vllm
def test_against_a_vllm_whose_planner_moved_exits_2_naming_the_symbol(capsys, monkeypatch):
    """A user's vLLM renamed the startup planner: one line naming it, no traceback."""
    from tests.vllm_env import require_vllm

    require_vllm()
    from vllm.v1.core import kv_cache_planning

    monkeypatch.delattr(kv_cache_planning, "get_kv_cache_configs")
    assert main(["size", "--hf-config", "llama-3.1-8b", "--kv-cache-memory", "4GiB", "--max-model-len", "8192",
                 "--against", "vllm"]) == 2
    err = capsys.readouterr().err
    assert "get_kv_cache_configs" in err and "Traceback" not in err


def test_against_vllm_rejects_a_pipeline_depth_it_cannot_plan(capsys):
    assert main(["size", "--hf-config", "llama-3.1-8b", "--kv-cache-memory", "4GiB", "--max-concurrent-batches", "3",
                 "--against", "vllm"]) == 2
    assert "--max-concurrent-batches" in capsys.readouterr().err


def test_packaged_configs_are_package_data():
    """``pip install`` ships the configs (pyproject's package-data globs cover every one), so
    ``--hf-config NAME`` works outside the repository too."""
    import re
    import tomllib
    from pathlib import Path

    def matches(path: str, glob: str) -> bool:  # setuptools globs: "*" stays within one folder
        return re.fullmatch(re.escape(glob).replace(r"\*", "[^/]*"), path) is not None

    root = Path(__file__).resolve().parents[2]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["kvref"]
    files = sorted(p.relative_to(root / "kvref").as_posix() for p in (root / "kvref" / "examples" / "hf_configs").glob("*"))
    assert len(files) >= 13 and not matches(files[0], "examples/*.json")
    assert [f for f in files if not any(matches(f, g) for g in globs)] == []
