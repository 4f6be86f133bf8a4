"""Theorems, lemmas and how one is decided with Z3.

A *claim* is ``hypotheses => goal`` over named variables, built by a function
``build(F, o, v) -> (hyps, goal)`` where ``F`` is a formula set (reference or a variant), ``o`` an
ops back-end and ``v`` maps variable names to Z3 terms or to concrete values. The same builder
therefore

* is negated and handed to Z3 (``o = Z3Ops``): ``unsat`` means *proved* for all integers that meet
  the hypotheses — no sampling, no bounds beyond the stated hypotheses;
* evaluates a concrete configuration (``o = PyOps``) — what a counterexample file replays.

"Proved" is only ever reported for ``unsat``; a solver timeout or ``unknown`` is reported as
``unknown``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import z3

from .formulas import Formulas
from .ops import PyOps, Z3Ops

PROVED = "proved"
COUNTEREXAMPLE = "counterexample"
UNKNOWN = "unknown"

#: variable kinds a claim may declare
INT, BOOL = "int", "bool"

Builder = Callable[[Formulas, Any, Mapping[str, Any]], "tuple[list[Any], Any]"]


@dataclass(frozen=True)
class Claim:
    """``hypotheses => goal`` over ``variables`` (name -> ``"int"`` / ``"bool"``).

    Args:
        name: short id, unique within its theorem (``"swa"``, ``"sum"``…).
        text: the statement in words.
        variables: the free variables, in the order a counterexample lists them.
        build: ``(F, ops, values) -> (hypotheses, goal)``.
    """

    name: str
    text: str
    variables: Mapping[str, str]
    build: Builder

    def z3_vars(self) -> dict[str, Any]:
        return {n: (z3.Bool(n) if k == BOOL else z3.Int(n)) for n, k in self.variables.items()}

    def evaluate(self, F: Formulas, values: Mapping[str, Any]) -> tuple[bool, bool]:
        """``(hypotheses hold, goal holds)`` on concrete values."""
        missing = [n for n in self.variables if n not in values]
        if missing:
            raise KeyError(f"claim {self.name!r} needs values for {missing}")
        hyps, goal = self.build(F, PyOps, values)
        return all(bool(h) for h in hyps), bool(goal)


@dataclass(frozen=True)
class Theorem:
    """A theorem: a whole claim, the lemmas that prove it, and what it is about.

    Args:
        id: ``"T1"``…; name: a slug (``"single-source"``).
        title / statement: one line / the full statement in words.
        reference: the kvref.spec functions (and vLLM functions) it is about.
        bounds: hypotheses added beyond "positive integers", each stated in words.
        claim: the whole statement (concrete checks and counterexamples use it).
        lemmas: claims that together imply ``claim`` (proved one by one; ``(claim,)`` if none).
        combination: how the lemmas imply the claim, in words.
    """

    id: str
    name: str
    title: str
    statement: str
    reference: tuple[str, ...]
    bounds: tuple[str, ...]
    claim: Claim
    lemmas: tuple[Claim, ...] = ()
    combination: str = ""
    #: partial assignments tried first when searching a counterexample to the whole claim (a
    #: model found under extra equalities is still a model; they only shrink the search)
    search_hints: tuple[Mapping[str, Any], ...] = ()
    #: the claim with one stated bound dropped, each expected to have a counterexample under the
    #: reference (shows the bound is needed, not decoration)
    necessary: tuple[Claim, ...] = ()

    @property
    def proof_obligations(self) -> tuple[Claim, ...]:
        return self.lemmas or (self.claim,)


@dataclass
class ClaimResult:
    claim: str
    status: str
    seconds: float
    model: dict[str, Any] | None = None
    reason: str = ""


@dataclass
class TheoremResult:
    """What ``prove`` found for one theorem under one formula set."""

    theorem: str
    name: str
    title: str
    formulas: str
    status: str
    seconds: float
    lemmas: list[ClaimResult] = field(default_factory=list)
    counterexample: dict[str, Any] | None = None
    failing_claim: str | None = None
    reproducer: str | None = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == PROVED


def _model_value(model: z3.ModelRef, term: Any, kind: str) -> Any:
    val = model.eval(term, model_completion=True)
    if kind == BOOL:
        return bool(z3.is_true(val))
    return val.as_long()


def decide(claim: Claim, F: Formulas, timeout_ms: int = 10_000, *, fixed: Mapping[str, Any] | None = None,
           logic: str | None = None) -> ClaimResult:
    """Ask Z3 for values meeting the hypotheses but not the goal.

    ``fixed`` pins some variables (counterexample search only: ``unsat`` under pins proves
    nothing and is reported as ``unknown``); ``logic`` picks a Z3 solver (e.g. ``"QF_NIA"``).
    """
    o = Z3Ops()
    v = claim.z3_vars()
    hyps, goal = claim.build(F, o, v)
    solver = z3.SolverFor(logic) if logic else z3.Solver()
    for name, value in (fixed or {}).items():
        if name in v:
            solver.add(v[name] == value)
    solver.set("timeout", int(timeout_ms))
    solver.add(*hyps)
    solver.add(*o.side)
    solver.add(z3.Not(goal))
    start = time.perf_counter()
    answer = _interruptible_check(solver)
    seconds = time.perf_counter() - start
    if answer == z3.unsat:
        if fixed:
            return ClaimResult(claim.name, UNKNOWN, seconds, reason="unsat under search hints")
        return ClaimResult(claim.name, PROVED, seconds)
    if answer == z3.sat:
        m = solver.model()
        model = {n: _model_value(m, v[n], k) for n, k in claim.variables.items()}
        return ClaimResult(claim.name, COUNTEREXAMPLE, seconds, model=model)
    reason = solver.reason_unknown()
    if reason in _INTERRUPTED:
        # Z3 catches SIGINT itself while it checks: it cancels the check and answers "unknown",
        # and Python never sees the Ctrl-C. Re-raise it, so an interrupted run stops instead of
        # going on (and reporting the claim as merely unknown).
        raise KeyboardInterrupt(f"Z3 check of {claim.name} interrupted")
    return ClaimResult(claim.name, UNKNOWN, seconds, reason=reason)


#: ``reason_unknown()`` of a check Z3 cancelled on SIGINT (its ctrl-c handler)
_INTERRUPTED = ("interrupted from keyboard",)


def _interruptible_check(solver: Any) -> Any:
    """``solver.check()`` that never swallows a Ctrl-C.

    Z3's own ctrl-c handling replaces Python's SIGINT handler while it checks: a SIGINT that comes
    just before the search ends is taken by Z3, the check still answers sat/unsat, and Python never
    sees the interrupt, so ``kvref verify --only proofs`` ran to the end and exited 0 after Ctrl-C
    (found by ``tests/hardening/test_interrupts.py`` in a full run). With Z3's handler off
    (``ctrl_c=False``) Python's own handler only marks the signal, and the ``KeyboardInterrupt``
    is raised as the check returns: at most one check's timeout later (20 s by default, 5 s for a
    counterexample search), within the CLI's stop bound. (Running the check in a worker thread and
    cancelling it with ``Context.interrupt`` stopped sooner but crashed the process now and then.)
    """
    z3.set_param("ctrl_c", False)
    return solver.check()
