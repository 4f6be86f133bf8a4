"""``kvref size``: packaged examples, file input (JSON/TOML), flags, JSON output, errors."""

from __future__ import annotations

import argparse
import json

import pytest

from kvref.cli import size as cli_size
from kvref.cli.size import example_names, main, parse_bytes

EXAMPLES = ("deepseek_v3_like", "gemma3_27b_like", "llama3_8b", "nemotron_h_8b_like")


def _json(capsys, argv):
    rc = main([*argv, "--json"])
    out = capsys.readouterr().out
    return rc, json.loads(out)


def test_examples_are_packaged():
    assert sorted(n.rsplit(".", 1)[0] for n in example_names()) == sorted(EXAMPLES)


def test_list_examples(capsys):
    assert main(["--list-examples", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["examples"] == sorted(EXAMPLES)
    assert "qwen3-next-80b-a3b-instruct" in listed["hf_configs"] and "deepseek-v3" in listed["hf_configs"]
    assert main(["--list-examples"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name}\n" in out for name in [*EXAMPLES, *listed["hf_configs"]])


def test_gemma_example_groups_and_caps(capsys):
    rc, plan = _json(capsys, ["--example", "gemma3_27b_like"])
    assert rc == 0
    kinds = [g["kind"] for g in plan["groups"]]
    assert kinds == ["SlidingWindowSpec"] * 6 + ["FullAttentionSpec"]
    swa = plan["groups"][0]
    # window 1024 + 8192 in flight, block 16: cdiv(1023 + 8192, 16) + 1
    assert swa["admission_cap"] == swa["blocks_per_request"] == 577
    assert plan["groups"][-1]["blocks_per_request"] == 131072 // 16
    assert plan["num_usable_blocks"] == plan["num_blocks"] - 1
    assert plan["max_concurrency"] == plan["num_blocks"] / (6 * 577 + 8192)


def test_async_scheduling_doubles_in_flight_tokens(capsys):
    _, plan = _json(capsys, ["--example", "gemma3_27b_like", "--async-scheduling"])
    assert plan["max_in_flight_tokens"] == 2 * 8192
    assert plan["groups"][0]["admission_cap"] == -(-(1023 + 16384) // 16) + 1


def test_mla_example_auto_fits(capsys):
    rc, plan = _json(capsys, ["--example", "deepseek_v3_like", "--available-memory", "2GiB"])
    assert rc == 0 and plan["auto_fitted"] and plan["max_model_len"] < 163840
    assert plan["groups"][0]["page_size_bytes"] == 64 * 656 * 1


def test_mamba_example(capsys):
    rc, plan = _json(capsys, ["--example", "nemotron_h_8b_like"])
    assert rc == 0 and plan["scheduler_block_size"] == 528
    assert {g["kind"] for g in plan["groups"]} == {"MambaSpec", "FullAttentionSpec"}
    assert all(g["page_size_bytes"] == 2162688 for g in plan["groups"])


def test_table_output(capsys):
    assert main(["--example", "llama3_8b", "--max-model-len", "8192"]) == 0
    out = capsys.readouterr().out
    assert "1 KV cache group" in out and "usable blocks" in out and "max concurrency" in out


def test_too_small_pool_reports_the_servable_length(capsys):
    rc, res = _json(capsys, ["--example", "llama3_8b", "--num-gpu-blocks-override", "1000"])
    assert rc == 1 and res["reason"] == "too_long" and res["estimated_max_model_len"] == 999 * 16
    assert main(["--example", "llama3_8b", "--num-gpu-blocks-override", "1000"]) == 1
    out = capsys.readouterr().out
    assert "estimated maximum model length is 15984" in out and "largest servable max_model_len: 15984" in out


def test_toml_and_json_files_with_flags(tmp_path, capsys):
    layout = {"name": "tiny", "defaults": {"block_size": 16, "dtype": "float16", "num_kv_heads": 1, "head_size": 64},
              "pattern": [{"kind": "sliding_window", "count": 3, "sliding_window": 64}, {"kind": "full"}],
              "repeat": 2, "engine": {"derived_max_model_len": 4096, "max_model_len": 4096}}
    jpath = tmp_path / "tiny.json"
    jpath.write_text(json.dumps(layout))
    rc, plan = _json(capsys, [str(jpath), "--available-memory", "64MiB"])
    assert rc == 0 and len(plan["groups"]) == 4 and plan["memory_bytes"] == 64 << 20
    tpath = tmp_path / "tiny.toml"
    tpath.write_text('name = "tiny"\navailable_memory = 1000000\n[defaults]\nblock_size = 16\ndtype = "float16"\n'
                     'num_kv_heads = 1\nhead_size = 64\n[[pattern]]\nkind = "full"\ncount = 4\n'
                     '[engine]\nderived_max_model_len = 4096\n')
    rc, plan = _json(capsys, [str(tpath), "--max-model-len", "auto", "--block-size", "32"])
    assert rc == 0 and plan["auto_fitted"] and plan["groups"][0]["block_size"] == 32
    bpb = 4 * 32 * 1 * 128 * 2
    assert plan["bytes_per_block"] == bpb and plan["num_blocks"] == 1000000 // bpb
    assert plan["max_model_len"] == (1000000 // bpb - 1) * 32
    # vLLM's spelling of auto-fit, through the one flag table both input forms share
    rc, same = _json(capsys, [str(tpath), "--max-model-len", "-1", "--block-size", "32"])
    assert rc == 0 and same == plan


@pytest.mark.parametrize("argv, field", [
    (["--example", "llama3_8b", "--available-memory", "16XB"], "available_memory"),
    (["--example", "nope"], "--example"),
    (["--example", "llama3_8b", "--num-gpu-blocks-override", "0"], "num_gpu_blocks_override"),
    (["--example", "llama3_8b", "--block-size", "0"], "block_size"),
    (["--example", "llama3_8b", "--max-model-len", "lots"], "--max-model-len"),
    (["/nonexistent/layout.toml"], "config"),
])
def test_bad_input_is_one_clear_line(argv, field, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvref size: error: ") and field in err and err.count("\n") == 1


def test_unknown_layer_kind_and_field(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"pattern": [{"kind": "linear"}], "available_memory": 1}))
    assert main([str(path)]) == 2 and "pattern[0].kind" in capsys.readouterr().err
    path.write_text(json.dumps({"pattern": [{"kind": "full", "num_kv_heads": 1, "head_size": 8,
                                             "dtype": "float16", "block_size": 16, "windw": 3}],
                                "available_memory": 1}))
    assert main([str(path)]) == 2 and "windw" in capsys.readouterr().err


def test_parse_bytes_units():
    assert parse_bytes("16GiB") == 16 << 30 and parse_bytes("512 MiB") == 512 << 20
    assert parse_bytes("20GB") == 20 * 10**9 and parse_bytes("1.5e3") == 1500 and parse_bytes(7) == 7


def test_wires_into_a_parent_parser(capsys):
    """How kvref/cli/__init__.py wires it: add_parser(subparsers) + run(args)."""
    parser = argparse.ArgumentParser(prog="kvref")
    sub = parser.add_subparsers(dest="command")
    cli_size.add_parser(sub).set_defaults(_run=cli_size.run)
    args = parser.parse_args(["size", "--example", "llama3_8b", "--max-model-len", "1024", "--json"])
    assert args._run(args) == 0
    assert json.loads(capsys.readouterr().out)["max_model_len"] == 1024


def test_plot_flag_writes_a_png(tmp_path, capsys):
    out = tmp_path / "gemma.png"
    assert main(["--example", "gemma3_27b_like", "--max-model-len", "4096", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "plot written" in capsys.readouterr().err
