"""``kvref verify --ray``: one Ray unit per check (issue #27; the other commands: kvref.ray_mutants).

Each check runs on a worker by the same :func:`kvref.verify.run_check`, with the same
:class:`~kvref.check_context.VerifyContext` (profile, seed) and baseline, in a fresh process whose
Hypothesis constant pool is the driver's (:mod:`kvref.ray_inputs`), so it draws the traces it draws
in ``kvref verify --only CHECK``; the results are put back in the checks' order. A unit whose
worker died twice, or that raised, is an ``error`` row, never a pass. docs/ray.md.
"""

from __future__ import annotations

from collections.abc import Callable

from .ray_runner import Unit, UnitOutcome, run_units


# --------------------------------------------------------------------------------------------
# kvref verify


def verify_unit(name: str, ctx, baseline, collect: bool):
    """On a worker: one check of ``kvref verify``, exactly as the local loop runs it."""
    from kvref.checks import check_named
    from kvref.verify import run_check

    return run_check(check_named(name), ctx, baseline, collect=collect)


def run_verify(checks, ctx, baseline, collect: bool, exitfirst: bool,
               log: Callable[[str], None]) -> tuple[list, object | None]:
    """Every check as a unit; ``(results in the checks' order, the interrupted row or None)``.

    ``exitfirst``: like the local loop, the report stops after the first failing check in order
    (the later ones are cancelled or dropped)."""
    from .report import ERROR, CheckResult

    units = [Unit(c.name, verify_unit, (c.name, ctx, baseline, collect)) for c in checks]
    order = [c.name for c in checks]
    got: dict[str, object] = {}

    def result_of(o: UnitOutcome):
        if o.ok:
            return o.value
        return CheckResult(o.key, ERROR, o.error, seconds=o.seconds)

    def on_done(o: UnitOutcome) -> bool:
        r = result_of(o)
        got[o.key] = r
        log(f"{o.key}: {r.status} ({r.seconds:.1f}s) {r.summary}")
        if not exitfirst:
            return False
        for name in order:  # stop once the first failing check in order is known, and all before it
            if name not in got:
                return False
            if got[name].failing:
                return True
        return False

    run = run_units(units, on_done=on_done)
    results = [got.get(o.key) or result_of(o) for o in run.outcomes]
    interrupted = None
    if run.interrupted:
        interrupted = next((r for r, o in zip(results, run.outcomes) if o.cancelled), None)
        if interrupted is None:  # everything had finished when Ctrl-C came: still a partial report
            interrupted = CheckResult(order[-1], ERROR, "interrupted (Ctrl-C)")
    elif exitfirst:
        results = cut_after_first_failing(results)
    return results, interrupted


def cut_after_first_failing(results: list) -> list:
    """``--exitfirst``'s report: the rows up to the first failing one in the checks' order (the
    local loop stops there), whatever order the units finished in."""
    first = next((i for i, r in enumerate(results) if r.failing), None)
    return results if first is None else results[:first + 1]
