"""Triton's interpreter for the kernel tests (``test_triton_*.py``).

Triton has no CPU back-end; with ``TRITON_INTERPRET=1`` its kernels run on CPU tensors in its
interpreter. Triton reads the variable when a kernel is decorated, i.e. when
``kvref.impl.torch.triton_kernels.*`` is first imported, which happens only in these tests, after
this file is loaded. A caller's explicit setting wins (``TRITON_INTERPRET=0`` on a GPU machine
makes the kernel tests that can run on CUDA compile instead). The GPU-only test in
``test_triton_kernels.py`` runs the compiled kernels in a subprocess either way.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
