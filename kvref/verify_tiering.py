"""``kvref verify``'s ``conform-tiering`` check: vLLM's multi-tier offloading
(``TieringOffloadingManager`` with real fs and example secondary tiers, built through
``TieringOffloadingSpec``) against kvref's reference on generated traces, every observable compared
after every operation (:mod:`kvref.models.machines.tiering`, issue #22); and vLLM's back-pressure
detector and policies against the reference's on generated completion-time programs
(:mod:`kvref.models.machines.tiering_backpressure`); and vLLM's tier-poll thread, pass by pass,
against the reference's loop (:mod:`kvref.models.machines.tiering_poll_loop`); and generated spec
configs (tiers, back-pressure resolution, refusals) through vLLM's front door
(:mod:`kvref.models.machines.tiering_spec_config`); and generated worker layer references through
``create_worker``'s canonical-layout rule (:mod:`kvref.models.machines.tiering_canonical_refs`)."""

from __future__ import annotations

from .check_context import VerifyContext, vllm_gate
from .report import FAILED, PASSED, CheckResult

NAME = "conform-tiering"


def check_tiering_conformance(ctx: VerifyContext) -> CheckResult:
    skipped = vllm_gate(ctx, NAME)
    if skipped:
        return skipped
    from kvref.impl.vllm.native_agents import native_agents_released
    from kvref.impl.vllm.tiering import TierTimeout
    from kvref.models.machines.tiering import TieringDivergence, run_traces
    from kvref.models.machines.tiering_backpressure import BackpressureDivergence, run_programs
    from kvref.models.machines.tiering_canonical_refs import CanonicalRefsDivergence, run_worker_cases
    from kvref.models.machines.tiering_config import ConfigDivergence, run_config_cases
    from kvref.models.machines.tiering_poll_loop import PollLoopDivergence
    from kvref.models.machines.tiering_poll_loop import run_programs as run_poll_programs
    from kvref.models.machines.tiering_spec_config import SpecConfigDivergence, run_spec_cases

    n = ctx.examples(8, 60)  # 8: three draw the KVCR, polled and obj tiers, five any layout
    try:
        # what KVCR start-ups and traces left running is destroyed when the check ends (#22/#26)
        with native_agents_released():
            stats = run_traces(ctx.seed, n)
            stats.update(run_config_cases(ctx.seed, ctx.examples(12, 48)))  # fast: one per tiering_config.FAMILIES
            stats.update(run_programs(ctx.seed, ctx.examples(60, 300)))  # ~0.1 s per 60 programs
            stats.update(run_poll_programs(ctx.seed, ctx.examples(30, 150)))  # ~1 s per 30 programs
            stats.update(run_spec_cases(ctx.seed, ctx.examples(120, 400)))  # ~0.3 s per 120 configs
            stats.update(run_worker_cases(ctx.seed, ctx.examples(60, 200)))  # ~0.2 s per 100 cases
    except (TieringDivergence, TierTimeout, ConfigDivergence, BackpressureDivergence, PollLoopDivergence,
            SpecConfigDivergence, CanonicalRefsDivergence) as exc:
        text = f"{type(exc).__name__}: {exc}"
        return CheckResult(NAME, FAILED, "vLLM's tiering manager diverged from the reference",
                           details=[text[:2000]], signature=f"{NAME}: {str(exc).split(':')[0][:80]}")
    return CheckResult(NAME, PASSED,
                       f"{stats['traces']} tiering traces ({stats['ops']} ops, {stats['retries']} RETRY answers, "
                       f"{stats['promotions']} HIT_PENDING answers, {stats['io_errors']} injected I/O errors, "
                       f"{stats['kvcr_traces']} traces with a KVCR tier, {stats['kvcr_copy_failures']} failed KVCR "
                       f"copies, {stats['poll_rounds']} tier-poll rounds, {stats['peer_pins']} peer pins; {stats['configs']} "
                       f"KVCR configs, {stats['configs_refused']} refused as the reference says; {stats['bp_programs']} back-pressure "
                       f"programs, {stats['bp_ops']} ops; {stats['poll_programs']} tier-poll thread programs, "
                       f"{stats['poll_ops']} ops; {stats['spec_configs']} spec configs, {stats.get('spec_configs_refused', 0)} "
                       f"refused as the reference says; {stats['worker_cases']} worker layer-ref sets, "
                       f"{stats['worker_refused']} refused for canonical layout as the reference says) on vLLM's TieringOffloadingManager with fs/obj/example/kvcr tiers: answers, chunks, jobs, probes, back-pressure, "
                       "events, metrics and bytes agree with the reference", examined=stats["ops"] + stats["bp_ops"] + stats["poll_ops"])
