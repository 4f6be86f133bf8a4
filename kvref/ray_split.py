"""``kvref verify --split N``: one check as N seed ranges of its Hypothesis examples (issue #27).

A check of ``kvref verify`` is one Hypothesis search; on a cluster one long nightly check is then
the critical path. ``--split N`` runs it as N *parts*: part ``i`` draws ``1/N`` of the check's
example budget (the budget the profile gives, spread as evenly as ints allow, at least one) with
its own seed (:func:`part_seed`: part 0 keeps ``--seed``, the others a deterministic hash of the
seed and the part). The parts are merged into one row (:func:`merge`): the first failing part in
order decides a failing row (its finding, counterexample and seed), the examined counts add up,
and every part's seed and summary are listed in the details.

The same split runs locally (parts one after another, in this process) and with ``--ray`` (a unit
per part) with the same findings: part 0 of every check runs first, and the parts 1..N-1 of a
check run in workers that load what its part 0 loaded (a local run has loaded those modules by
then; Hypothesis draws from the constants of the local modules loaded, :mod:`kvref.ray_inputs`).
A check whose part 0 never asked for an example budget (a proof, the explorer, a fixed table) is
not split: it runs once, and its row says so.

A split is *another* search than the unsplit run: N independent shorter searches with N seeds,
each shrinking its own failure; not the examples of the unsplit run cut in pieces (a Hypothesis
run is adaptive and stops at its first failure, so no cut of it keeps its findings). docs/ray.md
says how to choose N.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, fields

from .check_context import VerifyContext

#: upper bound of ``--split``
MAX_PARTS = 1024


def part_seed(seed: int, part: int) -> int:
    """Part 0 keeps ``seed``; part ``i`` > 0 gets a 32-bit hash of (seed, i): deterministic, and
    independent of N (part 3 of ``--split 4`` is part 3 of ``--split 8``)."""
    if part == 0:
        return seed
    digest = hashlib.sha256(f"kvref --split seed {seed} part {part}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


@dataclass
class PartContext(VerifyContext):
    """The check's context for one part: its seed, and :meth:`examples` its share of the budget."""

    part: int = 0
    parts: int = 1
    #: the check asked for an example budget (it is then split; else it ran whole)
    used: bool = False

    def examples(self, fast: int, ci: int, nightly: int | None = None) -> int:
        self.used = True
        total = super().examples(fast, ci, nightly)
        return max(1, total // self.parts + (1 if self.part < total % self.parts else 0))


def part_context(ctx: VerifyContext, part: int, parts: int) -> PartContext:
    base = {f.name: getattr(ctx, f.name) for f in fields(VerifyContext)}
    base["seed"] = part_seed(ctx.seed, part)
    return PartContext(**base, part=part, parts=parts)


def merge(name: str, parts: list[tuple[PartContext, object]]):
    """One row for the parts of a split check (``[(context, CheckResult)]`` in part order)."""
    from .report import ACCEPTED, FAILING, PASSED, SKIPPED, UNKNOWN, CheckResult

    n = len(parts)
    rank = {SKIPPED: 0, PASSED: 1, UNKNOWN: 2, ACCEPTED: 3}
    failing = [(c, r) for c, r in parts if r.status in FAILING]
    ctx, chosen = failing[0] if failing else max(parts, key=lambda p: rank.get(p[1].status, 4))
    examined = [r.examined for _, r in parts if r.examined is not None]
    seeds = ", ".join(str(c.seed) for c, _ in parts)
    if failing:
        summary = f"part {ctx.part + 1} of {n} (seed {ctx.seed}): {chosen.summary}"
    else:
        summary = f"{n} seed ranges (seeds {seeds}){'' if not examined else f', {sum(examined):,} examined'}: " \
                  f"{chosen.summary}"
    per_part = [f"part {c.part + 1}/{n} seed {c.seed}: {r.status} {r.summary}" for c, r in parts]
    return CheckResult(name, chosen.status, summary, seconds=sum(r.seconds for _, r in parts),
                       details=list(chosen.details) + per_part,
                       artifacts=[a for _, r in parts for a in r.artifacts], signature=chosen.signature,
                       met_signatures=sorted({s for _, r in parts for s in r.met_signatures}),
                       examined=sum(examined) if examined else None)


def not_split(ctx: PartContext, result):
    result.details.append(f"not split: the check has no example budget (it ran once, seed {ctx.seed})")
    return result


def hide_ray_modules() -> None:
    """The local split draws from the constants a Ray worker draws from: the Ray-only modules
    (this one, kvref.ray_runner which the parser loads) are hidden from Hypothesis, as there."""
    import sys

    try:
        from hypothesis.internal.conjecture import providers

        seen = providers._seen_modules
    except (ImportError, AttributeError):  # pragma: no cover - another Hypothesis version
        return
    from .ray_inputs import RAY_ONLY

    for name in RAY_ONLY:
        m = sys.modules.get(name)
        if m is not None:
            seen.add(id(m))


def run_split(check, ctx: VerifyContext, baseline, collect: bool, parts: int):
    """The local ``--split``: part 0, then (if the check has an example budget) the others, merged."""
    from .verify import run_check

    hide_ray_modules()
    first = part_context(ctx, 0, parts)
    r0 = run_check(check, first, baseline, collect=collect)
    if not first.used:
        return not_split(first, r0)
    done = [(first, r0)]
    for i in range(1, parts):
        c = part_context(ctx, i, parts)
        done.append((c, run_check(check, c, baseline, collect=collect)))
    return merge(check.name, done)


# --------------------------------------------------------------------------------------------
# on Ray


def part_unit(check, ctx: PartContext, baseline, collect: bool, modules: list[str] | None) -> dict:
    """On a worker: one part of ``check`` (a :class:`~kvref.check_context.Check`, sent by reference
    to its module's functions; ``modules``: load what its part 0 loaded first)."""
    from kvref.ray_inputs import align_with

    from .verify import run_check

    if modules is not None:
        align_with(modules)
    result = run_check(check, ctx, baseline, collect=collect)
    return {"result": result, "used": ctx.used}


def run_split_on_ray(checks, ctx: VerifyContext, baseline, collect: bool, exitfirst: bool, parts: int,
                     log: Callable[[str], None]) -> tuple[list, object | None]:
    """``--ray --split N``: part 0 of every check as a unit, then the other parts of the checks that
    have an example budget; ``(rows in the checks' order, the interrupted row or None)``."""
    from .ray_inputs import local_modules
    from .ray_runner import Unit, UnitOutcome, run_units
    from .ray_verify import cut_after_first_failing
    from .report import ERROR, CheckResult

    def error_row(name: str, o: UnitOutcome):  # a cancelled unit's row reads "interrupted ..." as unsplit ones do
        why = o.error if o.cancelled else f"part {o.key[1] + 1} of {parts} (seed {part_seed(ctx.seed, o.key[1])}): {o.error}"
        return CheckResult(name, ERROR, why, seconds=o.seconds)

    firsts = {c.name: part_context(ctx, 0, parts) for c in checks}
    phase1 = run_units([Unit((c.name, 0), part_unit, (c, firsts[c.name], baseline, collect, None))
                        for c in checks])
    rows: dict[str, object] = {}
    later: list = []
    driver = local_modules()
    for c, o in zip(checks, phase1.outcomes):
        if not o.ok:
            rows[c.name] = error_row(c.name, o)
        elif not o.value["used"]:
            rows[c.name] = not_split(firsts[c.name], o.value["result"])
        else:
            loaded = sorted(set(driver) | set(o.modules))
            for i in range(1, parts):
                later.append(Unit((c.name, i), part_unit, (c, part_context(ctx, i, parts), baseline, collect,
                                                           loaded)))
        if c.name in rows:
            log(f"{c.name}: {rows[c.name].status} ({rows[c.name].seconds:.1f}s) {rows[c.name].summary}")
    phase2 = run_units(later) if later and not phase1.interrupted else None
    got = {u.key: o for u, o in zip(later, phase2.outcomes)} if phase2 is not None else {}
    interrupted = None
    for c, o0 in zip(checks, phase1.outcomes):
        if c.name in rows:
            continue
        outs = [o0] + [got.get((c.name, i)) for i in range(1, parts)]
        if any(o is None for o in outs):  # Ctrl-C before its later parts were sent
            rows[c.name] = CheckResult(c.name, ERROR, "interrupted (Ctrl-C): cancelled on Ray before it finished")
        elif all(o.ok for o in outs):
            rows[c.name] = merge(c.name, [(part_context(ctx, i, parts), o.value["result"]) for i, o in enumerate(outs)])
        else:  # a part whose worker died twice, that raised, or that Ctrl-C cancelled: the row is that error
            bad = next(o for o in outs if not o.ok)
            rows[c.name] = error_row(c.name, bad)
        log(f"{c.name}: {rows[c.name].status} ({rows[c.name].seconds:.1f}s) {rows[c.name].summary}")
    results = [rows[c.name] for c in checks]
    if phase1.interrupted or (phase2 is not None and phase2.interrupted):
        interrupted = next((r for r in results if r.summary.startswith("interrupted")), None) or \
            CheckResult(checks[-1].name, ERROR, "interrupted (Ctrl-C)")
    elif exitfirst:
        results = cut_after_first_failing(results)
    return results, interrupted
