"""vLLM 0.33.0's whole startup sizing of a HiSparse model, driven as ``EngineCore`` does (#22/#23).

On the planner's ``VllmConfig`` (:class:`kvref.impl.vllm.planning.VllmPlanner`) the call sets what a
HiSparse deployment sets: ``attention_config.hisparse_config``, a ``HiSparseConnector`` with
``host_pool_gib`` (or none), the model's ``index_topk`` and the resolved KV-cache layout. The layer
specs are what the worker reports after ``resolve_hisparse_specs``: the sparse-MLA and indexer
layers plus the resident/hot specs HiSparse derives from them (vLLM's own
``get_hisparse_kv_cache_groups`` derives them here; the backend block-size selection that precedes
it needs the GPU backends and is out of reach). Then exactly the engine's calls:
``get_global_kv_cache_groups`` → ``get_kv_cache_configs`` → ``generate_scheduler_kv_cache_config``
→ ``update_kv_cache_capacity``, and the HiSparseConnector's ``get_hisparse_steady_state_concurrency``.
Every setting is restored afterwards, so the planner serves other cases.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence


def _classify(message: str) -> str:
    """The spec field naming the rule behind one of vLLM's HiSparse startup rejections."""
    rules = (("Cannot auto-fit", "auto_fit_failed"), ("No available memory", "no_memory"),
             ("To serve at least one request", "too_long"),
             ("requires sparse-MLA and indexer", "indexer_page"), ("device_buffer_size", "device_buffer_size"),
             ("hot-cache groups require one page size", "source_layers"),
             ("requires HiSparseConnector with host_pool_gib", "host_pool_gib"),
             ("host", "host_budget"), ("cannot express", "kv_cache_layout"), ("block-outermost", "kv_cache_layout"))
    for text, rule in rules:
        if text in message:
            return rule
    return f"unrecognised: {message}"


def vllm_hisparse_plan(planner: Any, source: Sequence[tuple[str, int, bool]], indexer: Sequence[tuple[str, int]],
                       block_size: int, top_k: int, device_buffer_size: int | None, host_budget: int | None,
                       config: Any, available_memory: int, kv_cache_layout: str) -> dict[str, Any]:
    """vLLM's plan of the layers (source ``(name, head_size, leader)``, indexer ``(name, head_size)``,
    one byte per element) under ``config`` (a :class:`kvref.spec.EngineConfig`), normalised to ints.

    ``{"error": rule, "estimated_max_model_len": n}`` when vLLM rejects it, else the device groups,
    pools, tensors and the three capacity figures.
    """
    from vllm.config import KVTransferConfig
    from vllm.config.attention import HiSparseConfig
    from vllm.v1.hisparse.layout import get_hisparse_kv_cache_groups, get_hisparse_steady_state_concurrency
    from vllm.v1.kv_cache_interface import HiSparseHotSpec, HiSparseResidentSpec

    from kvref.impl.vllm.hisparse_layout import vllm_sparse_mla_specs

    specs = vllm_sparse_mla_specs(source, indexer, block_size)
    vc, planning, utils = planner.vc, planner.planning, planner.utils
    planner.configure(config)
    hf = vc.model_config.hf_config
    saved = (vc.attention_config.hisparse_config, getattr(hf, "index_topk", None), vc.cache_config.kv_cache_layout)
    vc.attention_config.hisparse_config = HiSparseConfig(device_buffer_size=device_buffer_size)
    vc.kv_transfer_config = None if host_budget is None else KVTransferConfig(
        kv_connector="HiSparseConnector", kv_role="kv_both",
        kv_connector_extra_config={"host_pool_gib": host_budget / 2**30})
    hf.index_topk = top_k
    vc.cache_config.kv_cache_layout = kv_cache_layout
    # the unaligned-buffer warning and the capacity lines are advice to an operator, not observables
    logging.getLogger("vllm").setLevel(logging.ERROR)
    try:
        try:
            derived = get_hisparse_kv_cache_groups(vc, dict(specs))
            specs |= {n: g.kv_cache_spec for g in derived or ()
                      if isinstance(g.kv_cache_spec, (HiSparseResidentSpec, HiSparseHotSpec)) for n in g.layer_names}
            groups = planning.get_global_kv_cache_groups(vc, [dict(specs)])
            cfgs = planning.get_kv_cache_configs(vc, [dict(specs)], [available_memory], groups)
        except ValueError as exc:
            import re

            m = re.search(r"estimated maximum model length is (\d+)", str(exc))
            return {"error": _classify(str(exc)), "estimated_max_model_len": int(m.group(1)) if m else 0}
        worker = cfgs[0]
        sched = utils.generate_scheduler_kv_cache_config(cfgs)
        utils.update_kv_cache_capacity(vc, sched)
        device = []
        for g in worker.kv_cache_groups:
            if g.host_resident:
                continue
            spec = g.kv_cache_spec
            kind = {"HiSparseResidentSpec": "resident", "HiSparseHotSpec": "hot"}.get(type(spec).__name__, "indexer")
            device.append((kind, tuple(g.layer_names), spec.page_size_bytes, getattr(spec, "blocks_per_request", None)))
        return {
            "device_groups": tuple(device),
            "bytes_per_block": planning._pool_bytes_per_block(vc, worker.kv_cache_groups),
            "num_blocks": worker.num_blocks, "host_num_blocks": worker.hisparse_host_num_blocks,
            "host_block_stride": worker.hisparse_host_block_stride, "max_model_len": vc.model_config.max_model_len,
            "tensors": tuple((t.size, tuple(t.layers), t.layer_stride, t.block_stride, t.offset, t.host_resident)
                             for t in worker.kv_cache_tensors),
            "max_concurrency": vc.cache_config.kv_cache_max_concurrency,
            "kv_cache_size_tokens": vc.cache_config.kv_cache_size_tokens,
            "steady_state_concurrency": get_hisparse_steady_state_concurrency(vc, sched),
        }
    finally:
        vc.attention_config.hisparse_config = saved[0]
        hf.index_topk = saved[1]  # None: no other planning path reads it
        vc.cache_config.kv_cache_layout = saved[2]
        vc.kv_transfer_config = None
