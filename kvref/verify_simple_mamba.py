"""``conform-offload``'s SimpleCPU part on Mamba "align" pools (#22): vLLM's SimpleCPU connector
over FA + Mamba "align" GPU pools with fine-grained hashes, against the reference, after every
operation (:mod:`kvref.models.offload.simple_cpu_mamba_world`): the boundary-state hand-offs the
KV cache manager gives the connector each step, the full-attention partial tail stored at finish,
sub-block hits with copy-on-write, loads of Mamba states back from the CPU."""

from __future__ import annotations

from dataclasses import replace

from .check_context import VerifyContext
from .report import FAILED, CheckResult


def with_simple_mamba(ctx: VerifyContext, result: CheckResult) -> CheckResult:
    """``result`` (conform-offload's, passed) extended by the Mamba-align SimpleCPU traces, or the
    failure they found."""
    from kvref.models.offload.simple_cpu_mamba_world import (
        MAMBA_COVERAGE,
        run_simple_mamba_traces,
        simple_mamba_cases,
    )
    from kvref.models.offload.world_common import OffloadInvariantError

    MAMBA_COVERAGE.clear()
    try:
        stats = run_simple_mamba_traces(simple_mamba_cases(ctx.seed, ctx.examples(12, 120)))
    except (AssertionError, OffloadInvariantError) as exc:
        return CheckResult(result.name, FAILED, "vLLM's SimpleCPU connector on a Mamba 'align' pool diverged "
                           "from the reference", details=[f"{type(exc).__name__}: {exc}"[:1500]],
                           signature=f"{result.name}: SimpleCPU Mamba {type(exc).__name__}")
    c = MAMBA_COVERAGE
    result = replace(result, summary=f"{result.summary}; {stats['traces']} SimpleCPU traces on FA + Mamba 'align' "
                     f"pools ({stats['ops']} ops: {c['handoffs']} boundary hand-offs, {c['odd_handoffs']} odd ones, "
                     f"{c['finish_flush']} finish-time flushes, {c['copies']} copy-on-write pairs, {c['cpu_load']} "
                     "CPU loads) agree", examined=result.examined + stats["ops"])
    from .verify_simple_edges import with_lookup_edges  # then the look-up / hand-off edges (#22)

    return with_lookup_edges(ctx, result)
