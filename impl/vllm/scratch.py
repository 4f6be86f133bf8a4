"""Scratch directories that live as long as the process that made them.

vLLM's ``ModelConfig`` wants a model directory, so the vLLM-facing adapters write a tiny
``config.json`` (a 2- or 4-layer Llama: no weights are ever read) and point vLLM at it; KVCR's G3
tier wants a file path. Each of those used to be a fresh ``tempfile.mkdtemp`` that nothing removed:
one machine's ``/tmp`` held 797 ``kvref_tiny_llama_*`` and 69 ``kvref-g3-*`` directories after a few
test runs and ``kvref verify`` calls. Here every such directory sits under one per-process root,
removed at exit.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile

_root: tuple[int, str] | None = None  # (pid that made it, path)


def _remove(pid: int, path: str) -> None:
    if os.getpid() == pid:  # a forked child that runs atexit handlers must not remove its parent's files
        shutil.rmtree(path, ignore_errors=True)


def scratch_root() -> str:
    """This process's scratch root (made on first use, removed when the process exits)."""
    global _root
    if _root is None or _root[0] != os.getpid():  # a forked child makes (and removes) its own
        _root = (os.getpid(), tempfile.mkdtemp(prefix="kvref-scratch-"))
        atexit.register(_remove, *_root)
    return _root[1]


def scratch_dir(prefix: str) -> str:
    """A fresh, empty directory under :func:`scratch_root`."""
    return tempfile.mkdtemp(prefix=prefix, dir=scratch_root())


def tiny_llama_dir(num_hidden_layers: int, max_position_embeddings: int) -> str:
    """A fresh model directory holding only the ``config.json`` of a tiny Llama (64 hidden, 4 query
    and 2 KV heads, float16): what vLLM's ``ModelConfig`` reads; its KV cache specs come from
    kvref's own layers, never from this model.

    Fresh on every call, never shared: vLLM caches what it reads from a model path for the life of
    the process, and each ``VllmEnv`` re-targets (mutates) its config in place, so two envs on one
    path would see each other's settings (a shared path made a pristine mamba-checkpoint feature run
    fail its allocation check in a test process that had built other envs before)."""
    path = scratch_dir("tiny_llama_")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                   "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "num_hidden_layers": num_hidden_layers, "vocab_size": 1000,
                   "max_position_embeddings": max_position_embeddings, "torch_dtype": "float16"}, f)
    return path
