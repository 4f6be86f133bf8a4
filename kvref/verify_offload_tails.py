"""``conform-offload``'s partial-tail part (#22): vLLM's OffloadingConnector on full-attention +
Mamba "align" pools with request hashes finer than the blocks, against the reference after every
operation (:mod:`kvref.models.offload.offloading_partial_tails`): partial-tail stores (the COW-ed
state and the attention block holding the boundary, fenced at once), lookups past the complete
chunks with the bridge chunk, loads of the tail, and their self-describing KV events."""

from __future__ import annotations

from dataclasses import replace

from .check_context import VerifyContext
from .report import CheckResult
from .verify_offload_retention import connector_divergence, with_retention


def with_partial_tails(ctx: VerifyContext, result: CheckResult) -> CheckResult:
    """``result`` (conform-offload's, passed) extended by the partial-tail traces, or the failure
    they found; then by the retention-interval part (:mod:`.verify_offload_retention`)."""
    from kvref.models.offload.offloading_partial_tails import COVERAGE, partial_tail_cases, run_partial_tail_traces
    from kvref.models.offload.world_common import OffloadInvariantError

    COVERAGE.clear()
    try:
        stats = run_partial_tail_traces(partial_tail_cases(ctx.seed, ctx.examples(8, 80)))
    except OffloadInvariantError as exc:
        return connector_divergence(result, "on a pool with partial tails", "partial tails", exc)
    c = COVERAGE
    result = replace(result, summary=f"{result.summary}; {stats['traces']} OffloadingConnector traces with partial "
                     f"tails ({stats['ops']} ops: {c['tail_stores']} partial-tail stores, {c['tail_flushes']} "
                     f"flushed, {c['tail_loads']} loaded) agree", examined=result.examined + stats["ops"])
    return with_retention(ctx, result)
