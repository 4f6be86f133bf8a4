"""The torch data path's hot operations as Triton kernels (optional: needs ``triton``).

Three kernels, one module each:

* :mod:`.attention` — paged attention over block tables for any mix of prefill chunks and decode
  tokens (causal, sliding-window and chunked-local masks, GQA), an online-softmax loop over only
  the blocks the mask can reach;
* :mod:`.write_kv` — the K/V write of a step's new tokens through the slot mapping;
* :mod:`.block_copy` — whole-page block copies, as the offload jobs issue them (device <-> pinned
  host buffers on CUDA: pinned memory is addressable from kernels, triton-lang/triton#1197).

They compute what :mod:`kvref.impl.torch.paged_attention`, ``KVCacheTensors.write_kv`` and
``OffloadCopier`` compute, and the tests hold them to it. On a CUDA device they compile and run
as GPU kernels. Triton has no CPU back-end, so on CPU tensors they run in Triton's *interpreter*
(``TRITON_INTERPRET=1``, read when ``triton`` decorates the kernels, i.e. before this package is
first imported): slow, but the same kernel source, which is what lets CI without a GPU check them.

Import nothing from here unless :func:`triton_status` says it is usable; the back-end selector
(``attention_backend="triton"``) goes through :func:`require_triton`, which raises a
:class:`TritonUnavailableError` (a ``ValueError``) that says why.
"""

from __future__ import annotations

from .availability import (
    BACKENDS,
    TritonUnavailableError,
    _interpret_requested,
    check_backend,
    interpreted,
    require_triton,
    triton_status,
)

__all__ = ["BACKENDS", "TritonUnavailableError", "_interpret_requested", "check_backend", "interpreted",
           "require_triton", "triton_status"]
