"""``conform-offload``'s sparse-retention part (#22): vLLM's OffloadingConnector under
``prefix_cache_retention_interval`` against the reference (:mod:`kvref.models.offload.offloading_retention`):
``SchedulerOffloadConfig.from_spec``'s refusals of generated connector configurations, then
FA + sliding-window pools with an interval on shared-prefix traces, compared after every
operation (stores masked to the retained tails at the replay boundary, the shared-prefix
junction and the interval's segments); then pools with an EAGLE/MTP drafter group
(:func:`with_eagle`)."""

from __future__ import annotations

import random
from dataclasses import replace

from .check_context import VerifyContext
from .report import FAILED, CheckResult


def connector_divergence(result: CheckResult, where: str, signature: str, exc: Exception) -> CheckResult:
    """conform-offload's failed row for a divergence one of its OffloadingConnector sub-runs found
    (``where``: the pools it ran on, in the message; ``signature``: what the finding is grouped by)."""
    return CheckResult(result.name, FAILED, f"vLLM's OffloadingConnector diverged from the reference {where}",
                       details=[str(exc)[:1500]], signature=f"{result.name}: OffloadingConnector {signature}")


def with_retention(ctx: VerifyContext, result: CheckResult) -> CheckResult:
    """``result`` (conform-offload's, passed) extended by the retention refusals and traces, or the
    failure they found."""
    from kvref.models.offload.offloading_retention import (
        COVERAGE,
        compare_refusals,
        retention_cases,
        retention_refusal_cases,
        run_retention_traces,
    )
    from kvref.models.offload.world_common import OffloadInvariantError

    COVERAGE.clear()
    try:
        refusals = compare_refusals(retention_refusal_cases(random.Random(f"offload-retention-refusals-{ctx.seed}"),
                                                            ctx.examples(12, 60)))
        stats = run_retention_traces(retention_cases(ctx.seed, ctx.examples(4, 40)))
    except OffloadInvariantError as exc:
        return connector_divergence(result, "under a prefix-cache retention interval", "retention interval", exc)
    c = COVERAGE
    result = replace(result, summary=f"{result.summary}; {refusals['configs']} retention-interval connector configs "
                     f"({refusals['refused']} refused) and {stats['traces']} traces under an interval ({stats['ops']} "
                     f"ops, {c['junctions']} shared-prefix junctions, {c['swa_stores']} sliding-window stores) agree",
                     examined=result.examined + refusals["configs"] + stats["ops"])
    return with_eagle(ctx, result)


def with_eagle(ctx: VerifyContext, result: CheckResult) -> CheckResult:
    """``result`` extended by the traces on pools with an EAGLE/MTP drafter group
    (:mod:`kvref.models.offload.offloading_eagle`), or the failure they found."""
    from kvref.models.offload.offloading_eagle import COVERAGE, eagle_cases, run_eagle_traces
    from kvref.models.offload.world_common import OffloadInvariantError

    COVERAGE.clear()
    try:
        stats = run_eagle_traces(eagle_cases(ctx.seed, ctx.examples(6, 60)))
    except OffloadInvariantError as exc:
        return connector_divergence(result, "on a pool with an EAGLE drafter group", "EAGLE group", exc)
    c = COVERAGE
    return replace(result, summary=f"{result.summary}; {stats['traces']} traces with an EAGLE drafter group "
                   f"({stats['ops']} ops, {c['eagle_loads']} loads and {c['eagle_stores']} stores of its chunks) agree",
                   examined=result.examined + stats["ops"])
