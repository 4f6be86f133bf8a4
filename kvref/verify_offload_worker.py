"""``kvref verify``'s ``conform-offload-worker`` check: vLLM's whole ``OffloadingConnector`` —
scheduler role and one worker role per rank, KV caches registered, metadata carried from the one
to the other — against the reference on generated traces, with a byte oracle on every load
(:mod:`kvref.models.machines.offload_worker`, issue #22)."""

from __future__ import annotations

from .check_context import VerifyContext, vllm_gate
from .report import FAILED, PASSED, CheckResult

NAME = "conform-offload-worker"


def offload_worker_cases(seed: int, n: int) -> list:
    """``n`` random OffloadingConnector configurations with engine traces (the generators of
    ``conform-offload``: :meth:`OffloadingConfig.random`, :func:`random_ops`)."""
    import random

    from kvref.models.offload.offloading_connector_world import OffloadingConfig
    from kvref.models.offload.traces import random_ops

    rng = random.Random(f"{NAME}-{seed}")
    return [(OffloadingConfig.random(rng), random_ops(rng, rng.randint(30, 70)) + _reload_tail(rng)) for _ in range(n)]


def _reload_tail(rng) -> list:
    """The end of every trace: finish what runs, drain the transfers, let the GPU forget its prefix
    cache and ask for an earlier prompt again, so that most traces load chunks back from the CPU
    (the byte oracle's case) rather than hit on the GPU."""
    pick = rng.randint(0, 99)
    return [("step", 0, 13, 0, 64, 4, pick, 1, False), ("drain", 0, 13, 0, 8, 1, pick, 2, False),
            ("cload", 0, 13, 0, 8, 1, pick, 1, True), ("add", 2, 13, rng.randint(0, 3), 8, 1, pick, 1, True),
            ("step", 0, 13, 0, rng.choice([4, 8, 64]), 3, pick, 1, False), ("drain", 0, 13, 0, 8, 1, pick, 2, True),
            ("step", 0, 13, 0, 8, 3, pick, 1, False)]


def simple_connector_cases(seed: int, n: int) -> list:
    """``n`` random SimpleCPU configurations with engine traces (``conform-offload``'s generators)."""
    import random

    from kvref.models.offload.simple_cpu_world import SimpleOffloadConfig
    from kvref.models.offload.traces import random_ops

    rng = random.Random(f"{NAME}-simple-{seed}")
    return [(SimpleOffloadConfig.random(rng), random_ops(rng, rng.randint(30, 70))) for _ in range(n)]


def check_offload_worker_conformance(ctx: VerifyContext) -> CheckResult:
    """Jobs, pools and chunk state vs the reference after every operation; each load's GPU blocks
    hold the bytes their request computed, on every rank; the workers report exactly what ran."""
    skipped = vllm_gate(ctx, NAME)
    if skipped:
        return skipped
    from kvref.models.machines.offload_worker import run_traces
    from kvref.models.offload.world_common import OffloadInvariantError

    from kvref.models.machines.simple_offload_connector import run_connector_construction

    try:  # the connector's construction path: extra config -> budget, pool size, mode, backend (#22)
        built = run_connector_construction(ctx.seed, ctx.examples(60, 400))
    except OffloadInvariantError as exc:
        return CheckResult(NAME, FAILED, "vLLM's SimpleCPUOffloadConnector is configured unlike the reference",
                           details=[str(exc)[:1500]], signature=f"{NAME}: SimpleCPU construction")

    from kvref.models.machines.simple_offload_connector import run_sizing_agreement

    try:  # the ranks' pool-size agreement: forked gloo ranks run vLLM's all-reduce (#22)
        sized = run_sizing_agreement(ctx.seed, ctx.examples(3, 12))
    except OffloadInvariantError as exc:
        return CheckResult(NAME, FAILED, "vLLM's SimpleCPU ranks agree on another pool size than the reference",
                           details=[str(exc)[:1500]], signature=f"{NAME}: SimpleCPU pool-size agreement")
    import random

    from kvref.models.machines.canonical_mapping import compare_layer, layer_cases

    n = ctx.examples(8, 120)
    try:
        stats = run_traces(offload_worker_cases(ctx.seed, n))
    except (AssertionError, OffloadInvariantError) as exc:
        text = f"{type(exc).__name__}: {exc}"
        return CheckResult(NAME, FAILED, "vLLM's OffloadingConnector (scheduler + worker) diverged",
                           details=[text[:1500]], signature=f"{NAME}: {type(exc).__name__}")
    from kvref.models.machines.simple_offload_connector import run_simple_connector_traces

    try:
        simple = run_simple_connector_traces(simple_connector_cases(ctx.seed, ctx.examples(4, 60)))
    except (AssertionError, OffloadInvariantError) as exc:
        text = f"{type(exc).__name__}: {exc}"
        return CheckResult(NAME, FAILED, "vLLM's SimpleCPUOffloadConnector diverged from the reference",
                           details=[text[:1500]], signature=f"{NAME}: SimpleCPU {type(exc).__name__}")
    from kvref.impl.vllm.kv_event_publisher import publish_and_subscribe

    batches = stats["batches"]
    problems = publish_and_subscribe(batches, buffer_steps=max(1, len(batches) // 3), dp_rank=1,
                                     replay_from=(0, len(batches) // 2, len(batches) - 1, len(batches) + 2))
    from kvref.impl.vllm.kv_event_publisher import check_endpoint_offsets, check_worker_aggregation

    prng = random.Random(f"{NAME}-workers-{ctx.seed}")
    for events in batches[:8]:  # each worker reports a random part of the step's events
        workers = [[e for e in events if prng.random() < 0.8] for _ in range(prng.randint(1, 3))]
        problems += check_worker_aggregation(workers)
    problems += check_endpoint_offsets()
    from kvref.impl.vllm.kv_event_publisher_edges import (  # tcp endpoints, factory, aggregator (#22)
        check_aggregator_refusals,
        check_publisher_factory,
        check_tcp_streams,
    )

    problems += check_tcp_streams(batches, ctx.seed)
    problems += check_publisher_factory(ctx.seed)
    problems += check_aggregator_refusals([e for events in batches for e in events], ctx.seed)
    if problems:
        return CheckResult(NAME, FAILED, "vLLM's ZMQ KV-event publisher did not deliver the events as published",
                           details=problems[:10], signature=f"{NAME}: kv event publisher")
    from kvref.models.machines.shared_offload_region import run_region_cases  # the CPU tier's /dev/shm region

    try:
        regions = run_region_cases(ctx.seed, ctx.examples(40, 300))
    except AssertionError as exc:
        return CheckResult(NAME, FAILED, "vLLM's SharedOffloadRegion maps or lays out bytes unlike the reference",
                           details=[str(exc)[:1500]], signature=f"{NAME}: shared offload region")
    from kvref.models.machines.file_mapper import check_file_mapper

    frng = random.Random(f"{NAME}-files-{ctx.seed}")
    mappers = ctx.examples(10, 60)
    for _ in range(mappers):
        bad = check_file_mapper(frng)
        if bad:
            return CheckResult(NAME, FAILED, "vLLM's FileMapper breaks its file layout",
                               details=[bad[:1500]], signature=f"{NAME}: file mapper")
    rng = random.Random(f"{NAME}-layers-{ctx.seed}")
    layers = ctx.examples(60, 300)
    for case in layer_cases(rng, layers):  # with CP, MLA, Mamba, odd strides... forced first (#22)
        diff = compare_layer(case)
        if diff:
            return CheckResult(NAME, FAILED, "vLLM's canonical page mapping differs from the reference",
                               details=[diff[:1500]], signature=f"{NAME}: canonical mapping")
    from kvref.models.machines.offload_layout_gate import compare_gate, gate_cases

    gates = ctx.examples(40, 300)
    for case in gate_cases(random.Random(f"{NAME}-gate-{ctx.seed}"), gates):  # build_offloading_config's
        diff = compare_gate(case)  # parallelism gate on generated layer sets (#22)
        if diff:
            return CheckResult(NAME, FAILED, "vLLM's build_offloading_config gates parallelism unlike the reference",
                               details=[diff[:1500]], signature=f"{NAME}: offloading parallelism gate")
    from kvref.models.machines.offload_policies import run_policy_cases  # LRU / ARC / out-of-tree, call by call (#22)

    try:
        policies = run_policy_cases(ctx.seed, ctx.examples(60, 300))
    except AssertionError as exc:
        return CheckResult(NAME, FAILED, "vLLM's CPU-tier cache policy (LRU / ARC) differs from the reference",
                           details=[str(exc)[:1500]], signature=f"{NAME}: cache policies")
    return CheckResult(NAME, PASSED,
                       f"{policies['cases']} cache-policy sequences ({policies['ops']} calls, {policies['bulk']} bulk) "
                       "on vLLM's LRU, ARC and an out-of-tree policy, "
                       f"{stats.get('stats_intervals', 0)} traces' stats merged and reduced as the metrics endpoint does, "
                       f"{stats['traces']} OffloadingConnector traces ({stats['ops']} ops, {stats['jobs_executed']} "
                       f"transfers run by the workers, {stats.get('sync_loads', 0)} of them synchronous loads, "
                       f"{stats['blocks_checked']} loaded blocks byte-checked, "
                       f"{stats['stopped_at_shared_breach']} ended at a content breach vLLM 0.33.0 and the reference "
                       f"share, {stats['stopped_at_known_corruption']} at vLLM 0.33.0's known post-reset corruption) "
                       "on "
                       f"vLLM's scheduler + worker roles ({stats['events']} CPU-tier KV events, {len(batches)} "
                       f"batches round-tripped through vLLM's ZMQ publisher), {simple['traces']} traces "
                       f"({simple['ops']} ops) of the whole SimpleCPUOffloadConnector, {built['configs']} of its "
                       f"configurations built in both roles ({built['refused']} refused, {built['sized_from_bytes']} "
                       f"sized from byte budgets, {built['disk']} disk, {built['in_multi']} found inside a MultiConnector; "
                       f"{sized['rank_sets']} rank sets agreeing on the pool size over gloo), "
                       f"{regions['cases']} shared host regions ({regions['regions']} workers' mappings, "
                       f"{regions['segmented']} split into files, {regions['bytes_checked']} bytes compared), "
                       f"{mappers} file-tier layouts and "
                       f"{layers} layers' canonical page mappings and {gates} layer sets' offloading parallelism "
                       "gates: jobs, pools, bytes, events, file names, mappings and gates agree with the reference",
                       examined=stats["ops"] + policies["ops"] + simple["ops"] + built["configs"] + mappers + layers
                       + regions["cases"] + gates)
