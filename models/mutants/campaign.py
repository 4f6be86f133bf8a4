"""The reference mutant campaign: run checks against every mutant, report who killed it.

Which checks exist, their order and which the campaign runs by default is the one registry,
:data:`kvref.checks.CHECKS`; :func:`kvref.checks.run_mutant_campaign` selects from it by name and
hands the chosen checks to :func:`run_campaign` here, with the ``verdict(check, budget)`` that
runs one (``None``: the check passed, the mutant survived it; else why it failed: killed). Checks
run in order; the first that fails kills the mutant and the rest are skipped (``all_checks=True``
runs them all, to see overlap).

Before the mutants, every check runs once on the clean reference: a check that fails there would
"kill" everything and says nothing, so the campaign refuses to run (``baseline_failures``).

A check may be *blind* to a layer (``Check.blind_to``): it never executes that layer's
code, so a mutant there cannot change its verdict and the check is not run on it (the block-pool
and manager machines never call the scheduler). A check with ``per_mutant=False`` (the proofs)
runs on the clean reference only.

This module also holds the campaign forms of the checks (``*_verdict(budget) -> str | None``),
which the registry wraps into checks of the one signature:

* ``spec-formulas`` — ``kvref.spec``'s caps and bounds against the proofs' formula source
  (:mod:`kvref.proofs.formulas`, evaluated with Python ints) on a grid of small configurations.
  The proofs are about those formulas, so a spec that drifts from them is no longer proved.
* ``explorer`` — :mod:`kvref.models.explorer.kv` at its small campaign scopes, then
  :mod:`kvref.models.explorer.simple_cpu` (SimpleCPU offload, completions in every order, bounded
  depth): any violation or deadlock kills.
* ``pool-machine`` — :mod:`kvref.models.machines.block_pool` with a fixed example budget.
* ``scheduler-machine`` — :func:`kvref.models.machines.scheduler.run_scheduler_machine` on the
  reference alone: the scheduler's and the manager's invariants after every operation, and the
  liveness drain (every request finishes within ``drain_bound``) on startup-consistent setups.
* ``manager-machine`` — :mod:`kvref.models.machines.single_type_manager`.
* ``manager-vllm`` — the same machine driving vLLM 0.33.0's ``KVCacheManager`` beside the
  reference and comparing every answer (only where vLLM is installed). Some faults are
  invisible to every safety check — the cache holds blocks nobody can hit, the admission gate is
  skipped — and only differ from vLLM; this is where they die.
* ``scheduler-vllm`` — ``run_scheduler_machine(with_vllm=True)``: the reference ``Scheduler`` in
  lock step with vLLM 0.33.0's ``Scheduler`` / ``AsyncScheduler`` on generated traces (the
  ``conform-scheduler`` machine), the first divergence kills (only where vLLM is installed).
  Most scheduler-policy faults — the wrong victim, a preempted request queued at the back, an
  off-by-one budget — keep every invariant and only differ from vLLM.
* ``proofs`` — ``kvref.proofs.api.run_all()``: every theorem, on the clean reference only (the
  theorems are about the formula source, which a runtime patch does not touch). With
  ``proof_variants=True`` the proofs' own historic formula variants are added as rows, killed when
  the theorem each breaks yields a counterexample.

Used by ``kvref mutants`` and by ``kvref verify --mutants`` (through :mod:`kvref.checks`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvref.models.mutants.mutant import Mutant
from kvref.spec.errors import InvalidFieldError


@dataclass
class MutantResult:
    mutant: Mutant
    killed: bool
    killed_by: str | None = None
    reason: str | None = None
    seconds: float = 0.0
    per_check: dict[str, str | None] = field(default_factory=dict)


@dataclass
class CampaignResult:
    results: list[MutantResult]
    checks: list[str]
    baseline_failures: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    #: checks asked for by name but not available here (no vLLM…), with the reason
    skipped_checks: dict[str, str] = field(default_factory=dict)

    @property
    def killed(self) -> list[MutantResult]:
        return [r for r in self.results if r.killed]

    @property
    def survivors(self) -> list[MutantResult]:
        return [r for r in self.results if not r.killed]

    @property
    def kill_rate(self) -> float:
        return len(self.killed) / len(self.results) if self.results else 1.0

    @property
    def reference_results(self) -> list[MutantResult]:
        """Rows that patch the reference/spec at runtime (not the proofs' formula variants)."""
        return [r for r in self.results if r.mutant.layer != "formula"]

    @property
    def reference_kill_rate(self) -> float:
        rows = self.reference_results
        return sum(r.killed for r in rows) / len(rows) if rows else 1.0

    def summary(self) -> str:
        ref = self.reference_results
        text = (f"{sum(r.killed for r in ref)}/{len(ref)} reference mutants killed "
                f"({100 * self.reference_kill_rate:.1f}%)")
        if len(ref) != len(self.results):
            formula = [r for r in self.results if r.mutant.layer == "formula"]
            text += f", {sum(r.killed for r in formula)}/{len(formula)} formula variants"
        text += f" by {', '.join(self.checks)} in {self.seconds:.1f}s"
        if self.skipped_checks:
            text += " (skipped: " + "; ".join(f"{k}: {v}" for k, v in self.skipped_checks.items()) + ")"
        return text

    def to_rows(self) -> list[dict[str, str]]:
        return [{"mutant": r.mutant.name, "kind": r.mutant.kind, "killed": "yes" if r.killed else "NO",
                 "by": r.killed_by or "-", "time": f"{r.seconds:.2f}s",
                 "reason": (r.reason or "")[:120]} for r in self.results]

    def to_markdown(self) -> str:
        lines = ["| mutant | kind | re-creates | killed by | reason |", "|---|---|---|---|---|"]
        for r in self.results:
            m = r.mutant
            why = (r.reason or "").replace("|", "\\|")[:110]
            lines.append(f"| `{m.name}` | {m.kind} | {m.vllm_bug or ''} | "
                         f"{r.killed_by if r.killed else '**survived**'} | {why} |")
        return "\n".join(lines)

    def render(self) -> str:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=self.summary())
        for col in ("mutant", "kind", "killed", "by", "time", "reason"):
            table.add_column(col)
        for row in self.to_rows():
            table.add_row(*row.values())
        console = Console(width=220, record=True, file=_Null())
        console.print(table)
        return console.export_text()


class _Null:
    def write(self, s: str) -> int:
        return len(s)

    def flush(self) -> None:
        pass


# ------------------------------------------------------------------------------ the checks' campaign forms


def spec_formulas_verdict(budget: int) -> str | None:
    from kvref.proofs.formulas import Formulas
    from kvref.proofs.ops import PyOps
    from kvref.spec.config import EngineConfig
    from kvref.spec.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        SlidingWindowSpec,
    )
    from kvref.spec.mathutil import cdiv

    f, o = Formulas(), PyOps()
    for a in range(0, 40):
        for b in range(1, 9):
            if cdiv(a, b) != o.cdiv(a, b):
                return f"cdiv({a}, {b}) = {cdiv(a, b)}, formulas say {o.cdiv(a, b)}"
    common = dict(num_kv_heads=1, head_size=1, dtype="float32")
    for bs in (1, 2, 4, 16):
        for M in (1, 7, 12, 64, 1000):
            for F in (0, 1, 4, 13, 64):
                for sw in (1, 2, 4, 6, 17):
                    for extra in (0, 3):
                        spec = SlidingWindowSpec(block_size=bs, sliding_window=sw, extra_retained_tokens=extra, **common)
                        got, want = spec.max_admission_blocks_per_request(F, M), f.swa_cap(o, sw, extra, bs, F, M)
                        if got != want:
                            return f"SWA cap(sw={sw}, extra={extra}, bs={bs}, F={F}, M={M}) = {got}, formulas say {want}"
                for chunk in (1, 4, 8, 24):
                    spec = ChunkedLocalAttentionSpec(block_size=bs, attention_chunk_size=chunk, **common)
                    got, want = spec.max_admission_blocks_per_request(F, M), f.cl_cap(o, chunk, bs, F, M)
                    if got != want:
                        return f"chunked cap(chunk={chunk}, bs={bs}, F={F}, M={M}) = {got}, formulas say {want}"
            fa = FullAttentionSpec(block_size=bs, **common)
            cfg = EngineConfig(max_model_len=M)
            got = fa.max_memory_usage_bytes(cfg) // fa.page_size_bytes
            want = f.full_pages(o, M, bs, 1)
            if got != want:
                return f"full-attention pages(M={M}, bs={bs}) = {got}, formulas say {want}"
    return None


def pool_machine_verdict(budget: int) -> str | None:
    from hypothesis import HealthCheck, Phase, settings
    from hypothesis.stateful import run_state_machine_as_test
    from kvref.models.hypothesis_runs.reproducible import same_inputs_in_every_process
    from kvref.models.machines.block_pool import make_block_pool_machine

    # no shrinking: the campaign needs a verdict, not a minimal example
    cfg = settings(max_examples=budget, stateful_step_count=30, derandomize=True, database=None,
                   deadline=None, print_blob=False, phases=[Phase.explicit, Phase.generate],
                   suppress_health_check=list(HealthCheck))
    for num_blocks in (6, 10):
        try:
            with same_inputs_in_every_process():
                run_state_machine_as_test(make_block_pool_machine("reference", num_blocks=num_blocks), settings=cfg)
        except Exception as e:  # noqa: BLE001 - any failure of the machine kills
            return _first_line(e)
    return None


def manager_machine_verdict(budget: int) -> str | None:
    from kvref.models.machines.single_type_manager import run_manager_machines

    return run_manager_machines(budget)


def manager_vllm_verdict(budget: int) -> str | None:
    from kvref.models.machines.single_type_manager import run_manager_machines

    return run_manager_machines(max(10, budget // 2), ("reference", "vllm"))


def scheduler_machine_verdict(budget: int) -> str | None:
    from kvref.models.machines.scheduler import run_scheduler_machine

    run = run_scheduler_machine(with_vllm=False, examples=budget, reproducible=True, shrink=False)
    return None if run.ok else _first_lines(run.failure)


def scheduler_vllm_verdict(budget: int) -> str | None:
    from kvref.models.machines.scheduler import run_scheduler_machine

    run = run_scheduler_machine(with_vllm=True, examples=budget, reproducible=True, shrink=False)
    return None if run.ok else _first_lines(run.failure)


def explorer_verdict(budget: int) -> str | None:
    from kvref.models.explorer.kv import campaign_scopes, explore_scope

    for scope in campaign_scopes():
        res = explore_scope(scope, max_states=budget * 2000)
        if res.findings:
            f = res.findings[0]
            return f"{scope.name}: {f.kind} after {f.trace.length} steps: {f.message}"
    try:
        from kvref.models.explorer.simple_cpu import OFFLOAD_SCOPES, explore_offload
    except ImportError:  # the offload reference is not in this checkout
        return None
    scope = OFFLOAD_SCOPES["offload"]
    res = explore_offload(scope, max_states=budget * 2000)
    if res.findings:
        f = res.findings[0]
        return f"{scope.name}: {f.kind} after {f.trace.length} steps: {f.message}"
    return None


def proofs_verdict(budget: int) -> str | None:
    """The Z3 theorems over the formula source. Run once on the clean reference (baseline) only
    (``per_mutant=False`` in the registry): the theorems are about :mod:`kvref.proofs.formulas`,
    which a runtime patch of the reference does not change; what ties the reference to the proven
    formulas is ``spec-formulas``."""
    from kvref.proofs.api import run_all

    failed = [r for r in run_all() if not r.ok]
    if failed:
        return f"theorem {failed[0].theorem} not proved: {failed[0].status}"
    return None


def run_proof_variants() -> list["MutantResult"]:
    """The proofs' own historic (and deliberately broken) formula variants, as campaign rows:
    each is killed when the theorem it breaks yields a counterexample."""
    from kvref.models.mutants.mutant import CLASSIC, HISTORIC
    from kvref.proofs.api import run_all
    from kvref.proofs.variants import VARIANTS

    rows = []
    for v in VARIANTS:
        t0 = time.perf_counter()
        results = run_all(variant=v.name)
        bad = [r for r in results if not r.ok]
        m = Mutant(f"formula.{v.name}", v.summary, f"kvref.proofs.variants:{type(v.formulas).__name__}",
                   lambda f: f, HISTORIC if v.kind == "historic" else CLASSIC, ", ".join(v.refs) or None,
                   "formula")
        why = f"theorem {bad[0].theorem}: {bad[0].status}" if bad else None
        rows.append(MutantResult(m, bool(bad), "proofs" if bad else None, why, time.perf_counter() - t0))
    return rows


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _first_lines(text: str, n: int = 2) -> str:
    """A multi-line failure (a divergence names both targets on two lines) as one line."""
    return " / ".join(line.strip() for line in text.strip().splitlines()[:n])


def run_campaign(mutants: list[Mutant] | None, checks: Sequence[Any],
                 verdict: Callable[[Any, int], str | None], budget: int = 100, all_checks: bool = False,
                 subset: str = "all", proof_variants: bool = False,
                 progress: Callable[[MutantResult], None] | None = None,
                 skipped: dict[str, str] | None = None, started: float | None = None) -> CampaignResult:
    """Run ``checks`` (in order; each with ``name``, ``blind_to`` and ``per_mutant``, as
    :class:`kvref.check_context.Check`) against each mutant, ``verdict(check, budget)`` deciding.

    Args:
        mutants: which mutants (None: every catalogue mutant whose target exists, or with
            ``subset="ci"`` one per fault family, :data:`~kvref.models.mutants.catalogue.CI_SUBSET`).
        verdict: runs one check; None when it passed, else why it failed (the mutant is killed).
        budget: examples per machine run; the explorer gets at most ``2000 × budget`` states.
        all_checks: run every check on every mutant instead of stopping at the first kill.
        progress: called with each mutant's result as it finishes.
        proof_variants: also add the proofs' formula variants (:func:`run_proof_variants`) as rows
            of kind ``formula`` (reported separately: :attr:`CampaignResult.reference_kill_rate`).
        skipped: checks asked for but not available here, with the reason (reported as such).

    Returns:
        A :class:`CampaignResult` (``baseline_failures`` non-empty means the clean reference
        failed a check, and no mutant was run).
    """
    from kvref.models.mutants.catalogue import CI_SUBSET, all_mutants

    t0 = time.perf_counter() if started is None else started
    skipped = dict(skipped or {})
    names = [c.name for c in checks]
    if subset not in ("all", "ci"):
        raise InvalidFieldError("subset", subset, "'all' or 'ci'")
    if mutants is None:
        mutants = [m for m in all_mutants() if subset == "all" or m.name in CI_SUBSET]
    baseline = {}
    for c in checks:
        why = verdict(c, budget)
        if why is not None:
            baseline[c.name] = why
    if baseline:
        return CampaignResult([], names, baseline, time.perf_counter() - t0, skipped)
    results = []
    per_mutant = [c for c in checks if c.per_mutant]  # the proofs run on the baseline only
    for m in mutants:
        t1 = time.perf_counter()
        res = MutantResult(m, False)
        with m.applied():
            for c in per_mutant:
                if m.layer in c.blind_to:
                    continue  # the check never runs this layer's code: it cannot kill the mutant
                try:
                    why = verdict(c, budget)
                except Exception as e:  # noqa: BLE001 - a check that crashes under a mutant kills it
                    why = f"check crashed: {_first_line(e)}"
                res.per_check[c.name] = why
                if why is not None and not res.killed:
                    res.killed, res.killed_by, res.reason = True, c.name, why
                    if not all_checks:
                        break
        res.seconds = time.perf_counter() - t1
        results.append(res)
        if progress is not None:
            progress(res)
    if proof_variants:
        for res in run_proof_variants():
            results.append(res)
            if progress is not None:
                progress(res)
    return CampaignResult(results, names, {}, time.perf_counter() - t0, skipped)
