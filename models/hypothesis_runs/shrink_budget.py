"""Bounded shrinking, and Hypothesis' own messages kept off stdout.

On a vLLM with a real fault, one check once spent 280 s shrinking (Hypothesis stops by itself only
after five minutes), and Hypothesis printed its warning to stdout ahead of ``--json`` output, so the
report could not be parsed. Every generated-trace check of ``kvref verify`` runs inside
:func:`bounded_shrinking`: shrinking stops after ``seconds`` (the failing example found so far is
reported, already smaller than the first), and whatever Hypothesis reports goes to stderr.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator


class ShrinkLog:
    """What Hypothesis said while a check ran (its reports, and whether shrinking hit the bound)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.stopped_early = False

    def __call__(self, text: str) -> None:
        if "working to shrink" in text:
            self.stopped_early = True
            return  # the generic 'five minutes' text would be wrong here; the result says it instead
        self.lines.append(text)
        print(text, file=sys.stderr)


@contextmanager
def bounded_shrinking(seconds: float) -> Iterator[ShrinkLog]:
    """Shrink for at most ``seconds`` per failing example; Hypothesis' reports go to stderr."""
    from hypothesis.internal.conjecture import engine
    from hypothesis.reporting import with_reporter

    if not seconds > 0:
        from kvref.spec.errors import InvalidFieldError

        raise InvalidFieldError("shrink_seconds", seconds, "a positive number of seconds")
    log = ShrinkLog()
    saved = engine.MAX_SHRINKING_SECONDS
    engine.MAX_SHRINKING_SECONDS = seconds
    try:
        with with_reporter(log):
            yield log
    finally:
        engine.MAX_SHRINKING_SECONDS = saved
