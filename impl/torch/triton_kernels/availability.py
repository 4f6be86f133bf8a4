"""Whether the Triton kernels can run here, and the back-end names: the part of
:mod:`kvref.impl.torch.triton_kernels` every kernel module needs before it launches, kept apart
from the package so the kernels import it and nothing here imports a kernel (#26: the package used
to import ``attention`` lazily while ``attention`` imported the package).
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


#: whether the kernels were decorated as interpreted functions, noted by :mod:`.attention` when
#: triton decorates them (empty until then)
_DECORATED_INTERPRETED: list[bool] = []


def note_decorated(kernel) -> None:
    """Record how triton decorated the kernels (called once by :mod:`.attention` at import): the
    kernel modules import this module, never the other way round (no import cycle, #26)."""
    _DECORATED_INTERPRETED[:] = [type(kernel).__name__ == "InterpretedFunction"]


def interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter: decided when triton decorated them, which
    reads ``TRITON_INTERPRET`` at that moment; before they are decorated, what decorating them now
    would decide."""
    if _DECORATED_INTERPRETED:
        return _DECORATED_INTERPRETED[0]
    return _interpret_requested()


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


__all__ = ["BACKENDS", "TritonUnavailableError", "check_backend", "interpreted", "note_decorated", "require_triton",
           "triton_status"]
