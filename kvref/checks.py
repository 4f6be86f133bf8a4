"""The one registry of kvref's checks, and what each user selects from it.

:data:`CHECKS` lists every check once — name, description, body, and flags — in the order
``kvref verify`` runs them. Every check has the one signature ``run(ctx: VerifyContext) ->
CheckResult`` (:mod:`kvref.check_context`). Its users:

* ``kvref verify`` and the pytest plugin: :func:`select_checks` (the ``default`` ones, or
  ``--only`` any of them; ``--against vllm`` runs the vLLM-facing ones first, :data:`VLLM_FIRST`);
* the reference mutant campaign (``kvref mutants``, ``kvref verify --mutants``):
  :func:`run_mutant_campaign` runs any check but ``mutants`` under the ``campaign`` profile, by
  default the :data:`MUTANT_CAMPAIGN` ones, cheapest first; a check fails → the mutant is killed;
* the vLLM source campaign (``kvref mutants --target vllm``, :mod:`kvref.vllm_campaign`): the
  checks flagged ``vllm``, by default the ``default`` ones among them (:func:`vllm_checks`).

Example — one entry, and the campaign form of a check whose body is a verdict function::

    Check("explorer", "exhaustive small-scope explorer over the reference (states, deadlocks)",
          _campaign_form("explorer", check_explorer, campaign.explorer_verdict))
    Check("pool-machine", "block-pool state machine vs the model",
          _verdict_check("pool-machine", campaign.pool_machine_verdict), default=False,
          blind_to=_NO_SCHEDULER)

The bodies live beside what they check (:mod:`kvref.verify`, :mod:`kvref.cli.explore`,
:mod:`kvref.models.mutants.campaign`) and never import this module: the import graph runs from
the registry to the bodies only.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvref.models.mutants import campaign
from kvref.spec.errors import InvalidFieldError

from .check_context import CAMPAIGN, Check, VerifyContext, vllm_gate
from .cli.explore import check_explorer, check_explorer_conformance
from .report import FAILED, PASSED, CheckResult
from .verify_connector import check_connector_conformance
from .verify_p2p import check_p2p_conformance
from .verify_offload_worker import check_offload_worker_conformance
from .verify_tiering import check_tiering_conformance
from .verify import (
    check_crosshair,
    check_kv_manager_conformance,
    check_offload_conformance,
    check_offload_machine,
    check_planning_conformance,
    check_proofs,
    check_reference_machine,
    check_scheduler_conformance,
    check_spec_decode_conformance,
    check_scheduler_machine,
    check_spec_examples,
    check_startup_liveness,
    check_torch_differential,
)

Verdict = Callable[[int], "str | None"]


def _verdict_check(name: str, verdict: Verdict, vllm: bool = False) -> Callable[[VerifyContext], CheckResult]:
    """A check body from a campaign verdict ``verdict(budget) -> str | None`` (None: passed).

    Under ``kvref verify --only NAME`` the budget is the campaign's default (100 examples, 500 under
    ci, 1000 nightly) and a vLLM check is gated like verify's own; under the campaign profile the
    campaign's ``--budget`` (availability was decided before the campaign started)."""
    def run(ctx: VerifyContext) -> CheckResult:
        if vllm and ctx.profile != CAMPAIGN:
            gate = vllm_gate(ctx, name)
            if gate is not None:
                return gate
        budget = ctx.examples(100, 500, 1000)
        t0 = time.perf_counter()
        why = verdict(budget)
        secs = time.perf_counter() - t0
        if why is not None:
            return CheckResult(name, FAILED, why, secs)
        return CheckResult(name, PASSED, f"passed at budget {budget}", secs)
    run.__doc__ = verdict.__doc__
    return run


def _campaign_form(name: str, body: Callable[[VerifyContext], CheckResult],
                   verdict: Verdict) -> Callable[[VerifyContext], CheckResult]:
    """``body`` under ``kvref verify``; under the campaign profile the check's campaign form
    ``verdict(budget)`` (smaller scopes, a verdict at the first finding, no files written)."""
    in_campaign = _verdict_check(name, verdict)

    def run(ctx: VerifyContext) -> CheckResult:
        return in_campaign(ctx) if ctx.profile == CAMPAIGN else body(ctx)
    run.__doc__ = body.__doc__
    return run


def _check_mutants(ctx: VerifyContext) -> CheckResult:
    """``kvref verify --mutants``: the campaign, CI subset under fast/ci, everything (with the
    proofs' formula variants) under nightly; fails below a 95 % kill rate of the reference mutants."""
    t0 = time.perf_counter()
    nightly = ctx.profile == "nightly"
    res = run_mutant_campaign(subset="all" if nightly else "ci", budget=100 if nightly else 50,
                              proof_variants=nightly)
    secs = time.perf_counter() - t0
    if res.baseline_failures:
        return CheckResult("mutants", FAILED, "the clean reference fails a campaign check", secs,
                           details=[f"{k}: {v}" for k, v in res.baseline_failures.items()])
    details = [f"{r.mutant.name}: {'killed by ' + r.killed_by if r.killed else 'SURVIVED'}"
               + (f" ({r.reason})" if r.reason else "") for r in res.results]
    status = PASSED if res.reference_kill_rate >= 0.95 else FAILED
    return CheckResult("mutants", status, res.summary(), secs, details=details)


_NO_SCHEDULER = frozenset({"scheduler"})
_STM = "kvref.models.machines.single_type_manager"
_SCHED = "kvref.models.machines.scheduler"
_FORMULAS = "kvref.proofs.formulas"

#: every check, in the order ``kvref verify`` runs them
CHECKS: list[Check] = [
    Check("spec", "vLLM's documented sizing figures through kvref.spec", check_spec_examples),
    Check("startup-liveness", "startup-accepted pools serve a max-length request (reference, vLLM)",
          check_startup_liveness, vllm=True),
    Check("proofs", "Z3 theorems over unbounded ints + historic vLLM bugs re-found",
          _campaign_form("proofs", check_proofs, campaign.proofs_verdict), per_mutant=False, needs=_FORMULAS),
    Check("crosshair", "CrossHair contracts on spec functions and block pool operations", check_crosshair),
    Check("machine-reference", "KV cache manager state machine, reference alone, invariants every step",
          check_reference_machine),
    Check("machine-scheduler", "scheduler state machine, reference alone, with liveness", check_scheduler_machine),
    Check("machine-offload", "offload schedulers on the reference with the content model", check_offload_machine),
    Check("explorer", "exhaustive small-scope explorer over the reference (states, deadlocks)",
          _campaign_form("explorer", check_explorer, campaign.explorer_verdict), needs="kvref.models.explorer.kv"),
    Check("conform-explorer", "every transition of small explorer scopes, vLLM's Scheduler and torch vs the reference",
          check_explorer_conformance, vllm=True),
    Check("torch-differential", "reference vs torch implementation on generated traces", check_torch_differential),
    Check("conform-kv-manager", "reference vs the installed vLLM's KVCacheManager on generated traces",
          check_kv_manager_conformance, vllm=True),
    Check("conform-scheduler", "reference scheduler in lock-step with the installed vLLM's Scheduler",
          check_scheduler_conformance, vllm=True),
    Check("conform-spec-decode", "speculative decoding in the scheduler vs the installed vLLM's Scheduler",
          check_spec_decode_conformance, vllm=True),
    Check("conform-connector", "KV-connector flows in the scheduler vs the installed vLLM's Scheduler",
          check_connector_conformance, vllm=True),
    Check("conform-offload", "offload schedulers vs the installed vLLM's on random traces", check_offload_conformance,
          vllm=True),
    Check("conform-p2p", "P2P offload tier: two vLLM engines over loopback ZMQ vs the reference world",
          check_p2p_conformance, vllm=True),
    Check("conform-offload-worker", "vLLM's whole OffloadingConnector (scheduler + worker roles, bytes) vs the reference",
          check_offload_worker_conformance, vllm=True),
    Check("conform-tiering", "multi-tier offloading (TieringOffloadingManager, fs/obj/example/kvcr tiers) vs the reference",
          check_tiering_conformance, vllm=True),
    Check("conform-planning", "startup pool sizing vs the installed vLLM on generated configs",
          check_planning_conformance, vllm=True),
    # the reference mutant campaign's own checks: verdicts at a budget, off in kvref verify by default
    Check("spec-formulas", "kvref.spec vs the proofs' formula source",
          _verdict_check("spec-formulas", campaign.spec_formulas_verdict), default=False, blind_to=_NO_SCHEDULER,
          needs=_FORMULAS),
    Check("pool-machine", "block-pool state machine vs the model",
          _verdict_check("pool-machine", campaign.pool_machine_verdict), default=False, blind_to=_NO_SCHEDULER),
    Check("scheduler-machine", "scheduler machine on the reference: invariants and the liveness drain",
          _verdict_check("scheduler-machine", campaign.scheduler_machine_verdict), default=False, needs=_SCHED),
    Check("manager-machine", "single-type manager machines",
          _verdict_check("manager-machine", campaign.manager_machine_verdict), default=False, blind_to=_NO_SCHEDULER,
          needs=_STM),
    Check("manager-vllm", "manager machine paired with vLLM 0.33.0",
          _verdict_check("manager-vllm", campaign.manager_vllm_verdict, vllm=True), default=False, vllm=True,
          blind_to=_NO_SCHEDULER, needs=_STM),
    Check("scheduler-vllm", "reference Scheduler in lock step with vLLM 0.33.0's Scheduler",
          _verdict_check("scheduler-vllm", campaign.scheduler_vllm_verdict, vllm=True), default=False, vllm=True,
          needs=_SCHED),
    Check("mutants", "mutant kill-rate campaign (only with --mutants)", _check_mutants, default=False),
]

#: with ``--against vllm`` the vLLM-facing checks run first, quickest first, so that a fault in the
#: developer's vLLM is reported within seconds rather than after the proofs and the explorer
VLLM_FIRST = ("conform-kv-manager", "conform-scheduler", "conform-spec-decode", "startup-liveness", "conform-connector",
              "conform-offload", "conform-tiering", "conform-offload-worker",
              "conform-planning", "conform-explorer", "conform-p2p")

#: the checks ``kvref verify`` runs in a second process, beside the others (#22,
#: :mod:`kvref.verify_ahead`): each draws nothing from Hypothesis' constant pool (Z3, CrossHair,
#: the machine runners, which switch the pool off; the second process checks it on every run, and
#: a check that did draw runs again in the first), so it finds there what it finds in one process.
#: The split balances the two processes in the default run (BENCHMARKS.md, session 17): the proofs
#: and CrossHair run while startup-liveness, the machines, the explorers and torch run here
AHEAD = ("proofs", "crosshair", "conform-scheduler", "conform-spec-decode", "conform-p2p", "conform-tiering")

#: the checks whose inputs depend on the kvref modules loaded before them (their ``run_generated``
#: ``@given`` runs read Hypothesis' constant pool; measured, session 17): with a second process
#: they wait for every row before theirs; the others run without waiting
DRAWS_CONSTANTS = ("conform-kv-manager", "conform-planning")

#: the reference mutant campaign's checks by default, in its order (cheapest first); the vLLM ones
#: only where vLLM imports
MUTANT_CAMPAIGN = ("spec-formulas", "explorer", "pool-machine", "scheduler-machine", "manager-machine",
                   "manager-vllm", "scheduler-vllm", "proofs")

#: the check that *is* the reference campaign (selectable by verify, not by the campaign itself)
CAMPAIGN_CHECK = "mutants"


def check_named(name: str) -> Check:
    for c in CHECKS:
        if c.name == name:
            return c
    raise InvalidFieldError("check", name, "one of " + ", ".join(c.name for c in CHECKS))


def select_checks(only=None, skip=(), mutants=False, against=None) -> list[Check]:
    """``kvref verify``'s checks: the default ones (or ``only``), ``mutants`` with ``--mutants``,
    less ``skip``; with ``against="vllm"`` the :data:`VLLM_FIRST` ones first."""
    chosen = [c for c in CHECKS if (c.name in only if only else c.default)]
    if mutants and not only:
        chosen += [c for c in CHECKS if c.name == CAMPAIGN_CHECK and c not in chosen]
    chosen = [c for c in chosen if c.name not in skip]
    if against == "vllm":
        rank = {name: i for i, name in enumerate(VLLM_FIRST)}
        chosen.sort(key=lambda c: rank.get(c.name, len(rank)))  # stable: the others keep their order
    return chosen


def vllm_checks(default_only: bool = True) -> tuple[str, ...]:
    """The checks that drive the installed vLLM, in verify's order: those the vLLM source campaign
    runs by default (``default_only``) or may select."""
    return tuple(c.name for c in CHECKS if c.vllm and (c.default or not default_only))


def mutant_campaign_checks() -> tuple[str, ...]:
    """Every check the reference mutant campaign may select (all but the campaign itself)."""
    return tuple(c.name for c in CHECKS if c.name != CAMPAIGN_CHECK)


# --------------------------------------------------------------------------------------------
# the reference mutant campaign: which checks can run here, and running them on every mutant


def _vllm_missing() -> str:
    """Why vLLM 0.33.0 cannot be driven here ("" when it imports)."""
    try:
        from kvref.impl.vllm.installed import ensure_importable

        ensure_importable()
    except Exception as e:  # noqa: BLE001 - ImportError, a wrong version or a broken install
        return f"vLLM not usable: {e}"
    return ""


def unavailable_checks(names: list[str] | None = None) -> dict[str, str]:
    """Of ``names`` (default: the campaign's default checks), those that cannot run in this
    checkout or environment, with the reason."""
    import importlib

    selectable = mutant_campaign_checks()
    for name in names or ():
        if name not in selectable:
            raise InvalidFieldError("names", name, "one of " + ", ".join(selectable))
    out: dict[str, str] = {}
    vllm_why: str | None = None
    for name in (MUTANT_CAMPAIGN if names is None else names):
        check = check_named(name)
        if check.needs is not None:
            try:
                importlib.import_module(check.needs)
            except ImportError as e:
                out[name] = f"{check.needs} not importable ({e})"
                continue
        if check.vllm:
            if vllm_why is None:
                vllm_why = _vllm_missing()
            if vllm_why:
                out[name] = vllm_why
                continue
        if name == "explorer":
            from kvref.models.explorer.kv import reference_available

            if not reference_available():
                out[name] = "the reference scheduler stack is not in this checkout"
    return out


def available_checks() -> list[str]:
    """The campaign's default checks that can run here, in campaign order (the vLLM ones only
    where vLLM 0.33.0 imports)."""
    missing = unavailable_checks()
    return [name for name in MUTANT_CAMPAIGN if name not in missing]


def _campaign_verdict(check: Check, budget: int) -> str | None:
    """Run ``check`` under the campaign profile: None when it passed, else why it failed."""
    import tempfile

    out_dir = tempfile.mkdtemp(prefix="kvref_campaign_")  # a verify body may write a trace there
    try:
        result = check.run(VerifyContext(profile=CAMPAIGN, budget=budget, shrink=False, out_dir=out_dir))
    finally:
        import shutil

        shutil.rmtree(out_dir, ignore_errors=True)
    if not result.failing:
        return None
    return result.summary + (f": {result.details[0]}" if result.details else "")


def run_mutant_campaign(mutants=None, checks: list[str] | None = None, budget: int = 100, all_checks: bool = False,
                        subset: str = "all", proof_variants: bool = False,
                        progress=None) -> campaign.CampaignResult:
    """Run the checks named ``checks`` (in order; default: :data:`MUTANT_CAMPAIGN`, those available
    here) against each mutant: :func:`kvref.models.mutants.campaign.run_campaign`, which documents
    the other arguments. A named check that cannot run here (a vLLM check without vLLM) is left out
    and listed in ``CampaignResult.skipped_checks``."""
    t0 = time.perf_counter()
    skipped: dict[str, str] = {}
    if checks:
        if isinstance(checks, str) or not all(isinstance(n, str) for n in checks):
            raise InvalidFieldError("checks", checks, "a list of check names")
        selectable = mutant_campaign_checks()
        for n in checks:
            if n not in selectable:
                raise InvalidFieldError("checks", n, "one of " + ", ".join(selectable))
        missing = unavailable_checks(list(checks))
        skipped = {n: missing[n] for n in checks if n in missing}
        names = [n for n in checks if n not in missing]
    else:
        names = available_checks()
    return campaign.run_campaign(mutants, [check_named(n) for n in names], _campaign_verdict, budget=budget,
                                 all_checks=all_checks, subset=subset, proof_variants=proof_variants,
                                 progress=progress, skipped=skipped, started=t0)
