"""``kvref verify``'s ``conform-connector`` check: the reference scheduler's KV-connector flows in
lock step with the installed vLLM's ``Scheduler`` / ``AsyncScheduler`` running the same scripted
connector (:mod:`kvref.models.machines.scheduler_connector`, issue #22), and vLLM's ``MultiConnector``
on the worker side of the step (:mod:`kvref.models.machines.multi_connector_worker`)."""

from __future__ import annotations

from .check_context import VerifyContext, vllm_gate
from .report import FAILED, PASSED, CheckResult


def check_connector_conformance(ctx: VerifyContext) -> CheckResult:
    """Async and sync KV loads, failed receives and invalid blocks under both failure policies,
    aborts mid-load, delayed frees and connector resets: reference vs vLLM after every step."""
    name = "conform-connector"
    skipped = vllm_gate(ctx, name)
    if skipped:
        return skipped
    from kvref.models.machines.scheduler_connector import run_connector_machine

    run = run_connector_machine(with_vllm=True, examples=ctx.examples(5, 150), shrink=ctx.shrink, seed=ctx.seed)
    if not run.ok:
        return CheckResult(name, FAILED, "KV-connector traces diverged from vLLM",
                           details=run.failure.splitlines()[:30], signature=run.signature)
    # then speculative decoding beside the connector: padded admissions after an external hit,
    # lookahead slots held back during an async load, one speculative step reserved beside it (#22)
    spec = run_connector_machine(with_vllm=True, examples=ctx.examples(3, 40), shrink=ctx.shrink, seed=ctx.seed,
                                 spec=True)
    if not spec.ok:
        return CheckResult(name, FAILED, "KV-connector traces with speculative decoding diverged from vLLM",
                           details=spec.failure.splitlines()[:30], signature=spec.signature)
    # then DeepSeek-V4.1 SWA bounded replay beside the connector: loads without the window cut to
    # whole blocks, short hits dropped, longer ones rewound (after an async load lands too), loads
    # carrying the window (a P/D transfer's get_loaded_kv_cache_group_ids) taken whole (#22)
    from kvref.models.machines.scheduler_replay_connector import run_replay_connector_machine

    replay = run_replay_connector_machine(ctx.examples(12, 60), shrink=ctx.shrink, seed=ctx.seed)
    if not replay.ok:
        return CheckResult(name, FAILED, "KV-connector traces on bounded-replay pools diverged from vLLM",
                           details=replay.failure.splitlines()[:30], signature=replay.signature)
    # then pause states with a KV connector: PAUSED_NEW still admits KV-holding requests (#22)
    from kvref.models.machines.scheduler_pause import run_connector_pause_machine

    paused = run_connector_pause_machine(ctx.examples(4, 40), shrink=ctx.shrink, seed=ctx.seed)
    if not paused.ok:
        return CheckResult(name, FAILED, "KV-connector traces with pause states diverged from vLLM",
                           details=paused.failure.splitlines()[:30], signature=paused.signature)
    # then a consumer's whole life under async scheduling: deferred frees, make_stats polled after
    # every operation (skipped waiting requests, KV-fetch stages, connector hits), shutdown (#22)
    from kvref.models.machines.scheduler_lifecycle import run_lifecycle_machine

    life = run_lifecycle_machine(ctx.examples(5, 40), shrink=ctx.shrink, seed=ctx.seed)
    if not life.ok:
        return CheckResult(name, FAILED, "KV-connector lifecycle traces (async consumer, stats, shutdown) diverged "
                           "from vLLM", details=life.failure.splitlines()[:30], signature=life.signature)
    # then the same with a HiSparse host pool: async loads wait for the steps in flight (#22)
    deferred = run_lifecycle_machine(ctx.examples(10, 40), shrink=ctx.shrink, seed=ctx.seed, hisparse=True)
    if not deferred.ok:
        return CheckResult(name, FAILED, "KV-connector lifecycle traces with deferred async loads (HiSparse) "
                           "diverged from vLLM", details=deferred.failure.splitlines()[:30],
                           signature=deferred.signature)
    # then preempted requests reloading their KV asynchronously: promoted back to PREEMPTED (#22)
    reload = run_lifecycle_machine(ctx.examples(3, 15), shrink=ctx.shrink, seed=ctx.seed, hisparse=False,
                                   reload=True)
    if not reload.ok:
        return CheckResult(name, FAILED, "KV-connector traces with preempted requests reloading their KV diverged "
                           "from vLLM", details=reload.failure.splitlines()[:30], signature=reload.signature)
    # then vLLM's aux-output (routed-experts) connector beside it: external hits kept only when
    # block-aligned within the retained / GPU-cached blocks, async loads held against release (#22)
    from kvref.models.machines.scheduler_aux_output import run_aux_output_connector_machine

    aux = run_aux_output_connector_machine(ctx.examples(3, 20), shrink=ctx.shrink, seed=ctx.seed)
    if not aux.ok:
        return CheckResult(name, FAILED, "KV-connector traces with the aux-output connector diverged from vLLM",
                           details=aux.failure.splitlines()[:30], signature=aux.signature)
    # then vLLM's MultiConnector on the worker side too: metadata, hooks, merged results, ranks (#22)
    from kvref.models.machines.multi_connector_worker import (
        MultiWorkerDivergence,
        random_multi_worker_cases,
        run_multi_worker_traces,
    )

    try:
        multi = run_multi_worker_traces(random_multi_worker_cases(ctx.seed, ctx.examples(40, 300)))
    except MultiWorkerDivergence as exc:
        return CheckResult(name, FAILED, "vLLM's MultiConnector (scheduler + worker roles) diverged from the reference",
                           details=str(exc).splitlines()[:30], signature=f"{name}: MultiConnector worker side")
    c = paused.coverage
    sc = spec.coverage
    rc = replay.coverage
    return CheckResult(name, PASSED, run.summary + f"; {spec.traces} with speculative decoding "
                       f"({sc.get('loads_started_async', 0)} async loads, {sc.get('promoted_load_scheduled', 0)} "
                       f"promoted, {sc.get('vllm_hang_spec_step_reservation', 0)} vLLM hangs on the speculative "
                       f"step's reservation); {replay.traces} on bounded-replay pools "
                       f"({rc.get('replay_external_hits_cut', 0)} external hits cut to whole blocks, "
                       f"{rc.get('replay_window_loaded', 0)} loads carrying the window, "
                       f"{rc.get('replay_after_async_load', 0)} replays after an async load); {paused.traces} with pause states "
                       f"({c.get('paused_new_admitted', 0)} KV-holding admissions while new ones were held); "
                       f"{life.traces} async-consumer lifecycles ({life.coverage.get('steps_with_deferred_frees', 0)} "
                       f"steps with deferred frees, {life.coverage.get('kv_fetch_in_progress', 0)} polls with loads "
                       f"in progress); {deferred.traces} with deferred async loads "
                       f"({deferred.coverage.get('deferred_loads_started', 0)} started after their fence); "
                       f"{reload.traces} with preempted requests' KV stored "
                       f"({reload.coverage.get('preempted_stored', 0)} stored for reload); "
                       f"{aux.traces} with the aux-output connector ({aux.coverage.get('aux_external_kept', 0)} "
                       f"external hits kept, {aux.coverage.get('aux_external_dropped', 0)} dropped); "
                       f"{multi['traces']} MultiConnector scheduler+worker traces ({multi['calls']} steps' calls, "
                       f"{multi['extra_saves']} extra async saves, {multi['sends_finished']} sends finished, "
                       f"{multi['logged']} stats intervals logged, {multi['prom_observed']} metrics observations)",
                       examined=run.traces + spec.traces + replay.traces + paused.traces + life.traces + deferred.traces + reload.traces
                       + aux.traces
                       + multi["traces"])
