"""A check that ends because the vLLM under test raised is a finding, not a kvref error (#22/#28).

``kvref verify`` reports a check that crashes as *error*: kvref could not finish it. But when the
exception comes out of vLLM's own code while a vLLM-facing check drives it (vLLM's
``ValueError: Cannot get 2 free blocks from the pool`` after a generated source fault made its
admission estimate too small: session 21's generated-fault campaign), the check did its job: the
installed vLLM crashed on inputs kvref's reference serves. Reporting that as *error* hid a
detection (the vLLM campaign counts only *failed* as a kill) and read like a tooling problem.

:func:`vllm_frame` finds where in vLLM the exception was raised (the innermost traceback frame in
the ``vllm`` package); :func:`crash_result` turns it into a *failed* row naming that frame, the
exception and the traceback's vLLM frames, with a signature a baseline can accept. A crash whose
innermost frame is kvref's (or any other library's) stays an *error*.
"""

from __future__ import annotations

import os
import sys
import traceback

from .report import FAILED, CheckResult


def _vllm_dirs() -> tuple[str, ...]:
    """The imported ``vllm`` package's directories, as given and with links resolved: the vLLM
    source campaign imports vLLM from an overlay whose unchanged files are links to the
    installation, so a frame's file may be named either way."""
    module = sys.modules.get("vllm")
    paths = getattr(module, "__path__", None) if module is not None else None
    return tuple(dict.fromkeys(d + os.sep for p in (paths or ()) for d in (os.path.abspath(p), os.path.realpath(p))))


def _relative(filename: str, dirs: tuple[str, ...]) -> str | None:
    for path in (os.path.abspath(filename), os.path.realpath(filename)):
        for d in dirs:
            if path.startswith(d):
                return path[len(d):]
    return None


def vllm_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of ``exc``'s traceback when it lies in the imported ``vllm`` package
    (relative path in ``filename``), else None."""
    dirs = _vllm_dirs()
    if not dirs or exc.__traceback__ is None:
        return None
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return None
    last = frames[-1]
    rel = _relative(last.filename, dirs)
    return None if rel is None else traceback.FrameSummary("vllm/" + rel, last.lineno, last.name, line=last.line)


def crash_result(check_name: str, exc: BaseException) -> CheckResult | None:
    """A *failed* row for a vLLM-facing check whose run ended in an exception raised inside vLLM,
    or None when the exception was not raised in vLLM's code."""
    frame = vllm_frame(exc)
    if frame is None:
        return None
    where = f"{frame.filename}:{frame.lineno} in {frame.name}"
    dirs = _vllm_dirs()
    inside = [f for f in traceback.extract_tb(exc.__traceback__) if _relative(f.filename, dirs) is not None]
    details = [f"vLLM raised {type(exc).__name__}: {exc}", f"  at {where}"] + \
              [f"  vLLM frame: {os.path.basename(f.filename)}:{f.lineno} {f.name}: {(f.line or '').strip()}"
               for f in inside[-6:]]
    return CheckResult(check_name, FAILED,
                       f"the vLLM under test crashed: {type(exc).__name__} at {where}: {str(exc)[:200]}",
                       details=details, signature=f"vllm raised {type(exc).__name__} in {frame.name}")
