"""Run vLLM 0.33.0's startup planning over several workers (pipeline + tensor parallel) in-process.

What ``EngineCore._initialize_kv_caches`` does with one ``kv_cache_specs`` dict per worker:
``get_global_kv_cache_groups`` (merge the workers' layers, group the whole model) →
``get_kv_cache_configs`` (project the groups onto each worker, override, auto-fit, per-worker
check, smallest block count for all, ``kv_tp_replicas``) → ``generate_scheduler_kv_cache_config``
→ ``update_kv_cache_capacity`` → ``resolve_kv_cache_block_sizes``. The settings go through
:class:`~kvref.impl.vllm.planning.VllmPlanner` (one ``VllmConfig``); ``tensor_parallel_size`` and
each attention layer's ``max_tp_shards`` are set for the call.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Mapping, Sequence

from kvref.spec import EngineConfig, KVCacheSpec

from .planning import Outcome, VllmPlanner, _kvref_attempt, vllm_kv_cache_tensors


def _strip_tp_shards(kci: Any, spec: Any) -> Any:
    """A vLLM spec without ``max_tp_shards`` (kvref's specs carry none; kv_tp_replicas compares it)."""
    if isinstance(spec, kci.UniformTypeKVCacheSpecs):
        return kci.UniformTypeKVCacheSpecs(block_size=spec.block_size, kv_cache_specs={
            n: _strip_tp_shards(kci, s) for n, s in spec.kv_cache_specs.items()})
    if isinstance(spec, kci.AttentionSpec) and spec.max_tp_shards is not None:
        return dataclasses.replace(spec, max_tp_shards=None)
    return spec


def _groups(kci: Any, groups: Sequence[Any]) -> list[tuple[tuple[str, ...], Any, bool]]:
    return [(tuple(g.layer_names), _strip_tp_shards(kci, g.kv_cache_spec), g.is_eagle_group) for g in groups]


def plan_workers(planner: VllmPlanner, workers: Sequence[Mapping[str, KVCacheSpec]], config: EngineConfig,
                 available_memory: Sequence[int], extra_retained_tokens: int, kv_cache_layout: str = "LBNHC",
                 tensor_parallel_size: int = 1, max_tp_shards: Mapping[str, int] | None = None,
                 draft_layers: Sequence[str] | None = None) -> Outcome:
    """vLLM's plan for ``workers`` (one layer dict per PP stage × TP rank), normalised.

    ``draft_layers``: layers whose vLLM spec says ``is_draft``, planned under a speculative config
    whose ``use_eagle_block_drop()`` is true (a stand-in object: planning reads only that, and the
    ``method`` a warning names)."""
    planner.configure(config)
    vc, planning, utils, kci = planner.vc, planner.planning, planner.utils, planner.kci
    vc.cache_config.kv_cache_layout = kv_cache_layout
    shards = dict(max_tp_shards or {})

    def convert(name: str, spec: KVCacheSpec) -> Any:
        theirs = planner.to_vllm(spec)
        if name in shards and isinstance(theirs, kci.AttentionSpec):
            theirs = dataclasses.replace(theirs, max_tp_shards=shards[name])
        if draft_layers is not None and name in draft_layers:
            theirs = dataclasses.replace(theirs, is_draft=True)
        return theirs

    specs = [{n: convert(n, s) for n, s in w.items()} for w in workers]
    cls = type(vc)
    saved = cls.__dict__["num_prefill_lookahead_tokens"]
    saved_tp = vc.parallel_config.tensor_parallel_size
    cls.num_prefill_lookahead_tokens = property(lambda self: extra_retained_tokens + 1 if extra_retained_tokens else 0)
    vc.parallel_config.tensor_parallel_size = tensor_parallel_size
    saved_spec = vc.speculative_config
    if draft_layers is not None:
        vc.speculative_config = types.SimpleNamespace(use_eagle_block_drop=lambda: True, method="eagle")
    try:
        global_groups = planning.get_global_kv_cache_groups(vc, [dict(s) for s in specs])
        cfgs = planning.get_kv_cache_configs(vc, [dict(s) for s in specs], list(available_memory), global_groups)
        sched = utils.generate_scheduler_kv_cache_config(cfgs)
        fields: dict[str, Any] = dict(
            global_groups=_groups(kci, global_groups), max_model_len=vc.model_config.max_model_len,
            num_blocks=[c.num_blocks for c in cfgs],
            worker_groups=[_groups(kci, c.kv_cache_groups) for c in cfgs],
            worker_bytes_per_block=[planning._pool_bytes_per_block(vc, c.kv_cache_groups) if c.kv_cache_groups else 0
                                    for c in cfgs],
            tensor_bytes=[sorted({t.size for t in c.kv_cache_tensors}) for c in cfgs],
            # every worker's tensors, re-planned at the common block count (#22)
            kv_cache_tensors=[vllm_kv_cache_tensors(c) for c in cfgs],
            kv_tp_replicas=[c.kv_tp_replicas for c in cfgs])
        if sched.kv_cache_groups:  # an attention-free model schedules nothing (EngineCore skips capacity)
            participating = [g.kv_cache_spec.block_size for g in sched.kv_cache_groups
                             if g.kv_cache_spec.prefix_cacheable]
            vc.cache_config.block_size = min(participating or [g.kv_cache_spec.block_size
                                                               for g in sched.kv_cache_groups])
            utils.update_kv_cache_capacity(vc, sched)
            sbs, hbs = utils.resolve_kv_cache_block_sizes(sched, vc)
            fields.update(scheduler_groups=_groups(kci, sched.kv_cache_groups), scheduler_block_size=sbs,
                          hash_block_size=hbs,
                          cache_hit_alignment_tokens=utils.resolve_cache_hit_alignment_tokens(sched, vc, sbs, hbs),
                          max_concurrency=vc.cache_config.kv_cache_max_concurrency,
                          kv_cache_size_tokens=vc.cache_config.kv_cache_size_tokens)
    except ValueError as exc:
        return planner._classify(exc)
    except (NotImplementedError, StopIteration):
        return Outcome("grouping")
    except AssertionError as exc:
        msg = str(exc)
        if "different across workers" in msg:
            return Outcome("invalid", "kv_cache_specs")
        if "KV cache groups miss layers" in msg:
            return Outcome("grouping")
        if "DCP not support sliding window" in msg:
            return Outcome("invalid", "dcp_world_size")
        if "Page padding requires dimensions" in msg:
            return Outcome("invalid", "kv_cache_layout")
        raise
    finally:
        cls.num_prefill_lookahead_tokens = saved
        vc.parallel_config.tensor_parallel_size = saved_tp
        vc.speculative_config = saved_spec
    return Outcome("ok", fields=fields)


def kvref_workers_outcome(planner: VllmPlanner, workers, config, available_memory, kv_cache_layout: str = "LBNHC",
                          tensor_parallel_size: int = 1, max_tp_shards=None, draft_layers=None) -> Outcome:
    """kvref's :func:`~kvref.spec.planning_parallel.plan_kv_cache_workers` in the same normalised form."""
    from kvref.spec.kv_cache_tensors import kv_cache_tensors
    from kvref.spec.planning_parallel import plan_kv_cache_workers

    plan, refused = _kvref_attempt(plan_kv_cache_workers, workers, config, available_memory,
                                   kv_cache_layout=kv_cache_layout, tensor_parallel_size=tensor_parallel_size,
                                   max_tp_shards=max_tp_shards, draft_layers=draft_layers)
    if refused:
        if refused.status == "invalid" and refused.detail.startswith("kv_cache_specs["):
            return Outcome("invalid", "kv_cache_specs")
        return refused
    plan.check_invariants()

    def groups(gs):
        return [(g.layer_names, planner.to_vllm(g.kv_cache_spec), g.is_eagle_group) for g in gs]

    fields: dict[str, Any] = dict(
        global_groups=groups(plan.global_groups), max_model_len=plan.max_model_len,
        num_blocks=[plan.num_blocks] * len(plan.workers),
        worker_groups=[groups(w.groups) for w in plan.workers],
        worker_bytes_per_block=[w.bytes_per_block for w in plan.workers],
        tensor_bytes=[[w.tensor_bytes] if w.groups else [] for w in plan.workers],
        kv_cache_tensors=[kv_cache_tensors(w.groups, plan.num_blocks, kv_cache_layout) for w in plan.workers],
        kv_tp_replicas=[w.kv_tp_replicas for w in plan.workers])
    if plan.scheduler_groups:
        fields.update(scheduler_groups=groups(plan.scheduler_groups), scheduler_block_size=plan.scheduler_block_size,
                      hash_block_size=plan.hash_block_size, cache_hit_alignment_tokens=plan.cache_hit_alignment_tokens,
                      max_concurrency=plan.max_concurrency, kv_cache_size_tokens=plan.kv_cache_size_tokens)
    return Outcome("ok", fields=fields)
