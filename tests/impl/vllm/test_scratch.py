"""Scratch directories of the vLLM-facing adapters die with their process (a machine's /tmp held
797 tiny-model and 69 G3 directories that no run removed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kvref.impl.vllm import scratch


def test_every_tiny_model_dir_is_fresh_under_the_process_root() -> None:
    a = scratch.tiny_llama_dir(2, 1 << 16)
    assert scratch.tiny_llama_dir(2, 1 << 16) != a  # never shared: vLLM caches per model path
    b = scratch.tiny_llama_dir(4, 4096)
    assert b != a
    assert os.path.dirname(a) == os.path.dirname(b) == scratch.scratch_root()
    with open(os.path.join(b, "config.json")) as f:
        cfg = json.load(f)
    assert (cfg["num_hidden_layers"], cfg["max_position_embeddings"]) == (4, 4096)
    assert cfg["architectures"] == ["LlamaForCausalLM"]


def test_the_root_is_removed_at_exit_but_not_by_a_forked_child() -> None:
    code = (
        "import os, sys\n"
        "from kvref.impl.vllm import scratch\n"
        "d = scratch.tiny_llama_dir(2, 64); g = scratch.scratch_dir('g3-')\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    scratch.scratch_dir('child-')\n"  # the child's own root, removed by the child
        "    sys.exit(0)\n"  # runs the inherited atexit handler: must leave the parent's root
        "os.waitpid(pid, 0)\n"
        "assert os.path.isfile(os.path.join(d, 'config.json')), 'a forked child removed its parent root'\n"
        "print(scratch.scratch_root())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    root = out.stdout.strip()
    assert root and os.path.basename(root).startswith("kvref-scratch-")
    assert not os.path.exists(root)
