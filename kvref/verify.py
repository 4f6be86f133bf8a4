"""The checks ``kvref verify`` runs, in order, and how each is decided.

Each check is a function ``(VerifyContext) -> CheckResult``. Checks import what they need lazily,
so ``kvref verify --only proofs`` does not pay for torch or vLLM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from .report import FAILED, PASSED, SKIPPED, UNKNOWN, CheckResult


@dataclass
class VerifyContext:
    profile: str = "fast"
    against: str | None = None
    device: str | None = None
    out_dir: str = "counterexamples"
    seed: int = 0

    def examples(self, fast: int, ci: int, nightly: int | None = None) -> int:
        """Example/trace budget for the active profile."""
        if self.profile == "nightly":
            return nightly if nightly is not None else ci * 100
        return ci if self.profile == "ci" else fast

    def ensure_out_dir(self) -> str:
        os.makedirs(self.out_dir, exist_ok=True)
        return self.out_dir


@dataclass(frozen=True)
class Check:
    name: str
    description: str
    run: Callable[[VerifyContext], CheckResult]
    default: bool = True


def vllm_available() -> tuple[bool, str]:
    """Whether vLLM 0.33.0 imports here (and why not)."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm
    except Exception as exc:
        return False, f"vLLM not importable: {exc!r}"
    from . import VLLM_VERSION

    if vllm.__version__ != VLLM_VERSION:
        return False, f"vLLM {vllm.__version__} installed; kvref models {VLLM_VERSION}"
    return True, f"vLLM {vllm.__version__}"


def _skip_or_fail_without_vllm(ctx: VerifyContext, name: str) -> CheckResult | None:
    ok, why = vllm_available()
    if ok:
        return None
    if ctx.against == "vllm":
        return CheckResult(name, FAILED, f"--against vllm given but {why}")
    return CheckResult(name, SKIPPED, why + " (install vLLM 0.33.0 to run conformance)")


# --------------------------------------------------------------------------------------------
# spec: the documented vLLM figures, evaluated through kvref.spec


def check_spec_examples(ctx: VerifyContext) -> CheckResult:
    """vLLM's own documented numbers (tests and docstrings of 0.33.0) through kvref.spec."""
    from kvref.spec import ChunkedLocalAttentionSpec, EngineConfig, SlidingWindowSpec

    failures = []
    swa = SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=64, dtype="float16", sliding_window=1024)
    for batches, want in ((1, 129), (2, 193)):
        got = swa.max_admission_blocks_per_request(batches * 1024, 1 << 20)
        if got != want:
            failures.append(f"SWA window 1024, bs 16, {batches}x1024 in flight: cap {got}, vLLM says {want}")
    cl = ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype="float16",
                                   attention_chunk_size=1024)
    cfg = EngineConfig(max_model_len=1 << 20, max_num_batched_tokens=1024, max_concurrent_batches=2)
    if cl.max_memory_usage_blocks(cfg) != 192:
        failures.append(f"chunked-local 1024 + 2x1024 in flight: {cl.max_memory_usage_blocks(cfg)} blocks, vLLM says 192")
    small = SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float32", sliding_window=6)
    if small.max_admission_blocks_per_request(0, 100) != 3:
        failures.append("window 6 at block size 4 must need cdiv(5,4)+1 = 3 blocks")
    if failures:
        return CheckResult("spec", FAILED, f"{len(failures)} documented figure(s) differ", details=failures)
    return CheckResult("spec", PASSED, "documented vLLM figures reproduced (admission caps, memory bounds)")


def check_startup_liveness(ctx: VerifyContext) -> CheckResult:
    """One request of any length up to max_model_len is served by the smallest pool startup accepts.

    Runs on every implementation present: the reference, and the installed vLLM (whose own spec
    formulas then size the pool — the #39734/#35541 family of bugs shows up here).
    """
    from kvref.models.startup_liveness import check_startup_liveness as run

    kinds = ["reference"]
    ok, why = vllm_available()
    if ok:
        kinds.append("vllm")
    elif ctx.against == "vllm":
        return CheckResult("startup-liveness", FAILED, f"--against vllm given but {why}")
    n = ctx.examples(60, 300)
    details, failed = [], 0
    for kind in kinds:
        ran, failures = run(kind, n, seed=ctx.seed)
        failed += len(failures)
        details += [f"{kind}: {f.render()}" for f in failures[:5]]
    summary = f"{n} random configs x {'+'.join(kinds)}"
    if not ok:
        summary += f" (vLLM skipped: {why})"
    if failed:
        return CheckResult("startup-liveness", FAILED, f"{failed} case(s) where startup accepted but runtime did not serve",
                           details=details)
    return CheckResult("startup-liveness", PASSED, summary + ": every max-length request admitted and served")


def run_generated(test, examples: int, seed: int) -> str | None:
    """Run a Hypothesis ``@given`` function with a budget and a seed; return the failure text or None.

    Hypothesis shrinks a failing example before it re-raises, so the text names a minimal case.
    """
    from hypothesis import HealthCheck, seed as hseed, settings

    configured = hseed(seed)(settings(max_examples=examples, deadline=None, database=None,
                                      suppress_health_check=list(HealthCheck), print_blob=True)(test))
    try:
        configured()
    except AssertionError as exc:
        return str(exc)
    return None


def check_planning_conformance(ctx: VerifyContext) -> CheckResult:
    """kvref's startup planning vs the installed vLLM's, on generated layer sets and settings."""
    skipped = _skip_or_fail_without_vllm(ctx, "conform-planning")
    if skipped:
        return skipped
    from hypothesis import given

    from kvref.impl.vllm_planning import VllmPlanner, kvref_outcome
    from kvref.models.planning_strategies import plan_cases

    planner = VllmPlanner()
    n = ctx.examples(150, 1000)

    @given(case=plan_cases())
    def agree(case):
        theirs = planner.plan(case.layers, case.config, case.available_memory, case.extra_retained_tokens)
        ours = kvref_outcome(planner, case.layers, case.config, case.available_memory)
        assert ours.key() == theirs.key(), f"accept/reject: kvref {ours.key()} vs vLLM {theirs.key()}\n{case}"
        for name, want in theirs.fields.items():
            assert ours.fields[name] == want, f"{name}: kvref {ours.fields[name]!r} != vLLM {want!r}\n{case}"

    failure = run_generated(agree, n, ctx.seed)
    if failure:
        return CheckResult("conform-planning", FAILED, "kvref and vLLM plan a pool differently",
                           details=failure.splitlines()[:20])
    return CheckResult("conform-planning", PASSED, f"{n} generated layer sets/settings: identical plans and verdicts")


def check_proofs(ctx: VerifyContext) -> CheckResult:
    """Z3 theorems T1-T8 proved over unbounded ints; every historic variant refuted with a reproducer."""
    from kvref.cli_prove import verify_check

    return verify_check(ctx)


def _crosshair_result(report) -> CheckResult:
    from kvref.proofs.crosshair_run import CONFIRMED, NOT_ANALYSED, NOT_REFUTED, REFUTED

    counts = {s: sum(c.status == s for c in report.conditions) for s in (CONFIRMED, NOT_REFUTED, REFUTED, NOT_ANALYSED)}
    details = [f"{c.function}: {c.condition} -> {c.status}" + (f" ({c.message})" if c.status != CONFIRMED else "")
               for c in report.conditions]
    summary = (f"{len(report.conditions)} conditions: {counts[CONFIRMED]} confirmed on all paths, "
               f"{counts[NOT_REFUTED]} not refuted within budget, {counts[REFUTED]} refuted, "
               f"{counts[NOT_ANALYSED]} not analysed")
    if counts[REFUTED]:
        return CheckResult("crosshair", FAILED, summary, details=details)
    if counts[NOT_ANALYSED]:
        return CheckResult("crosshair", UNKNOWN, summary + " (CrossHair could not analyse some)", details=details)
    return CheckResult("crosshair", PASSED, summary, details=details)


def check_crosshair(ctx: VerifyContext) -> CheckResult:
    """CrossHair contracts on the spec functions and the block pool, within a fixed budget."""
    from kvref.proofs import run_contracts

    return _crosshair_result(run_contracts(per_condition_timeout=2.0 if ctx.profile == "fast" else 5.0))


CHECKS: list[Check] = [
    Check("spec", "vLLM's documented sizing figures through kvref.spec", check_spec_examples),
    Check("startup-liveness", "startup-accepted pools serve a max-length request (reference, vLLM)",
          check_startup_liveness),
    Check("proofs", "Z3 theorems over unbounded ints + historic vLLM bugs re-found", check_proofs),
    Check("crosshair", "CrossHair contracts on spec functions and block pool operations", check_crosshair),
    Check("conform-planning", "startup pool sizing vs the installed vLLM on generated configs",
          check_planning_conformance),
]


def select_checks(only=None, skip=(), mutants=False, against=None) -> list[Check]:
    chosen = [c for c in CHECKS if (c.name in only if only else c.default)]
    if mutants and not only:
        chosen += [c for c in CHECKS if c.name == "mutants" and c not in chosen]
    return [c for c in chosen if c.name not in skip]
