"""Shared by the Triton kernel tests: skip with the reason when the kernels cannot run, and the
device they run on (CPU tensors in Triton's interpreter; CUDA when a GPU run turned it off)."""

from __future__ import annotations

import pytest

from kvref.impl.torch.triton_kernels import triton_status

USABLE, WHY = triton_status()
#: module-level mark for the kernel tests
needs_triton = pytest.mark.skipif(not USABLE, reason=f"Triton kernels cannot run here: {WHY}")


def kernel_device() -> str:
    from kvref.impl.torch.triton_kernels import interpreted

    return "cpu" if interpreted() else "cuda"
