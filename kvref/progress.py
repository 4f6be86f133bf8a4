"""Progress lines for long runs (``kvref explore``, ``kvref mutants``), on stderr.

A run that prints nothing for a minute looks hung (``kvref explore --scope reset-swa`` was silent
for 93 s, ``kvref mutants`` for a minute). :class:`Progress` stays silent for the first
``start_after`` seconds (short runs print nothing extra), then reports at most every
``interval`` seconds: in a terminal it rewrites one line in place, elsewhere (CI logs, pipes) it
prints whole lines, unwrapped and without a source-location suffix. stdout is left to the results
(``--json`` stays parseable).
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO


class Progress:
    """``update(text)`` as often as convenient; the line appears only when it is due.

    Args:
        label: what runs (``"explore reset-swa"``).
        stream: where lines go (stderr).
        start_after: seconds of silence before the first line.
        interval: seconds between lines (a terminal gets one rewritten line at this rate too).
        enabled: False turns every call into a no-op (``--quiet``).
    """

    def __init__(self, label: str, stream: TextIO | None = None, *, start_after: float = 2.0,
                 interval: float | None = None, enabled: bool = True, clock=time.monotonic) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start_after = start_after
        self.interval = interval if interval is not None else (0.5 if self.tty else 10.0)
        self.enabled = enabled
        self.clock = clock
        self.t0 = clock()
        self._last: float | None = None
        self._width = 0
        self.lines = 0
        self.status = ""
        self._lock = threading.Lock()  # the heartbeat thread and the caller may both report

    @property
    def elapsed(self) -> float:
        return self.clock() - self.t0

    def due(self) -> bool:
        """Whether a line would be printed now (lets callers skip building the text)."""
        if not self.enabled:
            return False
        now = self.clock()
        if now - self.t0 < self.start_after:
            return False
        return self._last is None or now - self._last >= self.interval

    def update(self, text: str, force: bool = False) -> None:
        """Show ``label: text (elapsed)`` if due (or ``force``, once past ``start_after``)."""
        with self._lock:
            self._update(text, force)

    def _update(self, text: str, force: bool) -> None:
        if not self.enabled or not (self.due() or (force and self.elapsed >= self.start_after)):
            return
        self._last = self.clock()
        line = f"{self.label}: {text} ({format_seconds(self.elapsed)})"
        if self.tty:
            pad = max(0, self._width - len(line))
            self.stream.write("\r" + line + " " * pad)
            self._width = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self.lines += 1

    def heartbeat(self, status: str = "running"):
        """A context manager: while it is open, a daemon thread shows ``self.status`` whenever a line
        is due, so a phase with no natural checkpoint (a campaign's baseline run) is not silent
        either. Callers update ``self.status`` as they go."""
        from contextlib import contextmanager

        self.status = status

        @contextmanager
        def beating():
            stop = threading.Event()

            def beat() -> None:
                while not stop.wait(max(0.05, min(self.interval, 1.0))):
                    if self.due():
                        self.update(self.status)

            thread = threading.Thread(target=beat, name="kvref-progress", daemon=True)
            thread.start()
            try:
                yield self
            finally:
                stop.set()
                thread.join(timeout=2)
                self.close()

        return beating()

    def close(self) -> None:
        """End a rewritten terminal line so the results start on a fresh one."""
        if self.tty and self._width:
            self.stream.write("\n")
            self.stream.flush()
            self._width = 0


def format_seconds(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes} min {secs:02d} s"


def rate(count: float, seconds: float) -> str:
    """``"1,234/s"``; ``"-"`` before any time has passed."""
    return f"{count / seconds:,.0f}/s" if seconds > 0 else "-"
