"""What a check is and what it is given: :class:`Check`, :class:`VerifyContext`, the vLLM gate.

Every check of kvref — those ``kvref verify`` runs, those the mutant campaigns select — is a
:class:`Check` whose ``run(ctx: VerifyContext) -> CheckResult``. The one list of them is
:data:`kvref.checks.CHECKS`; the bodies live beside what they check (:mod:`kvref.verify`,
:mod:`kvref.cli.explore`, :mod:`kvref.models.mutants.campaign`) and import only this module, so
the registry imports them and nothing imports back.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from .report import ERROR, FAILED, SKIPPED, CheckResult

#: the profile the reference mutant campaign runs checks under: ``budget`` examples, a verdict
#: (no shrinking, reproducible inputs), each check's campaign form (:mod:`kvref.checks`)
CAMPAIGN = "campaign"


@dataclass
class VerifyContext:
    profile: str = "fast"
    against: str | None = None
    device: str | None = None
    out_dir: str = "counterexamples"
    seed: int = 0
    #: shrink failing traces to minimal ones (slower when something fails)
    shrink: bool = True
    #: write reproducers of the *expected* historic refutations too (findings always get one)
    write_reproducers: bool = False
    #: wall-clock bound on shrinking one failing example (Hypothesis' own bound is 300 s)
    shrink_seconds: float | None = None
    #: examples per machine run under the ``campaign`` profile (``kvref mutants --budget``)
    budget: int | None = None

    def shrink_budget(self) -> float:
        """Seconds one failing example may spend shrinking: a first finding within seconds, not minutes."""
        if self.shrink_seconds is not None:
            return self.shrink_seconds
        return {"fast": 15.0, "ci": 45.0}.get(self.profile, 300.0)

    def examples(self, fast: int, ci: int, nightly: int | None = None) -> int:
        """Example/trace budget for the active profile (the campaign's ``budget`` under ``campaign``)."""
        if self.profile == CAMPAIGN and self.budget is not None:
            return self.budget
        if self.profile == "nightly":
            return nightly if nightly is not None else ci * 100
        return ci if self.profile == "ci" else fast

    def ensure_out_dir(self) -> str:
        os.makedirs(self.out_dir, exist_ok=True)
        return self.out_dir


@dataclass(frozen=True)
class Check:
    """One check: its name (``kvref verify --only NAME``, ``kvref mutants --checks NAME``), a
    one-line description, and ``run(ctx) -> CheckResult``."""

    name: str
    description: str
    run: Callable[[VerifyContext], CheckResult]
    #: ``kvref verify`` runs it without ``--only`` (and the pytest plugin without ``--kvref-checks``)
    default: bool = True
    #: it drives the installed vLLM: the vLLM source campaign can select it, the reference
    #: campaign leaves it out where vLLM does not import
    vllm: bool = False
    #: mutant layers whose code it never executes: the reference campaign does not run it on them
    blind_to: frozenset[str] = frozenset()
    #: False: the reference campaign runs it once, on the clean reference only (the proofs are
    #: about the formula source, which a runtime patch does not touch)
    per_mutant: bool = True
    #: a module that must import for it to run in this checkout (a partial tree lacks some)
    needs: str | None = None


def vllm_available() -> tuple[bool, str]:
    """Whether vLLM imports here — *any* version — and the line that says which one it is.

    kvref models vLLM 0.33.0, but a developer's checkout reports a dev version, and forks and
    nightlies others: all are checked, and where they behave differently the checks say so as
    findings (never skips). See :mod:`kvref.impl.vllm.installed`.
    """
    from kvref.impl.vllm.installed import vllm_available as available

    return available()


def vllm_gate(ctx: VerifyContext, name: str) -> CheckResult | None:
    """None when check ``name`` can drive the installed vLLM; else the result to report instead.

    No vLLM: skipped (failed with ``--against vllm``). A vLLM whose API moved in a way this check
    depends on: ``error`` naming each symbol and what kvref expected (:mod:`kvref.impl.vllm.api`),
    while the checks that do not need those symbols still run.
    """
    ok, why = vllm_available()
    if not ok:
        if ctx.against == "vllm":
            return CheckResult(name, FAILED, f"--against vllm given but {why}")
        return CheckResult(name, SKIPPED, why + " (install vLLM to run conformance)")
    from kvref.impl.vllm.api import check_api_for

    problems = check_api_for(name)
    if problems:
        return CheckResult(name, ERROR, f"the installed vLLM's API differs from what kvref binds to: {problems[0]}"
                           + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""), details=problems)
    return None
