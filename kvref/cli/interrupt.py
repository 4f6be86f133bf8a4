"""Ctrl-C that cannot be lost: a ``KeyboardInterrupt`` raised where Python drops it is raised again.

Python raises ``KeyboardInterrupt`` at whatever bytecode runs when SIGINT arrives. Inside a garbage
collector callback or a ``__del__`` it is printed as "Exception ignored in ..." and dropped, and the
run goes on as if nothing happened. Hypothesis registers a ``gc`` callback (it times collections),
so a Ctrl-C during ``kvref verify --only machine-reference`` was lost about one time in two: the
run went on for minutes. Here the handler remembers that an interrupt is pending and, until the
command acknowledges it (the ``except KeyboardInterrupt`` that stops the run calls
:func:`acknowledge`), raises it again every :data:`RETRY_SECONDS` on the main thread.
"""

from __future__ import annotations

import ctypes
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

#: how soon an interrupt that was dropped is raised again
RETRY_SECONDS = 0.5

_pending = threading.Event()
_stop = threading.Event()
#: held while the retry thread raises, and while the run stops the retries: once :func:`_halt`
#: returns, no retry is raised and none is left pending
_lock = threading.Lock()


def _raise_again() -> None:
    import _thread

    while not _stop.wait(RETRY_SECONDS):
        with _lock:  # never after _halt: a retry tripped then would reach whatever handler is back
            if _stop.is_set():
                return
            if _pending.is_set():
                _thread.interrupt_main(signal.SIGINT)


def _halt() -> None:
    """Stop the retries for good: no retry is tripped after this. (One tripped just before is run
    by the handler in place at the main thread's next bytecode: ``_stopping`` once acknowledged.)"""
    with _lock:
        _pending.clear()
        _stop.set()
        if threading.current_thread() is threading.main_thread():
            _forget_unhandled_flag()


def _forget_unhandled_flag() -> None:
    """CPython 3.11 sets a process-wide "unhandled KeyboardInterrupt" flag whenever code it runs
    through ``PyRun_*`` (a C extension's embedded Python, during an import) ends with the
    interrupt, even when a caller then handles it; at exit that flag makes the interpreter kill
    itself with SIGINT (status -2) instead of exiting with the status the command returned. kvref
    handled the interrupt (its report says so, exit 130), so the flag is cleared. A Python without
    the symbol (3.12+ keeps it in ``_PyRuntime``) is left alone: there the interrupt still ends the
    run, by SIGINT, which a shell reports as 130 too."""
    try:
        ctypes.c_int.in_dll(ctypes.pythonapi, "_Py_UnhandledKeyboardInterrupt").value = 0
    except (ValueError, AttributeError):
        pass


def _handler(signum, frame) -> None:
    if not _pending.is_set() and not _stop.is_set():
        _pending.set()
        threading.Thread(target=_raise_again, name="kvref-sigint", daemon=True).start()
    raise KeyboardInterrupt


def _stopping(signum, frame) -> None:
    """After the run has taken the interrupt: the partial report is being written; nothing to do."""


def acknowledge() -> None:
    """The run has stopped for the interrupt (its ``except KeyboardInterrupt`` ran): no more
    re-raising. Called on the main thread."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is _handler:
        signal.signal(signal.SIGINT, _stopping)
    _halt()


@contextmanager
def sigint_reraised() -> Iterator[None]:
    """Install the handler for one command (main thread only), and put the previous one back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.default_int_handler:  # someone else handles SIGINT (a test harness)
        yield
        return
    import sys

    hook = sys.unraisablehook

    def quiet_dropped_interrupt(unraisable) -> None:  # it is raised again: no "Exception ignored" traceback
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            hook(unraisable)

    _pending.clear()
    _stop.clear()
    signal.signal(signal.SIGINT, _handler)
    sys.unraisablehook = quiet_dropped_interrupt
    try:
        yield
    finally:
        _halt()
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = hook
