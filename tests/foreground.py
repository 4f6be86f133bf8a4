"""Start a ``kvref`` subprocess the way a shell starts a foreground job, for the tests that send it SIGINT.

A shell gives a foreground job SIGINT at its default disposition and unblocked. A child started
by ``subprocess.Popen`` instead inherits whatever the test process's state is, and a library used
by an earlier test in the same pytest process can leave SIGINT ignored or blocked there. Session
11's full suite showed this: all 9 SIGINT tests failed ("did not stop after SIGINT", exit 0 after
the signal), yet each passed when run alone, and no kvref code ignores or blocks SIGINT. The tests
check how kvref handles Ctrl-C, not what the test runner inherited, so each child starts with
SIGINT reset and unblocked (``preexec_fn``, run in the child before exec).
"""

from __future__ import annotations

import signal


def as_foreground_job() -> None:
    """``preexec_fn``: SIGINT at its default disposition and unblocked, as a shell starts a job."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
