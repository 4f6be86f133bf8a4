"""Triton's interpreter for the kernel tests (``test_triton_*.py``) where no GPU is present.

Triton has no CPU back-end; with ``TRITON_INTERPRET=1`` its kernels run on CPU tensors in its
interpreter. Triton reads the variable when a kernel is decorated, i.e. when
``kvref.impl.torch.triton_kernels.*`` is first imported, which happens only in these tests, after
this file is loaded.

Where a CUDA device is present the variable is left unset, so the kernels compile and every
kernel test runs on CUDA tensors (``triton_support.kernel_device()``); issue #24: forcing the
interpreter on a GPU machine ran the whole kernel suite on CPU tensors, and never the cubins. A
caller's explicit setting wins either way (``TRITON_INTERPRET=1`` on a GPU machine: the
interpreter on CPU tensors; ``TRITON_INTERPRET=0`` without a GPU: the kernel tests skip with the
reason).
"""

from __future__ import annotations

import os


def interpreter_wanted(environ, cuda_available) -> bool:
    """Whether to set ``TRITON_INTERPRET=1``: only when unset and no CUDA device is present."""
    return "TRITON_INTERPRET" not in environ and not cuda_available()


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


if interpreter_wanted(os.environ, _cuda_available):
    os.environ["TRITON_INTERPRET"] = "1"
