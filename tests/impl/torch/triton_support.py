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


def _compiled() -> bool:
    return USABLE and kernel_device() == "cuda"


#: for tests that run on CPU tensors only (the data-path scenarios, the interpreter benchmarks):
#: skipped where a GPU run turned the interpreter off (``TRITON_INTERPRET=0``)
needs_interpreter = pytest.mark.skipif(_compiled(), reason="kernels are compiled for CUDA here "
                                       "(TRITON_INTERPRET=0); this test runs them on CPU tensors")
