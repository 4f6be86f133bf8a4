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

import os

from kvref.spec.errors import KVRefError

#: the data-path back-ends a runner or copier can select
BACKENDS = ("torch", "triton")


class TritonUnavailableError(KVRefError):
    """The triton back-end was selected but cannot run here (the message says why)."""


def _interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


def triton_status() -> tuple[bool, str]:
    """``(usable, reason)``: whether the kernels can run in this process, and if not, why.

    Usable means triton imports and either kernels are interpreted (``TRITON_INTERPRET=1``) or a
    CUDA device is present to compile them for.
    """
    try:
        import triton  # noqa: F401
    except ImportError as exc:  # the torch back-end still works without it
        return False, f"triton is not installed ({exc}); `pip install triton==3.9.0` (requirements/test.txt)"
    import torch

    if _interpret_requested() or torch.cuda.is_available():
        return True, ""
    return False, ("no CUDA device and TRITON_INTERPRET is not set: Triton has no CPU back-end; set "
                   "TRITON_INTERPRET=1 before triton is imported to run the kernels in its interpreter")


def interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter (decided when they were decorated)."""
    from .attention import _paged_attention_kernel

    return type(_paged_attention_kernel).__name__ == "InterpretedFunction"


def require_triton(device=None) -> None:
    """Raise :class:`TritonUnavailableError` unless the kernels can run on ``device``.

    A CPU tensor can only be served by the interpreter; a compiled kernel would be handed a host
    pointer it cannot read, so that is refused here with the fix instead of failing in the launch.
    """
    ok, why = triton_status()
    if not ok:
        raise TritonUnavailableError(why)
    import torch

    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cpu" and not interpreted():
        raise TritonUnavailableError(
            "tensors are on the CPU but the Triton kernels were compiled for a GPU: set "
            "TRITON_INTERPRET=1 before triton is first imported to run them in the interpreter")
    if dev is not None and dev.type not in ("cpu", "cuda"):
        raise TritonUnavailableError(f"device {dev} is not supported by the Triton kernels (cpu or cuda)")


def check_backend(field: str, value) -> str:
    """Validate a back-end name (``"torch"`` or ``"triton"``)."""
    from kvref.spec.errors import InvalidFieldError

    if value not in BACKENDS:
        raise InvalidFieldError(field, value, "one of " + ", ".join(repr(b) for b in BACKENDS))
    return value


__all__ = ["BACKENDS", "TritonUnavailableError", "check_backend", "interpreted", "require_triton", "triton_status"]
