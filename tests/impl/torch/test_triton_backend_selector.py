"""The back-end selector: names checked, the default unchanged, a clear error without triton.

Runs without triton installed (nothing here imports it unless it is present): a user without
triton keeps the torch path, and selecting ``"triton"`` says why it cannot run.
"""

from __future__ import annotations

import sys

import pytest
import torch

from kvref.impl.interface import PoolConfig
from kvref.impl.torch.kv_cache_tensors import KVCacheTensors
from kvref.impl.torch.manager import TorchKVCacheManager
from kvref.impl.torch.model_runner import DataPathRunner
from kvref.impl.torch.offload_copy import OffloadCopier
from kvref.impl.torch.triton_kernels import TritonUnavailableError, require_triton, triton_status
from kvref.spec.errors import InvalidFieldError
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

GROUPS = (KVCacheGroupSpec(("f",), FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=4, dtype="float32")),)
CFG = PoolConfig(num_blocks=8, groups=GROUPS, max_model_len=16, scheduler_block_size=4, hash_block_size=4)


@pytest.mark.parametrize("make", [
    lambda b: DataPathRunner(TorchKVCacheManager(CFG, device="cpu"), attention_backend=b),
    lambda b: OffloadCopier(KVCacheTensors(GROUPS, 4), 2, backend=b),
    lambda b: __import__("kvref.models.machines.torch_differential", fromlist=["x"]).make_differential_machine(
        lambda cfg: None, datapath=True, attention_backend=b),
], ids=["runner", "copier", "differential"])
def test_unknown_backend_names_are_rejected_with_the_choices(make):
    with pytest.raises(InvalidFieldError, match="'torch', 'triton'") as exc:
        make("cuda")
    assert exc.value.value == "cuda"


def test_the_default_backend_is_torch():
    assert DataPathRunner(TorchKVCacheManager(CFG, device="cpu")).attention_backend == "torch"
    assert OffloadCopier(KVCacheTensors(GROUPS, 4), 2).backend == "torch"


def test_without_triton_the_triton_backend_says_why_and_the_torch_path_works(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    ok, why = triton_status()
    assert not ok and "triton is not installed" in why and "triton==3.9.0" in why
    with pytest.raises(TritonUnavailableError, match="not installed") as exc:
        DataPathRunner(TorchKVCacheManager(CFG, device="cpu"), attention_backend="triton")
    assert isinstance(exc.value, ValueError)
    with pytest.raises(TritonUnavailableError):
        OffloadCopier(KVCacheTensors(GROUPS, 4), 2, backend="triton")
    runner = DataPathRunner(TorchKVCacheManager(CFG, device="cpu"))
    assert runner.attention_backend == "torch"


def test_cpu_tensors_with_compiled_kernels_are_refused_with_the_fix(monkeypatch):
    pytest.importorskip("triton", reason="triton is not installed")
    import kvref.impl.torch.triton_kernels.availability as tk

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(tk, "interpreted", lambda: False)  # as if decorated without the interpreter
    with pytest.raises(TritonUnavailableError, match="TRITON_INTERPRET=1"):
        require_triton(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if not torch.cuda.is_available():
        ok, why = triton_status()
        assert not ok and "no CUDA device" in why
