"""``conform-offload``'s SimpleCPU look-up edges (#22): between a trace's operations a waiting
request is probed on the reference and on vLLM's ``SimpleCPUOffloadScheduler`` alike — a CPU hit
declined by the scheduler, a local prefix ending inside a block or covering every full block, a
request that reads no prefix cache, external tokens without a pending hit, a retried look-up —
and every answer and the whole observed state are compared
(:mod:`kvref.models.offload.simple_cpu_lookup_edges`)."""

from __future__ import annotations

from dataclasses import replace

from .check_context import VerifyContext
from .report import FAILED, CheckResult


def with_lookup_edges(ctx: VerifyContext, result: CheckResult) -> CheckResult:
    """``result`` (conform-offload's, passed) extended by the look-up edge probes, or the failure
    they found."""
    from kvref.models.offload.simple_cpu_lookup_edges import run_lookup_edge_cases
    from kvref.models.offload.world_common import OffloadInvariantError

    try:
        stats = run_lookup_edge_cases(ctx.seed, ctx.examples(20, 120))
    except (AssertionError, OffloadInvariantError) as exc:
        return CheckResult(result.name, FAILED, "vLLM's SimpleCPU look-up / allocation hand-off diverged from the "
                           "reference", details=[f"{type(exc).__name__}: {exc}"[:1500]],
                           signature=f"{result.name}: SimpleCPU look-up edges {type(exc).__name__}")
    return replace(result, summary=f"{result.summary}; {stats['probes']} SimpleCPU look-up edge probes over "
                   f"{stats['traces']} traces ({stats['hits_declined']} CPU hits declined, "
                   f"{stats['unissued_loads']} loads dropped before issue) agree",
                   examined=result.examined + stats["ops"])
