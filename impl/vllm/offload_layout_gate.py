"""vLLM 0.33.0's ``build_offloading_config`` on a generated layer set and parallel shape, in the
terms of :mod:`kvref.impl.reference.offload.parallel_layout`: the offloaded group ids, a worker's
bytes per block, ``is_parallelism_agnostic`` and ``replicated_layout`` (or vLLM's refusal) (#22).

The layer set becomes vLLM's own spec classes (``FullAttentionSpec``, ``SlidingWindowSpec``,
``ChunkedLocalAttentionSpec``, ``MLAAttentionSpec``, ``SlidingWindowMLASpec``,
``HiddenStateCacheSpec``, ``MambaSpec``, ``CircularBufferSpec``) in ``KVCacheGroupSpec``s (a shared
spec or a ``UniformTypeKVCacheSpecs``) of a ``KVCacheConfig``; the engine's configuration is the
few fields ``build_offloading_config`` reads.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kvref.impl.reference.offload.parallel_layout import OffloadGroup, OffloadLayer, OffloadParallel

_DTYPES = {1: "int8", 2: "float16", 4: "float32"}


def vllm_spec(layer: OffloadLayer) -> Any:
    """``layer`` as vLLM's spec class, with a page of ``layer.page_size_bytes`` bytes."""
    import torch
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        CircularBufferSpec,
        FullAttentionSpec,
        HiddenStateCacheSpec,
        KVQuantMode,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
    )

    bs, heads = layer.block_size, layer.num_kv_heads
    quant = KVQuantMode.INT8_PER_TOKEN_HEAD if layer.per_token_head else KVQuantMode.NONE
    if layer.kind == "mamba":
        return MambaSpec(block_size=bs, shapes=((layer.page_size_bytes,),), dtypes=(torch.int8,))
    common = dict(block_size=bs, dtype=torch.int8, kv_quant_mode=quant)
    if layer.kind in ("mla", "swa_mla", "hidden_state"):
        cls = {"mla": MLAAttentionSpec, "hidden_state": HiddenStateCacheSpec}.get(layer.kind)
        if cls is None:
            return SlidingWindowMLASpec(num_kv_heads=1, head_size=layer.page_size_bytes // bs, sliding_window=2 * bs,
                                        **common)
        return cls(num_kv_heads=1, head_size=layer.page_size_bytes * layer.tokens_per_state // bs,
                   tokens_per_state=layer.tokens_per_state,
                   **common)
    head_size = max(1, layer.page_size_bytes // (2 * bs * heads))
    page = dict(num_kv_heads=heads, head_size=head_size, page_size_padded=layer.page_size_bytes, **common)
    if layer.kind == "swa":
        return SlidingWindowSpec(sliding_window=2 * bs, **page)
    if layer.kind == "chunked":
        return ChunkedLocalAttentionSpec(attention_chunk_size=2 * bs, **page)
    if layer.kind == "circular":
        return CircularBufferSpec(**page)
    return FullAttentionSpec(**page)


def vllm_required_layout(hisparse: bool) -> str | None:
    """The layout vLLM's engine takes from the OffloadingConnector (``get_kv_connector_cache_layout``
    through the connector factory), with or without a HiSparse attention config."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_kv_connector_cache_layout

    vc = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector="OffloadingConnector", kv_connector_module_path=None),
        attention_config=SimpleNamespace(hisparse_config=SimpleNamespace() if hisparse else None))
    return get_kv_connector_cache_layout(vc)


def vllm_offloading_gate(groups: list[OffloadGroup], par: OffloadParallel, canonical: bool, num_blocks: int,
                         tensor_bytes: int | None, hisparse_host: bool = False) -> dict | str:
    """vLLM's answer as ``{"group_ids", "worker_kv_bytes_per_block", "parallelism_agnostic",
    "replicated_layout"}``, or its refusal's text."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config
    from vllm.v1.kv_cache_interface import (
        KVCacheConfig,
        KVCacheGroupRole,
        KVCacheGroupSpec,
        KVCacheTensor,
        UniformTypeKVCacheSpecs,
    )

    kv_groups = []
    for gi, g in enumerate(groups):
        names = [f"g{gi}.l{li}" for li in range(len(g.layers))]
        if g.uniform:
            spec = UniformTypeKVCacheSpecs(block_size=g.layers[0].block_size,
                                           kv_cache_specs={n: vllm_spec(x) for n, x in zip(names, g.layers)})
        else:
            spec = vllm_spec(g.layers[0])
        role = KVCacheGroupRole.HISPARSE_INDEXER if g.hisparse_indexer else KVCacheGroupRole.DEFAULT
        kv_groups.append(KVCacheGroupSpec(names, spec, enable_kv_transfer=g.transfer, role=role))
    tensors = [] if tensor_bytes is None else [KVCacheTensor(size=tensor_bytes, layers=["g0.l0"], layer_stride=0,
                                                                 block_stride=max(1, tensor_bytes // max(1, num_blocks)))]
    kcfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=kv_groups,
                         kv_tp_replicas=par.kv_tp_replicas,
                         hisparse_host_num_blocks=num_blocks if hisparse_host else None)
    vc = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={"canonical_layout": canonical},
                                           engine_id="kvref"),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=par.tp, decode_context_parallel_size=par.dcp, prefill_context_parallel_size=par.pcp,
            pipeline_parallel_size=par.pp, world_size=par.world, distributed_executor_backend=par.backend,
            nnodes_within_dp=par.nnodes, rank=0, data_parallel_index=0, data_parallel_size=1,
            data_parallel_rank_local=0),
        model_config=SimpleNamespace(use_mla=par.use_mla, get_total_num_kv_heads=lambda: par.total_kv_heads,
                                     model="kvref", dtype="int8", max_model_len=1024),
        cache_config=SimpleNamespace(block_size=groups[0].layers[0].block_size, prefix_match_unit=None,
                                     enable_prefix_caching=True, cache_dtype="auto", kv_cache_layout="LBHNC",
                                     mamba_cache_mode="none"),
        use_v2_model_runner=par.v2_runner, kv_events_config=None)
    try:
        out = build_offloading_config(vc, kcfg)
    except ValueError as exc:
        return f"ValueError: {exc}"
    return {"group_ids": tuple(g.group_id for g in out.groups),
            "worker_kv_bytes_per_block": out.worker_kv_bytes_per_block,
            "parallelism_agnostic": out.parallel.is_parallelism_agnostic,
            "replicated_layout": out.replicated_layout}
