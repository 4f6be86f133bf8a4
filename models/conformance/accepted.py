"""Differences a vLLM developer accepted on purpose, as the machines see them while they search.

A developer who changed vLLM's behaviour deliberately records the findings in a baseline file
(:mod:`kvref.baseline`). A check that merely relabelled its first finding "accepted" would stop
searching there, so a *new* difference hiding behind it would go unseen. Instead, while a check
runs, its accepted signatures are registered here; a machine that meets one of them discards that
trace (Hypothesis ``reject``) and keeps generating, so only new differences fail the run.

Signatures are the stable part of a finding: the operation and what differed, with numbers
replaced by ``#`` (:func:`signature`) — never block ids or request ids, which change from trace to
trace.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Iterator

_accepted: frozenset[str] = frozenset()
#: record mode (``kvref verify --update-baseline``): every difference is accepted and recorded, so the
#: baseline lists all the differences one deliberate change produces on the generated traces
_collect = False
#: accepted differences met (and discarded) since the last :func:`accepting` began
met: dict[str, int] = {}

_NUM = re.compile(r"\d+")
_SPACE = re.compile(r"\s+")


def signature(text: str) -> str:
    """The stable form of a finding's headline: digits become ``#``, whitespace collapses."""
    first = text.strip().splitlines()[0] if text.strip() else ""
    return _SPACE.sub(" ", _NUM.sub("#", first)).strip()[:240]


@contextmanager
def accepting(signatures: frozenset[str] | set[str], collect: bool = False) -> Iterator[None]:
    """Register ``signatures`` as accepted for the duration of one check (``collect``: accept and
    record every difference, to write a baseline)."""
    global _accepted, _collect
    saved = _accepted, _collect
    _accepted, _collect = frozenset(signatures), collect
    met.clear()
    try:
        yield
    finally:
        _accepted, _collect = saved


def is_accepted(sig: str | None) -> bool:
    """Whether ``sig`` was accepted; counts it in :data:`met` when it was."""
    if sig is None or (sig not in _accepted and not _collect):
        return False
    met[sig] = met.get(sig, 0) + 1
    return True
