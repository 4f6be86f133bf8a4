"""``kvref verify``'s ``conform-p2p`` check: vLLM's P2P secondary offload tier (two engines, real
ZMQ on loopback, the in-memory data plane) in lock step with the reference world
(:mod:`kvref.models.machines.p2p`, issue #22)."""

from __future__ import annotations

from .check_context import VerifyContext, vllm_gate
from .report import FAILED, PASSED, CheckResult


def check_p2p_conformance(ctx: VerifyContext) -> CheckResult:
    """Stores, fetches, timeouts, aborts, finishes, failed writes, data-plane faults and reconnect
    backoff, refused WRITEs and handshakes, malformed requests, a third engine at the peer limit and
    an engine going away: results, bookkeeping, every control message and both buffers after every
    step; then the tier's options (parked-store timeout, back-pressure) built or refused as vLLM does."""
    name = "conform-p2p"
    skipped = vllm_gate(ctx, name)
    if skipped:
        return skipped
    from kvref.impl.vllm.native_agents import native_agents_released
    from kvref.models.machines.p2p import COVERAGE, run_p2p_config_cases, run_p2p_machine

    examples = ctx.examples(20, 300)
    before = COVERAGE.bytes_checked
    # the worlds' NIXL agents are destroyed when the check ends: their UCX threads would poll with a
    # zero timeout for the rest of the verify run (#22/#26)
    with native_agents_released():
        ok, failure, sig = run_p2p_machine(with_vllm=True, examples=examples, shrink=ctx.shrink, seed=ctx.seed)
        if not ok:
            return CheckResult(name, FAILED, "P2P tier traces diverged from vLLM", details=failure.splitlines()[:30],
                               signature=sig)
        options = ctx.examples(4, 20)
        ok, failure = run_p2p_config_cases(options, seed=ctx.seed)
    if not ok:
        return CheckResult(name, FAILED, "P2P tier options resolved differently from vLLM", details=[failure],
                           signature="p2p:tier options")
    return CheckResult(name, PASSED, f"{examples} two-engine traces agree ({COVERAGE.bytes_checked - before} "
                       f"loaded blocks checked byte for byte), and {options} generated tier options",
                       examined=examples + options)
