"""``plan_kv_cache_workers``: vLLM 0.33.0's startup sizing over several workers (pipeline and tensor
parallel), as a pure function.

With pipeline parallelism every worker (one per PP stage × TP rank) reports only its own layers.
vLLM's ``get_global_kv_cache_groups`` merges the workers' specs (a layer on several workers, i.e. TP
ranks of one stage, must have the same spec there) and groups the whole model once;
``get_kv_cache_configs`` then projects the global groups onto each worker
(``_project_kv_cache_groups_to_worker``: a group keeps its place even when the worker holds none of
its layers, so every worker has the same number of groups and one block id means the same thing
on all of them), sizes each worker's pool from its own layers, auto-fits ``max_model_len`` to the
most constrained worker, checks every worker, and finally gives every worker the smallest block
count among them (the scheduler owns one block table for all of them). ``kv_tp_replicas`` says
how many consecutive TP ranks hold identical KV (MLA caches are not sharded over TP:
``max_tp_shards=1``), which offloading uses to store one copy.

kvref's specs carry no ``max_tp_shards`` field: it is given here per layer
(``max_tp_shards={layer: shards}``, absent = vLLM's ``None``), see docs/differences.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import reduce
from math import gcd
from typing import Any, Collection, Mapping, Sequence

from .block_sizes import resolve_cache_hit_alignment_tokens, resolve_kv_cache_block_sizes
from .config import EngineConfig
from .errors import InvalidFieldError, check_int
from .grouping import check_exact_partition, validate_layers
from .kv_cache_interface import AttentionSpec, KVCacheGroupSpec, KVCacheSpec, UniformTypeKVCacheSpecs
from .planning import scheduler_view
from .planning_packed import DEFAULT_KV_CACHE_LAYOUT, check_layout, get_kv_cache_groups_for_layout, validate_kv_cache_layout
from .pool_sizing import (
    check_enough_kv_cache_memory,
    estimate_max_model_len,
    group_blocks_per_request,
    max_concurrency,
    pool_bytes_per_block,
    validate_groups,
)

Layers = Mapping[str, KVCacheSpec]


def merge_worker_kv_cache_specs(kv_cache_specs: Sequence[Layers]) -> dict[str, KVCacheSpec]:
    """vLLM's merge in ``get_global_kv_cache_groups``: every worker's layers, first occurrence first.

    Raises:
        InvalidFieldError: not a non-empty list of layer mappings, or one layer with different specs
            on two workers (vLLM asserts "The KV cache specs for the same layer are different
            across workers").
    """
    if isinstance(kv_cache_specs, (str, bytes, Mapping)) or not isinstance(kv_cache_specs, Sequence) \
            or not kv_cache_specs:
        raise InvalidFieldError("kv_cache_specs", kv_cache_specs, "a non-empty list of per-worker layer mappings")
    merged: dict[str, KVCacheSpec] = {}
    for i, worker in enumerate(kv_cache_specs):
        try:
            worker = validate_layers(worker, allow_empty=True)
        except InvalidFieldError as exc:
            raise InvalidFieldError(f"kv_cache_specs[{i}]", exc.value, exc.allowed) from None
        for name, spec in worker.items():
            if name in merged and merged[name] != spec:
                raise InvalidFieldError(f"kv_cache_specs[{i}][{name!r}]", spec,
                                        f"the spec other workers report for {name!r}: {merged[name]!r}")
            merged.setdefault(name, spec)
    return merged


def project_kv_cache_groups_to_worker(global_groups: Sequence[KVCacheGroupSpec],
                                      worker_layers: Layers) -> tuple[KVCacheGroupSpec, ...]:
    """vLLM's ``_project_kv_cache_groups_to_worker``: each global group restricted to this worker's
    layers, in the same order. A group of which the worker holds no layer stays, empty, with its
    spec unchanged (its blocks still count in the worker's per-request need); a uniform-type group
    of which it holds some keeps only those layers' specs."""
    groups = validate_groups(global_groups)
    worker_layers = validate_layers(worker_layers, allow_empty=True)
    out = []
    for g in groups:
        names = tuple(n for n in g.layer_names if n in worker_layers)
        if len(names) == len(g.layer_names):
            out.append(g)
            continue
        spec = g.kv_cache_spec
        if names and isinstance(spec, UniformTypeKVCacheSpecs):
            spec = UniformTypeKVCacheSpecs(block_size=spec.block_size,
                                           kv_cache_specs={n: spec.kv_cache_specs[n] for n in names})
        out.append(KVCacheGroupSpec(names, spec, g.is_eagle_group))
    return tuple(out)


def _check_tp_shards(max_tp_shards: object) -> dict[str, int]:
    if max_tp_shards is None:
        return {}
    if not isinstance(max_tp_shards, Mapping):
        raise InvalidFieldError("max_tp_shards", max_tp_shards, "None or a mapping of layer name -> positive int")
    for name, shards in max_tp_shards.items():
        if not isinstance(name, str):
            raise InvalidFieldError("max_tp_shards", name, "str layer names")
        check_int(f"max_tp_shards[{name!r}]", shards, minimum=1)
    return dict(max_tp_shards)


def _layer_tp_replicas(spec: KVCacheSpec, shards: int | None, tp_size: int, dcp_size: int) -> int:
    """vLLM's ``_layer_tp_replicas``: TP ranks holding the same copy of one layer's cache."""
    if not isinstance(spec, AttentionSpec) or shards is None:
        return 1
    if spec.dcp_sharded and dcp_size > 1:
        return 1
    return max(1, tp_size // shards)


def kv_cache_groups_tp_replicas(groups: Sequence[KVCacheGroupSpec], tensor_parallel_size: int,
                                dcp_world_size: int = 1, max_tp_shards: Mapping[str, int] | None = None,
                                global_groups: Sequence[KVCacheGroupSpec] | None = None) -> int:
    """vLLM's ``kv_cache_groups_tp_replicas``: consecutive TP ranks holding identical KV for every
    layer — the gcd over every spec of the groups (a uniform-type group's per-layer specs, else the
    group's one spec, also for a projected group with no layer here) of ``tp // max_tp_shards``.

    ``max_tp_shards`` maps layer names to vLLM's ``AttentionSpec.max_tp_shards`` (absent: None, not
    replicated). A non-uniform group's spec has its first layer's value, as vLLM's merged spec
    does; for a projected group with no layer on this worker that is the first layer of the same
    group in ``global_groups`` (the groups the worker's were projected from).
    """
    groups = validate_groups(groups)
    check_int("tensor_parallel_size", tensor_parallel_size, minimum=1)
    check_int("dcp_world_size", dcp_world_size, minimum=1)
    shards = _check_tp_shards(max_tp_shards)
    origin = validate_groups(global_groups) if global_groups is not None else groups
    if len(origin) != len(groups):
        raise InvalidFieldError("global_groups", global_groups, f"the {len(groups)} groups the worker's come from")
    replicas = []
    for g, whole in zip(groups, origin):
        spec = g.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            replicas += [_layer_tp_replicas(s, shards.get(n), tensor_parallel_size, dcp_world_size)
                         for n, s in spec.kv_cache_specs.items()]
        else:
            names = g.layer_names or whole.layer_names
            replicas.append(_layer_tp_replicas(spec, shards.get(names[0]) if names else None,
                                               tensor_parallel_size, dcp_world_size))
    return reduce(gcd, replicas, tensor_parallel_size) if replicas else 1


@dataclass(frozen=True)
class WorkerPlan:
    """One worker's KV cache config (vLLM's per-worker ``KVCacheConfig``).

    Fields: ``groups`` (the projected groups), ``bytes_per_block`` (``_pool_bytes_per_block`` of
    them), ``memory_bytes`` (profiled, or ``override × bytes_per_block``), ``check_memory_bytes``
    (null block held back), ``own_num_blocks`` (``memory // bytes_per_block`` before the common
    minimum), ``tensor_bytes`` (each KV cache tensor's size at the common block count) and
    ``kv_tp_replicas``.
    """

    groups: tuple[KVCacheGroupSpec, ...]
    bytes_per_block: int
    memory_bytes: int
    check_memory_bytes: int
    own_num_blocks: int
    tensor_bytes: int
    kv_tp_replicas: int


@dataclass(frozen=True)
class ParallelKVCachePlan:
    """The result of :func:`plan_kv_cache_workers`.

    ``num_blocks`` is every worker's (the smallest worker's own count, null block included); the
    scheduler fields come from worker 0's config (``generate_scheduler_kv_cache_config``) and are
    None for an attention-free model (no groups: one null block, nothing to schedule).
    """

    global_groups: tuple[KVCacheGroupSpec, ...]
    workers: tuple[WorkerPlan, ...]
    num_blocks: int
    max_model_len: int
    auto_fitted: bool
    scheduler_groups: tuple[KVCacheGroupSpec, ...]
    scheduler_block_size: int | None
    hash_block_size: int | None
    cache_hit_alignment_tokens: int | None
    max_concurrency: float | None
    kv_cache_size_tokens: int | None
    config: EngineConfig = field(repr=False)

    def check_invariants(self) -> None:
        """Every worker's pool holds what the scheduler admits (AssertionError when one is broken)."""
        assert self.num_blocks == min(w.own_num_blocks for w in self.workers)
        for w in self.workers:
            assert len(w.groups) == len(self.global_groups)
            if not w.groups:
                assert self.num_blocks == 1 and w.tensor_bytes == 0
                continue
            assert w.own_num_blocks * w.bytes_per_block <= w.memory_bytes
            assert w.tensor_bytes == w.bytes_per_block * self.num_blocks
            # one max-length request fits every worker's usable blocks at the common count
            need = sum(group_blocks_per_request(g.kv_cache_spec, self.config, self.max_model_len) for g in w.groups)
            assert need <= self.num_blocks - 1, (need, self.num_blocks)

    def to_dict(self) -> dict[str, Any]:
        return {"num_blocks": self.num_blocks, "max_model_len": self.max_model_len,
                "auto_fitted": self.auto_fitted, "max_concurrency": self.max_concurrency,
                "workers": [{"layers": [list(g.layer_names) for g in w.groups],
                             "bytes_per_block": w.bytes_per_block, "own_num_blocks": w.own_num_blocks,
                             "kv_tp_replicas": w.kv_tp_replicas} for w in self.workers]}


def _check_memories(available_memory: object, n: int) -> list[int]:
    if isinstance(available_memory, (str, bytes)) or not isinstance(available_memory, Sequence) \
            or len(available_memory) != n:
        raise InvalidFieldError("available_memory", available_memory, f"a list of {n} byte counts (one per worker)")
    for i, m in enumerate(available_memory):
        check_int(f"available_memory[{i}]", m, minimum=0)
    return list(available_memory)


def mark_eagle_groups(groups: Sequence[KVCacheGroupSpec], draft_layers: Collection[str]) -> tuple[KVCacheGroupSpec, ...]:
    """vLLM's EAGLE block drop in ``get_global_kv_cache_groups``: with
    ``speculative_config.use_eagle_block_drop()``, a group is the draft's (``is_eagle_group``)
    exactly when it holds a draft layer (``spec.is_draft``); its volatile trailing prefix-cache
    block is then dropped at runtime."""
    groups = validate_groups(groups)
    if isinstance(draft_layers, (str, bytes)) or not isinstance(draft_layers, Collection) \
            or not all(isinstance(n, str) for n in draft_layers):
        raise InvalidFieldError("draft_layers", draft_layers, "a collection of layer names")
    return tuple(KVCacheGroupSpec(g.layer_names, g.kv_cache_spec, not set(draft_layers).isdisjoint(g.layer_names))
                 for g in groups)


def plan_kv_cache_workers(kv_cache_specs: Sequence[Layers], config: EngineConfig, available_memory: Sequence[int],
                          *, kv_cache_layout: str = DEFAULT_KV_CACHE_LAYOUT, tensor_parallel_size: int = 1,
                          max_tp_shards: Mapping[str, int] | None = None,
                          draft_layers: Collection[str] | None = None) -> ParallelKVCachePlan:
    """Size every worker's pool as vLLM 0.33.0's ``get_global_kv_cache_groups`` +
    ``get_kv_cache_configs`` + ``generate_scheduler_kv_cache_config`` do.

    Args:
        kv_cache_specs: per worker (PP stage × TP rank), its layers (name → spec, model order), as
            vLLM gets them after ``extra_retained_tokens`` is set.
        config: engine settings; ``max_model_len="auto"`` auto-fits to the tightest worker.
        available_memory: per worker, bytes the profiler left for its KV cache.
        kv_cache_layout: vLLM's resolved ``cache_config.kv_cache_layout``.
        tensor_parallel_size, max_tp_shards: for ``kv_tp_replicas`` only.
        draft_layers: the EAGLE drafter's layers when vLLM drops its volatile block
            (``use_eagle_block_drop()``); None: no such speculative config.

    Raises:
        InvalidFieldError: bad input, a layer with different specs on two workers, a worker with
            no layer while the model has some (vLLM divides by its zero-byte block), a layout that
            cannot express a worker's page sizes, or what :func:`~kvref.spec.planning.plan_kv_cache`
            rejects.
        KVCacheGroupingError: layers vLLM cannot group.
        InsufficientKVCacheError: some worker cannot hold one ``max_model_len`` request (the first
            such worker's figures), or auto-fit finds no length for the tightest worker.
    """
    if not isinstance(config, EngineConfig):
        raise InvalidFieldError("config", config, "an EngineConfig")
    merged = merge_worker_kv_cache_specs(kv_cache_specs)
    memories = _check_memories(available_memory, len(kv_cache_specs))
    check_layout(kv_cache_layout)
    check_int("tensor_parallel_size", tensor_parallel_size, minimum=1)
    shards = _check_tp_shards(max_tp_shards)
    workers_layers = [dict(w) for w in kv_cache_specs]
    if merged:
        for i, w in enumerate(workers_layers):
            if not w:
                raise InvalidFieldError(f"kv_cache_specs[{i}]", w,
                                        "at least one layer (vLLM sizes a worker without layers at 0 bytes per block)")

    global_groups = get_kv_cache_groups_for_layout(merged, config.disable_hybrid_kv_cache_manager, kv_cache_layout)
    if merged:
        check_exact_partition(global_groups, merged)
    if draft_layers is not None:
        global_groups = mark_eagle_groups(global_groups, draft_layers)
    projected = [project_kv_cache_groups_to_worker(global_groups, w) for w in workers_layers]
    for groups in projected:
        if groups:
            validate_kv_cache_layout(kv_cache_layout, groups)  # vLLM: in each worker's block-size probe
    bpbs = [pool_bytes_per_block(groups) if groups else 0 for groups in projected]
    if config.num_gpu_blocks_override is not None:
        memories = [config.num_gpu_blocks_override * b if groups else m
                    for groups, b, m in zip(projected, bpbs, memories)]
    check_memories = [m - b if groups else m for groups, b, m in zip(projected, bpbs, memories)]

    original = config.resolved_max_model_len
    max_model_len = original
    if config.auto_fit and any(projected):
        fitted = min(estimate_max_model_len(groups, config, cm, original)
                     for groups, cm in zip(projected, check_memories) if groups)
        if fitted <= 0:
            from .pool_sizing import auto_fit_max_model_len

            tightest = next(i for i, (g, cm) in enumerate(zip(projected, check_memories))
                            if g and estimate_max_model_len(g, config, cm, original) <= 0)
            auto_fit_max_model_len(projected[tightest], config, check_memories[tightest], original)  # raises
        max_model_len = min(fitted, original)
    for groups, cm in zip(projected, check_memories):
        if groups:
            check_enough_kv_cache_memory(groups, config, cm, max_model_len)

    own = [m // b if groups else 1 for groups, b, m in zip(projected, bpbs, memories)]
    num_blocks = min(own)
    replicas = [kv_cache_groups_tp_replicas(groups, tensor_parallel_size, config.dcp_world_size, shards,
                                            global_groups) for groups in projected]
    workers = tuple(WorkerPlan(groups, b, m, cm, o, b * num_blocks if groups else 0, r)
                    for groups, b, m, cm, o, r in zip(projected, bpbs, memories, check_memories, own, replicas))
    if not global_groups:  # attention-free: one null block, nothing scheduled
        return ParallelKVCachePlan(global_groups, workers, num_blocks, max_model_len, config.auto_fit, (),
                                   None, None, None, None, None, config)
    sched = scheduler_view(projected[0])
    concurrency = max_concurrency(sched, config, max_model_len, num_blocks)
    sbs, hbs = resolve_kv_cache_block_sizes(sched, config)
    return ParallelKVCachePlan(
        global_groups, workers, num_blocks, max_model_len, config.auto_fit, sched, sbs, hbs,
        resolve_cache_hit_alignment_tokens(sched, config, sbs, hbs), concurrency,
        int(concurrency * max_model_len) if concurrency != float("inf") else -1, config)
