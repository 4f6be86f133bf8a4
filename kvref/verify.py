"""The bodies of ``kvref verify``'s checks, and :func:`run_check`, which runs one.

Each body is a function ``(VerifyContext) -> CheckResult``; which checks exist, in which order,
and which the mutant campaigns select is :data:`kvref.checks.CHECKS` (the one registry). Bodies
import what they need lazily, so ``kvref verify --only proofs`` does not pay for torch or vLLM.
The explorer checks' bodies are in :mod:`kvref.cli.explore`, beside the explorer's command.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from .check_context import Check, VerifyContext, vllm_available, vllm_gate  # noqa: F401  (re-exported)
from .cli.explore import check_explorer, check_explorer_conformance  # noqa: F401  (bodies of explorer, conform-explorer)
from .report import ACCEPTED, ERROR, FAILED, PASSED, SKIPPED, UNKNOWN, CheckResult


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
    return CheckResult("spec", PASSED, "documented vLLM figures reproduced (admission caps, memory bounds)",
                       examined=4)


def check_startup_liveness(ctx: VerifyContext) -> CheckResult:
    """One request of any length up to max_model_len is served by the smallest pool startup accepts.

    Runs on every implementation present: the reference, and the installed vLLM (whose own spec
    formulas then size the pool — the #39734/#35541 family of bugs shows up here).
    """
    from kvref.models.conformance.startup_liveness import check_startup_liveness as run

    kinds = ["reference"]
    ok, why = vllm_available()
    gate = vllm_gate(ctx, "startup-liveness")
    if gate is None:
        kinds.append("vllm")
    elif gate.status != SKIPPED:
        return gate
    n = ctx.examples(60, 300)
    details, failed = [], 0
    examined = 0
    for kind in kinds:
        ran, failures = run(kind, n, seed=ctx.seed)
        examined += ran
        failed += len(failures)
        details += [f"{kind}: {f.render()}" for f in failures[:5]]
    summary = f"{n} random configs x {'+'.join(kinds)}"
    if not ok:
        summary += f" (vLLM skipped: {why})"
    if failed:
        return CheckResult("startup-liveness", FAILED, f"{failed} case(s) where startup accepted but runtime did not serve",
                           details=details)
    return CheckResult("startup-liveness", PASSED, summary + ": every max-length request admitted and served",
                       examined=examined)


def run_generated(test, examples: int, seed: int) -> str | None:
    """Run a Hypothesis ``@given`` function with a budget and a seed; return the failure text or None.

    Hypothesis shrinks a failing example before it re-raises, so the text names a minimal case.
    """
    from hypothesis import HealthCheck, seed as hseed, settings

    configured = hseed(seed)(settings(max_examples=examples, deadline=None, database=None,
                                      suppress_health_check=list(HealthCheck), print_blob=True,
                                      report_multiple_bugs=False)(test))
    try:
        configured()
    except AssertionError as exc:
        return str(exc)
    except BaseExceptionGroup as group:  # several distinct failures (a Hypothesis that ignores the setting)
        mismatches, others = group.split(AssertionError)
        if mismatches is None:
            raise
        leaves = [str(e) for e in _leaves(mismatches)]
        extra = [f"(and {len(_leaves(others))} other distinct error(s): {_leaves(others)[0]!r})"] if others else []
        return "\n".join(leaves[:1] + extra)
    return None



def run_generated_accepting(body, strategies: dict, signature, examples: int, seed: int) -> str | None:
    """:func:`run_generated` for a comparison whose differences a baseline may accept
    (``kvref verify --baseline``): ``body(**drawn)`` runs under ``@given(**strategies)``; an
    AssertionError whose ``signature(text)`` the baseline accepts discards that example and the search
    goes on. None when nothing failed, or every example met an accepted difference."""
    from hypothesis import given, reject
    from hypothesis.errors import Unsatisfiable

    from kvref.models.conformance import accepted

    def agree(**drawn):
        try:
            body(**drawn)
        except AssertionError as exc:
            if accepted.is_accepted(signature(str(exc))):
                reject()
            raise

    try:
        return run_generated(given(**strategies)(agree), examples, seed)
    except Unsatisfiable:  # every example met a difference the baseline accepts
        return None


def _leaves(group: BaseException) -> list[BaseException]:
    if isinstance(group, BaseExceptionGroup):
        return [leaf for e in group.exceptions for leaf in _leaves(e)]
    return [group]


def check_planning_conformance(ctx: VerifyContext) -> CheckResult:
    """kvref's startup planning vs the installed vLLM's, on generated layer sets and settings."""
    skipped = vllm_gate(ctx, "conform-planning")
    if skipped:
        return skipped
    from hypothesis import given

    from kvref.impl.vllm.planning import VllmPlanner, kvref_outcome, kvref_per_layer_outcome, outcome_divergence
    from kvref.models.strategies.planning import FAMILIES, plan_cases

    planner = VllmPlanner()
    n = ctx.examples(150, 1000)
    ran = [0]

    def agree(case):
        ran[0] += 1
        theirs = planner.plan(case.layers, case.config, case.available_memory, case.extra_retained_tokens,
                              case.kv_cache_layout)
        ours = kvref_outcome(planner, case.layers, case.config, case.available_memory, case.kv_cache_layout)
        # verdict, then every field, the planned KV tensors by index and field (#22)
        diff = outcome_divergence(ours, theirs)
        assert diff is None, f"{diff}\n{case}"
        # vLLM's public per-layer check_enough_kv_cache_memory on the same layers and memory
        theirs = planner.check_per_layer(case.layers, case.config, case.available_memory, case.kv_cache_layout)
        ours = kvref_per_layer_outcome(case.layers, case.config, case.available_memory, case.kv_cache_layout)
        assert ours.key() == theirs.key(), f"per-layer check: kvref {ours.key()} vs vLLM {theirs.key()}\n{case}"

    failure = run_generated(given(case=plan_cases())(agree), n, ctx.seed)
    # then every layer family alone (#22): a short run meets some families a handful of times, so
    # packing, the MLA + sliding-window fallback or hidden-state alignment ran in one run, not the next
    for family in FAMILIES:
        failure = failure or run_generated(given(case=plan_cases(family))(agree), ctx.examples(20, 60), ctx.seed)
    # MLA + sliding window whose pages cannot be unified: vLLM's full-allocation fallback and what declines it
    from kvref.models.strategies.planning import fallback_cases

    failure = failure or run_generated(given(case=fallback_cases())(agree), ctx.examples(10, 40), ctx.seed)
    # HiSparse's startup layout (#22/#23): vLLM's layout.py groups and host pool vs kvref.spec.hisparse_layout
    from kvref.models.conformance.hisparse_layout import agree_layout, layout_cases

    def agree_hisparse(case):
        ran[0] += 1
        agree_layout(case)

    failure = failure or run_generated(given(case=layout_cases())(agree_hisparse), ctx.examples(40, 200), ctx.seed)
    # a first group vLLM's HiSparse partition refuses: two block sizes, a DeepSeek-V4 layer, a non-MLA layer
    from kvref.models.conformance.hisparse_layout import flawed_layout_cases

    failure = failure or run_generated(given(case=flawed_layout_cases())(agree_hisparse), ctx.examples(10, 40),
                                       ctx.seed)
    # HiSparse's whole startup sizing (#22/#23): pools, tensors, auto-fit, capacity and steady-state concurrency
    from kvref.models.conformance.planning_hisparse import agree_hisparse_plan, hisparse_plan_families

    def agree_hisparse_sizing(case):
        ran[0] += 1
        agree_hisparse_plan(planner, case)

    for cases, n in hisparse_plan_families(ctx.examples):  # deployments that start, then each flaw alone
        failure = failure or run_generated(given(case=cases)(agree_hisparse_sizing), n, ctx.seed)
    # pipeline/tensor parallel (#22): several workers' layer sets, vLLM's get_kv_cache_configs over them
    from kvref.models.conformance.planning_parallel import agree_parallel, parallel_plan_families

    def agree_workers(case):
        ran[0] += 1
        agree_parallel(planner, case)

    for cases, n in parallel_plan_families(ctx.examples):  # a mixed run, then each shape alone
        failure = failure or run_generated(given(case=cases)(agree_workers), n, ctx.seed)
    # the packing chunk size and hidden-state block size helpers over their whole domain (#22)
    from kvref.models.conformance.planning_helpers import agree_helpers, helper_cases

    def agree_helper(case):
        ran[0] += 1
        agree_helpers(case)

    failure = failure or run_generated(given(case=helper_cases())(agree_helper), ctx.examples(30, 200), ctx.seed)
    if failure:
        return CheckResult("conform-planning", FAILED, "kvref and vLLM plan a pool differently",
                           details=failure.splitlines()[:20])
    return CheckResult("conform-planning", PASSED, f"{ran[0]} generated layer sets/settings: identical plans and "
                                                   "verdicts", examined=ran[0])


def check_proofs(ctx: VerifyContext) -> CheckResult:
    """Z3 theorems T1-T11 proved over unbounded ints; every historic variant refuted with a reproducer."""
    from kvref.cli.prove import verify_check

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
    return CheckResult("crosshair", PASSED, summary, details=details, examined=len(report.conditions))


def check_crosshair(ctx: VerifyContext) -> CheckResult:
    """CrossHair contracts on the spec functions and the block pool, within a fixed budget."""
    from kvref.proofs import run_contracts

    return _crosshair_result(run_contracts(per_condition_timeout=2.0 if ctx.profile == "fast" else 5.0))


def _kv_machine(ctx: VerifyContext, name: str, kinds: tuple[str, ...], what: str) -> CheckResult:
    from kvref.models.machines.kv_cache_manager import run_machine

    n = ctx.examples(25, 200)
    # sparse prefix-cache retention intervals on SWA/Mamba pools (#23; ignored where torch is driven)
    # multi-module MTP lookahead on EAGLE pools (#23: the re-prefillable tail is never published)
    # DCP/PCP world sizes (#23: DCP-scaled manager blocks, hits at the sharded block)
    run = run_machine(kinds, n, seed=ctx.seed, out_dir=ctx.ensure_out_dir(), shrink=ctx.shrink, retention=True,
                      prefill_lookahead=True, context_parallel=True)
    st = run.stats
    summary = (f"{len(st.steps)} generated traces ({sum(st.steps)} ops, >= 30 each) on {'+'.join(kinds)}: "
               f"{st.admissions} admissions, {st.prefix_hits} prefix hits, {st.preemptions} preemptions, "
               f"{st.admission_rejections + st.step_rejections} rejections")
    if st.kv_events:  # KV cache event streams compared after every op (docs/kv_events.md)
        summary += (f", {sum(st.kv_events.values())} KV events{' compared' if len(kinds) > 1 else ''}"
                    f" ({st.resets} resets)")
    if not run.ok:
        artifacts = [run.trace_path] if run.trace_path else []
        hint = f" — replay with `kvref replay {run.trace_path} --kinds {','.join(kinds)}`" if run.trace_path else ""
        return CheckResult(name, FAILED, f"{what} diverged{hint}", details=run.failure.splitlines()[:30],
                           artifacts=artifacts, signature=run.signature)
    return CheckResult(name, PASSED, summary, examined=len(st.steps))


def check_reference_machine(ctx: VerifyContext) -> CheckResult:
    """The KV cache manager state machine on the reference alone: every invariant after every op."""
    return _kv_machine(ctx, "machine-reference", ("reference",), "the reference broke an invariant")


def check_kv_manager_conformance(ctx: VerifyContext) -> CheckResult:
    """Reference vs the installed vLLM's KVCacheManager on generated traces (block ids, hashes, queue)."""
    skipped = vllm_gate(ctx, "conform-kv-manager")
    if skipped:
        return skipped
    # each manager's publication mask alone, over the inputs engine traces never pass (#22): no or a
    # sub-block alignment, DCP-wide blocks, the offloading connector's final partial segment
    from hypothesis import given

    from kvref.impl.vllm.retention_masks import vllm_reachable_block_mask
    from kvref.models.conformance.retention_masks import agree_mask, any_mask_cases

    masks = ctx.examples(150, 1000)
    failure = run_generated(given(case=any_mask_cases())(lambda case: agree_mask(case, vllm_reachable_block_mask)),
                            masks, ctx.seed)
    if failure:
        return CheckResult("conform-kv-manager", FAILED, "reference and vLLM publish different blocks "
                           "(reachable_block_mask)", details=failure.splitlines()[:30])
    # the sink-attention manager, which vLLM's coordinator cannot build, built directly (#22)
    from kvref.impl.vllm.sink_manager import vllm_sink_manager_run
    from kvref.models.conformance.sink_manager import agree_sink, sink_cases

    failure = run_generated(given(case=sink_cases())(lambda case: agree_sink(case, vllm_sink_manager_run)),
                            ctx.examples(40, 200), ctx.seed)
    if failure:
        return CheckResult("conform-kv-manager", FAILED, "reference and vLLM differ on SinkFullAttentionManager",
                           details=failure.splitlines()[:30])
    result = _kv_machine(ctx, "conform-kv-manager", ("reference", "vllm"), "reference and vLLM")
    if result.status == PASSED:
        result.summary += f"; {masks} generated publication masks"
    if result.status == PASSED:  # then every group set alone: the main run meets only some of them (#22)
        from kvref.models.machines.kv_cache_manager_sweep import sweep_every_group_set

        sweep = sweep_every_group_set(("reference", "vllm"), ctx.examples(2, 4), seed=ctx.seed,
                                      out_dir=ctx.ensure_out_dir(), shrink=ctx.shrink, prefill_lookahead=True)
        if not sweep.ok:
            run = sweep.failure
            return CheckResult("conform-kv-manager", FAILED, f"reference and vLLM diverged on a "
                               f"{list(sweep.traces)[-1]} pool" + (f" — replay with `kvref replay {run.trace_path} "
                                                                   "--kinds reference,vllm`" if run.trace_path else ""),
                               details=run.failure.splitlines()[:30], artifacts=[run.trace_path] if run.trace_path
                               else [], signature=run.signature)
        result.summary += (f"; every group set alone: {sum(sweep.traces.values())} traces on {len(sweep.traces)} "
                           f"sets ({sweep.ops} ops, {sweep.prefix_hits} prefix hits)")
    if result.status == PASSED:  # HiSparse pools: vLLM's HiSparse managers vs the reference's (#23)
        from kvref.impl.vllm.hisparse import VllmHiSparsePool
        from kvref.models.conformance import accepted
        from kvref.models.machines.hisparse_pool import run_hisparse_programs

        # a difference the baseline accepts discards its program and the search goes on (as in the machine)
        failure, seen, sig = run_hisparse_programs(VllmHiSparsePool, ctx.examples(60, 200), seed=ctx.seed)
        if failure:
            return CheckResult("conform-kv-manager", FAILED, "reference and vLLM diverged on a HiSparse pool",
                               details=failure.splitlines()[:30], signature=sig or accepted.signature(failure))
        result.summary += (f"; HiSparse pools: {sum(seen.values())} ops, {seen['hot_allocated']} hot regions, "
                           f"{seen['refused_host']} host-pool refusals, {seen['transition']} transitions")
        # the same pools behind vLLM's whole KVCacheManager: hits, allocate_slots' trim of the host
        # source's longer hit, write-backs (#22)
        from collections import Counter

        from kvref.impl.vllm.hisparse_kv_manager import VllmHiSparseKVCacheManager
        from kvref.models.conformance.hisparse_kv_manager import run_whole_manager_program, whole_manager_programs

        whole = Counter()

        def whole_signature(text: str) -> str:
            """``HiSparse KVCacheManager: <what> differs`` from a comparison's message
            (``<where>: <what> kvref ... != vLLM ...``): stable across programs, so a baseline can
            accept the difference and the search goes on, as for the HiSparse programs above."""
            line = next((ln for ln in text.splitlines() if ": " in ln and ("kvref" in ln or "transfers" in ln)),
                        text.strip().splitlines()[0] if text.strip() else "")
            what = line.split(": ", 1)[-1].split(" kvref")[0]
            return f"HiSparse KVCacheManager: {accepted.signature(what)} differs"

        # programs drawn with KV cache events and report modes, a third of them leaving the prefix on
        # the host tier alone (a "full" lookup there must announce nothing: vLLM's hit guard)
        failure = run_generated_accepting(
            lambda program: whole.update(run_whole_manager_program(make_vllm=VllmHiSparseKVCacheManager, **program)),
            dict(program=whole_manager_programs()), whole_signature, ctx.examples(24, 60), ctx.seed)
        if failure:
            return CheckResult("conform-kv-manager", FAILED, "reference and vLLM diverged on a HiSparse pool behind "
                               "KVCacheManager", details=failure.splitlines()[:30],
                               signature=whole_signature(failure))
        events = sum(n for k, n in whole.items() if k.startswith("event_"))
        result.summary += (f"; HiSparse KVCacheManager: {whole['allocated']} allocations, {whole['hit']} hits, "
                           f"{events} KV events, {whole['full_source_only_hit']} full-mode host-only hits")
    if result.status == PASSED:  # encoder-decoder pools: cross-attention sized by encoder tokens (#22)
        from collections import Counter

        from kvref.impl.reference.adapter import ReferenceKVCacheManager
        from kvref.impl.vllm.kv_cache_manager import VllmKVCacheManager
        from kvref.models.conformance import accepted
        from kvref.models.conformance.encoder_decoder import encoder_decoder_cases, run_encoder_decoder

        encdec = Counter()

        def pair(pool):
            return {"reference": ReferenceKVCacheManager(pool), "vllm": VllmKVCacheManager(pool)}

        def encdec_signature(text: str) -> str:
            """``encoder-decoder pool: <what> differs`` (``op N kind rI: <what>: kvref ...``): stable
            across programs, so a baseline can accept it and the search goes on, as above."""
            line = next((ln for ln in text.splitlines() if " kvref " in ln), text.strip().splitlines()[0]
                        if text.strip() else "")
            what = line.split(" kvref ")[0].split(": ", 1)[-1].rstrip(":")
            return f"encoder-decoder pool: {accepted.signature(what)} differs"

        failure = run_generated_accepting(lambda case: encdec.update(run_encoder_decoder(case, pair)),
                                          dict(case=encoder_decoder_cases()), encdec_signature,
                                          ctx.examples(10, 60), ctx.seed)
        if failure:
            return CheckResult("conform-kv-manager", FAILED, "reference and vLLM diverged on an encoder-decoder "
                               "pool (cross-attention)", details=failure.splitlines()[:30],
                               signature=encdec_signature(failure))
        result.summary += (f"; encoder-decoder pools: {encdec['admitted']} admissions, {encdec['refused']} "
                           f"refusals, {encdec['external']} external loads, {encdec['steps']} steps")
    return result


def check_torch_differential(ctx: VerifyContext) -> CheckResult:
    """Reference vs the torch implementation (on CUDA when present) through the same machine."""
    try:
        import torch
    except ImportError as exc:
        return CheckResult("torch-differential", SKIPPED, f"torch not installed ({exc})")
    import kvref.impl.torch.adapter  # noqa: F401  (registers the default kind "torch")
    from kvref.impl import interface
    from kvref.impl.torch import make_manager

    device = ctx.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError) as exc:
        return CheckResult("torch-differential", ERROR, f"--device {device!r} is not a torch device ({exc})")
    if kind == "cuda" and not torch.cuda.is_available():
        return CheckResult("torch-differential", ERROR, f"--device {device!r} asked for but no CUDA device is present")
    interface.register_manager("torch", lambda pool_config: make_manager(pool_config, device=device))
    try:
        result = _kv_machine(ctx, "torch-differential", ("reference", "torch"), "reference and torch")
    finally:
        interface.register_manager("torch", lambda pool_config: make_manager(pool_config))
    result.summary += f" [torch on {device}]"
    return result


def _scheduler_machine(ctx: VerifyContext, name: str, with_vllm: bool, spec: bool | None = False,
                       examples: tuple[int, int] = (25, 200)) -> CheckResult:
    from kvref.models.machines.scheduler import run_scheduler_machine

    run = run_scheduler_machine(with_vllm=with_vllm, examples=ctx.examples(*examples), shrink=ctx.shrink,
                                seed=ctx.seed, spec=spec)
    if not run.ok:
        return CheckResult(name, FAILED, "scheduler traces " + ("diverged from vLLM" if with_vllm else
                                                                  "broke an invariant or liveness"),
                           details=run.failure.splitlines()[:30], signature=run.signature)
    return CheckResult(name, PASSED, run.summary, examined=run.traces)


@dataclass(frozen=True)
class SubRun:
    """A run a conformance check makes after its main machine, as data: a generated-trace runner
    (``module:function``, imported when it runs, called with the examples, ``shrink`` and ``seed``,
    returning ``ok``, ``failure``, ``signature``, ``traces`` and ``coverage``), its example budget
    (fast, ci), what diverged when it fails, and what it adds to the summary when it passes
    (``str.format`` over its coverage counters, 0 where absent, and ``traces``)."""

    runner: str
    examples: tuple[int, int]
    what: str
    summary: str


class _Counts(dict):
    def __missing__(self, key: str) -> int:
        return 0


def _then(ctx: VerifyContext, name: str, res: CheckResult, runs: tuple[SubRun, ...]) -> CheckResult:
    """Run ``runs`` in order after a passing main run: the first divergence fails the check ``name``
    (its trace shrunk and its signature kept for the baseline); each pass extends the summary and
    the examined count."""
    import importlib

    for sub in runs:
        module, func = sub.runner.split(":")
        run = getattr(importlib.import_module(module), func)(ctx.examples(*sub.examples), shrink=ctx.shrink,
                                                              seed=ctx.seed)
        if not run.ok:
            return CheckResult(name, FAILED, f"{sub.what} diverged from vLLM", details=run.failure.splitlines()[:30],
                               signature=run.signature)
        res = replace(res, summary=res.summary + sub.summary.format_map(_Counts(run.coverage, traces=run.traces)),
                      examined=(res.examined or 0) + run.traces)
    return res


#: conform-scheduler's runs after the main machine, in order (#22 each)
SCHEDULER_RUNS = (
    # salted / cache-skipping arrivals, prefix-cache resets and FA + Mamba "align" pools
    SubRun("kvref.models.machines.scheduler_cache_controls:run_cache_controls_machine", (30, 150),
           "scheduler traces with cache controls",
           "; {traces} more with cache controls ({salted_arrivals} salted, {skip_reading_arrivals} cache-skipping "
           "arrivals, {reset_prefix_cache_done} resets) and Mamba-align pools"),
    # FA + Mamba "align" pools alone: the mixed run above reached no split on them
    SubRun("kvref.models.machines.scheduler_mamba:run_mamba_align_machine", (15, 60),
           "scheduler traces on Mamba-align pools",
           "; {traces} on Mamba-align pools ({mamba_clipped_chunks} chunks clipped to state boundaries, "
           "{prefix_hits} prefix hits)"),
    # DeepSeek-V4.1 SWA bounded replay: FA + a replay window group, hits dropped or rewound by the window
    SubRun("kvref.models.machines.scheduler_prefix_replay:run_prefix_replay_machine", (5, 30),
           "scheduler traces on bounded-replay pools",
           "; {traces} on bounded-replay pools ({replay_admissions} admissions rewound by the window, "
           "{replay_hits_dropped} hits within it dropped)"),
    # R-SWA pools (gap blocks freed between prompt and decode window) and full attention + a ring
    SubRun("kvref.models.machines.scheduler_layouts:run_layouts_machine", (8, 30),
           "scheduler traces on R-SWA and ring pools",
           "; {traces} on R-SWA and ring pools ({rswa_gap_blocks_freed} gap blocks freed, "
           "{ring_blocks_claimed} rings claimed)"),
    # vLLM's aux-output (routed-experts) connector: hits capped at retained / GPU-cached blocks,
    # retention at preemption and finish, LRU release, reset, worker metadata
    SubRun("kvref.models.machines.scheduler_aux_output:run_aux_output_machine", (3, 20),
           "scheduler traces with the aux-output connector",
           "; {traces} with the aux-output connector ({aux_retained_hashes} hashes retained, "
           "{aux_released_hashes} released)"),
    # pause states and the counts the engine polls
    SubRun("kvref.models.machines.scheduler_pause:run_pause_machine", (6, 40),
           "scheduler traces with pause states",
           "; {traces} with pause states ({paused_all_held_running} steps paused with requests running, "
           "{paused_new_held_waiting} holding new ones)"),
    # streaming-input sessions on vLLM's own session code
    SubRun("kvref.models.machines.scheduler_streaming:run_streaming_sessions", (30, 120),
           "streaming-input sessions",
           "; {traces} streaming-session histories ({update_queued} queued and {update_applied_at_once} at-once "
           "updates, {update_drops_a_full_blocks_hash} dropping a full block's hash)"),
    # the prefill cadence, the adaptive long-prefill threshold and outranking arrivals
    SubRun("kvref.models.machines.scheduler_branches:run_branches_machine", (30, 150),
           "scheduler traces with the prefill cadence",
           "; {traces} with the prefill cadence ({cadence_held_chunk} chunks and {cadence_held_waiting} admissions "
           "held) and outranking arrivals"),
    # multimodal requests on an encoder budget and cache
    SubRun("kvref.models.machines.scheduler_encoder:run_encoder_machine", (8, 40),
           "scheduler traces with encoder inputs",
           "; {traces} with encoder inputs ({encoder_inputs_scheduled} encoded, {encoder_evictions} evicted)"),
    # LoRA arrivals under max_loras
    SubRun("kvref.models.machines.scheduler_lora:run_lora_machine", (4, 30),
           "scheduler traces with LoRA adapters", "; {traces} with LoRA adapters ({lora_held_waiting} held by max_loras)"),
    # check_stop's EOS, min_tokens and repetition rules (every finish frees KV blocks)
    SubRun("kvref.models.machines.scheduler_stop:run_stop_machine", (10, 40),
           "scheduler traces with stop rules",
           "; {traces} with stop rules ({stop_eos} EOS, {finished_repetition} repetition finishes, "
           "{repetition_held_by_min_tokens} held by min_tokens)"),
    # structured output: requests waiting for their grammar, compile errors, drafts cut, tokens rejected
    SubRun("kvref.models.machines.scheduler_structured_output:run_structured_output_machine", (6, 30),
           "scheduler traces with structured output",
           "; {traces} with structured output ({so_admitted_past_pending_grammar} admitted past a compiling grammar, "
           "{so_failed_grammar_finished} grammars failed, {so_rejected_sampled} sampled tokens rejected)"),
    # streaming-input sessions inside whole steps: stopped turns keep their KV in kv_holding_waiting
    SubRun("kvref.models.machines.scheduler_sessions:run_session_machine", (10, 40),
           "scheduler traces with streaming sessions",
           "; {traces} with streaming sessions ({session_turn_stopped_kept} turns kept with their blocks, "
           "{session_resumed_on_its_blocks} resumed on them, {session_update_applied_at_once} updates to waiting sessions)"),
    # the waiting queues alone, every method on both policies, refusals included
    SubRun("kvref.models.machines.scheduler_queue:run_queue_machine", (20, 80),
           "waiting-queue operation sequences",
           "; {traces} waiting-queue histories on vLLM's FCFS/priority queues ({removed_one} removals, "
           "{pop_empty_refused} empty pops refused)"),
    # sync KV loads failing in blocks a later request shares (vLLM _update_requests_with_invalid_blocks)
    SubRun("kvref.models.machines.scheduler_load_failures:run_load_failure_cases", (5, 30),
           "sync KV loads failing in shared blocks",
           "; {traces} sync KV loads failing ({invalid_block_shared} in blocks a later request shares)"),
    # --kv-cache-metrics: the collector vLLM's scheduler builds, beside the reference's
    SubRun("kvref.models.machines.scheduler_kv_metrics:run_kv_metrics_machine", (3, 20),
           "scheduler traces with KV cache metrics",
           "; {traces} with KV cache metrics ({eviction_events} eviction events, {followed_blocks_hit} hits on "
           "followed blocks)"),
)

#: conform-spec-decode's runs after the main machine
SPEC_DECODE_RUNS = (
    # admissions padded to 1 + num_spec_tokens rows: arrivals repeating a prompt to one token past a
    # block, so the hit leaves one token
    SubRun("kvref.models.machines.scheduler_spec_padding:run_spec_padding_machine", (4, 30),
           "scheduler traces with padded admissions", "; {traces} with repeated prompts ({spec_padded} padded admissions)"),
)


def check_scheduler_machine(ctx: VerifyContext) -> CheckResult:
    """The reference scheduler alone: invariants every step, liveness drain on consistent pools
    (half the setups with speculative decoding)."""
    return _scheduler_machine(ctx, "machine-scheduler", with_vllm=False, spec=None)


def check_scheduler_conformance(ctx: VerifyContext) -> CheckResult:
    """The reference scheduler in lock-step with the installed vLLM's Scheduler."""
    skipped = vllm_gate(ctx, "conform-scheduler")
    if skipped:
        return skipped
    res = _scheduler_machine(ctx, "conform-scheduler", with_vllm=True)
    if res.status != PASSED:
        return res
    return _then(ctx, "conform-scheduler", res, SCHEDULER_RUNS)


def check_spec_decode_conformance(ctx: VerifyContext) -> CheckResult:
    """Speculative decoding: the reference scheduler in lock-step with the installed vLLM's
    Scheduler/AsyncScheduler on traces with drafts, acceptances, lookahead slots and padding (#22)."""
    skipped = vllm_gate(ctx, "conform-spec-decode")
    if skipped:
        return skipped
    res = _scheduler_machine(ctx, "conform-spec-decode", with_vllm=True, spec=True, examples=(25, 200))
    if res.status != PASSED:
        return res
    return _then(ctx, "conform-spec-decode", res, SPEC_DECODE_RUNS)


def _offload_cases(rng, n):
    """Random SimpleCPU and OffloadingConnector configurations with engine traces: each world's
    ``Config.random`` and :func:`kvref.models.offload.traces.random_ops`, alternating."""
    from kvref.models.offload.offloading_connector_world import OffloadingConfig
    from kvref.models.offload.simple_cpu_world import SimpleOffloadConfig
    from kvref.models.offload.traces import random_ops

    for i in range(n):
        cfg = SimpleOffloadConfig.random(rng) if i % 2 == 0 else OffloadingConfig.random(rng)
        yield cfg, random_ops(rng, rng.randint(30, 70))


def _run_offload(ctx: VerifyContext, name: str, backends: tuple[str, ...]) -> CheckResult:
    """Drive the offload worlds (content model on: a block overwritten while stored, a load of the
    wrong content or a leak raises) on every backend and compare what they observe."""
    import random

    from kvref.models.offload.simple_cpu_world import SimpleOffloadConfig, SimpleOffloadWorld
    from kvref.models.offload.traces import apply_offloading_op, apply_op
    from kvref.models.offload.offloading_connector_world import OffloadingWorld

    from kvref.models.conformance.accepted import is_accepted, signature

    n = ctx.examples(80, 400)
    rng = random.Random(ctx.seed)
    ops_run = accepted = 0
    for i, (cfg, ops) in enumerate(_offload_cases(rng, n)):
        simple = isinstance(cfg, SimpleOffloadConfig)
        worlds = [SimpleOffloadWorld(cfg, b, allow_duplicates_within_event=True) if simple
                  else OffloadingWorld(cfg, b, strict=False) for b in backends]
        apply = apply_op if simple else apply_offloading_op
        where = type(cfg).__name__
        for j, op in enumerate(ops):
            try:
                outs = [apply(w, op) for w in worlds]
            except KeyError as exc:
                if not simple and backends[-1] == "vllm":
                    break  # vLLM 0.33.0's KeyError after a connector reset (docs/offload.md); reference survives
                raise
            except AssertionError as exc:
                sig = signature(f"{where} {op[0]}: {type(exc).__name__}: {exc}")
                if is_accepted(sig):
                    accepted += 1
                    break  # a difference the baseline accepts: on to the next trace
                return CheckResult(name, FAILED, f"offload invariant broken in trace {i} op {j}",
                                   details=[f"config: {cfg}", f"op: {op}", f"{type(exc).__name__}: {exc}"],
                                   signature=sig)
            ops_run += 1
            if len(worlds) > 1 and (outs[0] != outs[1] or worlds[0].observe() != worlds[1].observe()):
                sig = f"{where} {op[0]}: {'the step outputs' if outs[0] != outs[1] else 'the observed state'} differ"
                if is_accepted(sig):
                    accepted += 1
                    break
                return CheckResult(name, FAILED, f"reference and vLLM differ in trace {i} at op {j}",
                                   details=[f"config: {cfg}", f"op: {op}", f"reference: {outs[0]!r}"[:600],
                                            f"vllm: {outs[1]!r}"[:600]], signature=sig)
    kinds = "+".join(backends)
    return CheckResult(name, PASSED, f"{n} random SimpleCPU/OffloadingConnector traces ({ops_run} ops) on {kinds}: "
                                     "jobs, pools and content model agree", examined=ops_run)


def check_offload_machine(ctx: VerifyContext) -> CheckResult:
    """Both offload schedulers on the reference, with the content model (no reuse mid-store, loads
    return what was stored, nothing lost on preempt/abort)."""
    return _run_offload(ctx, "machine-offload", ("reference",))


def check_offload_conformance(ctx: VerifyContext) -> CheckResult:
    """Both offload schedulers vs the installed vLLM's, step by step."""
    skipped = vllm_gate(ctx, "conform-offload")
    if skipped:
        return skipped
    result = _run_offload(ctx, "conform-offload", ("reference", "vllm"))
    if result.status != PASSED:
        return result
    from .verify_simple_mamba import with_simple_mamba  # SimpleCPU on Mamba "align" pools (#22)

    result = with_simple_mamba(ctx, result)
    if result.status != PASSED:
        return result
    from .verify_offload_tails import with_partial_tails  # the OffloadingConnector's partial tails (#22)

    return with_partial_tails(ctx, result)


def run_check(check, ctx, baseline, collect: bool = False) -> CheckResult:
    """Run one check: shrinking bounded, Hypothesis' messages on stderr, the baseline applied.

    ``collect`` (``--update-baseline``): the generated-trace checks accept every difference and keep
    searching, so ``result.met_signatures`` lists all the differences they met.
    """
    from kvref.models.conformance import accepted
    from kvref.models.hypothesis_runs.shrink_budget import bounded_shrinking

    t0 = time.perf_counter()
    budget = ctx.shrink_budget()
    try:
        with accepted.accepting(baseline.signatures_for(check.name), collect), bounded_shrinking(budget) as log:
            result = check.run(ctx)
    except Exception as exc:  # a check that crashes is reported, the others still run
        from .vllm_crash import crash_result

        # vLLM's own code raising under a vLLM-facing check is a finding, not a kvref error
        result = (crash_result(check.name, exc) if getattr(check, "vllm", False) else None) or \
            CheckResult(check.name, ERROR, f"{type(exc).__name__}: {exc}")
        log = None
    result.seconds = time.perf_counter() - t0
    if result.status == PASSED and result.examined == 0:  # it ran but looked at nothing (issue #25)
        result.status = ERROR
        result.summary = f"examined nothing (0 cases), so it cannot pass: {result.summary}"
    if log is not None and log.stopped_early and result.failing:
        result.details.append(f"shrinking stopped at its bound ({budget:g} s, --shrink-seconds): the trace shown "
                              "is the smallest found by then")
    met = dict(accepted.met)
    result.met_signatures = sorted(met)
    entry = baseline.accepts(result)
    if entry is not None:
        result.status = ACCEPTED
        result.summary = (f"accepted by the baseline ({entry.reason or 'no reason given'}): {result.summary}; "
                          "this check stops at its first difference, so nothing behind it was searched")
    elif met and not result.failing:
        result.status = ACCEPTED
        result.summary += (f"; {sum(met.values())} trace(s) ended at differences the baseline accepts "
                           f"({', '.join(sorted(met))}) and the search went on past them")
    return result
