"""One fuzz call and what came of it, and the counts per class that docs/hardening.md reports.

``python -m tests.hardening.api_fuzz_counts`` runs the whole catalogue once (every target ×
argument × wrong value: :data:`~tests.hardening.api_targets.JUNK` and the near misses of its
valid value) and prints runs, escapes by exception type, rejected calls that changed state and
broken invariants, per class (constructors and functions, methods).
"""

from __future__ import annotations

import signal
from collections import Counter

from tests.hardening.api_targets import (
    JUNK,
    constructors,
    functions,
    method_cases,
    near_misses,
    snapshot,
)

#: seconds one call may take (a constructor accepting 10**30 blocks used to run until memory ran out)
CALL_SECONDS = 20


class Hang(BaseException):
    pass


def call_bounded(fn, **kwargs):
    def fire(signum, frame):
        raise Hang(f"no answer within {CALL_SECONDS} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(CALL_SECONDS)
    try:
        return fn(**kwargs)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def call_outcome(fn, kwargs) -> str:
    """``"ok"``, ``"rejected"`` (a ValueError with a message) or ``"escape:<type>"``."""
    try:
        call_bounded(fn, **kwargs)
    except ValueError as exc:
        return "rejected" if str(exc).strip() else "escape:ValueError without a message"
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        return f"escape:{type(exc).__name__}"
    return "ok"


def method_outcome(build, field, value) -> str:
    """As :func:`call_outcome`, plus ``"changed"`` (rejected after changing state) and
    ``"invariants"`` (check_invariants() failing after the call, rejected or not)."""
    obj, check_invariants, good, method = build()
    before = snapshot(obj)
    got = call_outcome(method, dict(good, **{field: value}))
    if got == "rejected" and snapshot(obj) != before:
        return "changed"
    if got in ("ok", "rejected"):
        try:
            check_invariants()
        except Exception:  # noqa: BLE001
            return "invariants"
    return got


def wrong_values(valid) -> list:
    return list(JUNK) + near_misses(valid)


CALLABLES = {**constructors(), **{f"fn:{k}": v for k, v in functions().items()}}
METHODS = dict(method_cases())


def counts() -> dict[str, Counter]:
    out = {"constructors and functions": Counter(), "methods": Counter()}
    for fn, good in CALLABLES.values():
        for field, valid in good.items():
            for value in wrong_values(valid):
                out["constructors and functions"][call_outcome(fn, dict(good, **{field: value}))] += 1
    for build in METHODS.values():
        for field, valid in build()[2].items():
            for value in wrong_values(valid):
                out["methods"][method_outcome(build, field, value)] += 1
    return out


def findings() -> list[tuple[str, str, object, str]]:
    """(target, field, value, outcome) for every finding, for fixing them one by one."""
    out = []
    for name, (fn, good) in CALLABLES.items():
        for field, valid in good.items():
            for value in wrong_values(valid):
                got = call_outcome(fn, dict(good, **{field: value}))
                if got.startswith("escape"):
                    out.append((name, field, value, got))
    for name, build in METHODS.items():
        for field, valid in build()[2].items():
            for value in wrong_values(valid):
                got = method_outcome(build, field, value)
                if got not in ("ok", "rejected"):
                    out.append((name, field, value, got))
    return out


if __name__ == "__main__":  # pragma: no cover - the report's numbers
    import os
    import sys

    from tests.hardening.api_targets import scratch_dir

    os.chdir(scratch_dir())

    if "--findings" in sys.argv:
        for name, field, value, got in findings():
            print(f"{got:28} {name}.{field} = {str(value)[:60]!s}")
    else:
        for cls, c in counts().items():
            print(cls, sum(c.values()), dict(sorted(c.items())))
