"""kvref specs → vLLM specs: the one converter every vLLM adapter uses (#26).

The KV cache manager, the scheduler, startup planning and the tests' twins all build vLLM's
``KVCacheSpec`` / ``KVCacheConfig`` here, so a field is carried (or a dtype mapped) the same way
for all of them. The fields are vLLM's; kvref keeps dtype *names* and vLLM torch dtypes.

Dtype names (:func:`to_torch_dtype`) map as vLLM maps ``--kv-cache-dtype``: through its own
``STR_DTYPE_TO_TORCH_DTYPE`` (every fp8 flavour is stored as ``torch.uint8``, except ``fp8_inc``,
which is ``torch.float8_e4m3fn``). Names outside that table are plain torch dtypes that reach vLLM
as ``torch.dtype`` objects (Mamba state dtypes such as ``float64``), so they map to the torch dtype
of that name. Before #26 there were two converters with two mappings: the KV cache manager's used
vLLM's table only (``float64``/``uint8`` Mamba states raised ``KeyError``); the scheduler's sent
``fp8*`` to ``uint8`` and everything else to ``getattr(torch, name)`` (``fp8_inc`` and
``fp8_ds_mla`` raised ``AttributeError``) and dropped ``head_size_v``, ``page_size_padded``,
``dcp_sharded`` and the Mamba checkpoint fields.
"""

from __future__ import annotations

from typing import Any

from kvref.impl.interface import PoolConfig
from kvref.impl.vllm.loader import load_vllm
from kvref.spec.dtypes import canonical_dtype
from kvref.spec.errors import InvalidFieldError
from kvref.spec.hisparse import HiSparseHotSpec, HiSparseResidentSpec
from kvref.spec.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    HiddenStateCacheSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)


def to_torch_dtype(name: str) -> Any:
    """The torch dtype vLLM stores a KV cache / Mamba state of dtype ``name`` as (see module docstring)."""
    name = canonical_dtype(name)
    v = load_vllm()
    table = v["dtypes"]
    return table[name] if name in table else getattr(v["torch"], name)


def to_vllm_spec(spec: KVCacheSpec) -> Any:
    """The vLLM spec equal to a kvref spec (the dtype names become torch dtypes)."""
    kci = load_vllm()["kci"]
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return kci.UniformTypeKVCacheSpecs(
            block_size=spec.block_size,
            kv_cache_specs={n: to_vllm_spec(s) for n, s in spec.kv_cache_specs.items()})
    if isinstance(spec, MambaSpec):
        return kci.MambaSpec(
            block_size=spec.block_size, shapes=tuple(spec.shapes),
            dtypes=tuple(to_torch_dtype(d) for d in spec.dtypes), page_size_padded=spec.page_size_padded,
            mamba_cache_mode=spec.mamba_cache_mode, num_speculative_blocks=spec.num_speculative_blocks,
            num_prefill_checkpoint_blocks=spec.num_prefill_checkpoint_blocks,
            prefill_checkpoint_alignment=spec.prefill_checkpoint_alignment, dcp_sharded=spec.dcp_sharded)
    if isinstance(spec, HiSparseHotSpec):  # issue #23: HiSparse hot regions
        return kci.HiSparseHotSpec(block_size=spec.block_size, dcp_sharded=spec.dcp_sharded,
                                   page_size=spec.page_size, blocks_per_request=spec.blocks_per_request)
    if isinstance(spec, HiSparseResidentSpec):
        return kci.HiSparseResidentSpec(block_size=spec.block_size, dcp_sharded=spec.dcp_sharded,
                                        page_size=spec.page_size)
    if not isinstance(spec, (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec, CrossAttentionSpec,
                             CircularBufferSpec)):
        raise InvalidFieldError("kv_cache_spec", type(spec).__name__,
                                "FullAttention, MLA, SlidingWindow, ChunkedLocal, CrossAttention, Mamba or "
                                "UniformType spec")
    common = dict(block_size=spec.block_size, dcp_sharded=spec.dcp_sharded, num_kv_heads=spec.num_kv_heads,
                  head_size=spec.head_size, dtype=to_torch_dtype(spec.dtype), head_size_v=spec.head_size_v,
                  page_size_padded=spec.page_size_padded, state_content_bytes=spec.state_content_bytes)
    if isinstance(spec, MLAAttentionSpec):
        cls = kci.HiddenStateCacheSpec if isinstance(spec, HiddenStateCacheSpec) else kci.MLAAttentionSpec
        return cls(**common, cache_dtype_str=spec.cache_dtype_str, alignment=spec.alignment,
                   sliding_window=spec.sliding_window, attention_chunk_size=spec.attention_chunk_size)
    if isinstance(spec, RSWASpec):
        return kci.RSWASpec(**common, sliding_window=spec.sliding_window,
                            attention_chunk_size=spec.attention_chunk_size, rswa_window=spec.rswa_window)
    if isinstance(spec, SinkFullAttentionSpec):
        return kci.SinkFullAttentionSpec(**common, sliding_window=spec.sliding_window,
                                         attention_chunk_size=spec.attention_chunk_size, sink_len=spec.sink_len)
    if isinstance(spec, CircularBufferSpec):
        return kci.CircularBufferSpec(**common)
    if isinstance(spec, FullAttentionSpec):
        return kci.FullAttentionSpec(**common, sliding_window=spec.sliding_window,
                                     attention_chunk_size=spec.attention_chunk_size)
    if isinstance(spec, SlidingWindowMLASpec):  # DeepSeek-V4.1 SWA, bounded replay or not (#22)
        return kci.SlidingWindowMLASpec(**common, sliding_window=spec.sliding_window,
                                        extra_retained_tokens=spec.extra_retained_tokens,
                                        cache_dtype_str=spec.cache_dtype_str, alignment=spec.alignment,
                                        bounded_replay=spec.bounded_replay)
    if isinstance(spec, SlidingWindowSpec):
        return kci.SlidingWindowSpec(**common, sliding_window=spec.sliding_window,
                                     extra_retained_tokens=spec.extra_retained_tokens)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return kci.ChunkedLocalAttentionSpec(**common, attention_chunk_size=spec.attention_chunk_size)
    return kci.CrossAttentionSpec(**common)


def to_vllm_kv_cache_config(pool_config: PoolConfig) -> Any:
    """``KVCacheConfig`` for the scheduler side: groups and ``num_blocks``; no tensors (workers only)."""
    kci = load_vllm()["kci"]
    groups = [kci.KVCacheGroupSpec(list(g.layer_names) or [f"layer_{i}"], to_vllm_spec(g.kv_cache_spec),
                                   is_eagle_group=g.is_eagle_group)
              for i, g in enumerate(pool_config.groups)]
    return kci.KVCacheConfig(num_blocks=pool_config.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups,
                             hash_block_size=pool_config.hash_block_size,
                             prefix_cache_retention_interval=pool_config.prefix_cache_retention_interval)


def kv_cache_manager_kwargs(pool_config: PoolConfig) -> dict[str, Any]:
    """vLLM ``KVCacheManager``'s arguments besides the ``KVCacheConfig``, as ``PoolConfig`` says."""
    return dict(max_model_len=pool_config.max_model_len, scheduler_block_size=pool_config.scheduler_block_size,
                hash_block_size=pool_config.hash_block_size, max_in_flight_tokens=pool_config.max_in_flight_tokens,
                enable_caching=pool_config.enable_caching, use_eagle=pool_config.use_eagle,
                watermark=pool_config.watermark, enable_kv_cache_events=pool_config.enable_kv_cache_events,
                num_hash_lookahead_tokens=pool_config.num_hash_lookahead_tokens, log_stats=pool_config.log_stats,
                num_prefill_lookahead=pool_config.num_prefill_lookahead,
                dcp_world_size=pool_config.dcp_world_size, pcp_world_size=pool_config.pcp_world_size,
                enable_mamba_shared_prefix_checkpoint=pool_config.enable_mamba_shared_prefix_checkpoint)


def build_kv_cache_manager(pool_config: PoolConfig) -> Any:
    """vLLM's own ``KVCacheManager`` built exactly as ``PoolConfig`` says: the one manager builder
    of the adapters (:class:`~kvref.impl.vllm.kv_cache_manager.VllmKVCacheManager`, the scheduler's
    shim) and of the tests' twins."""
    if not isinstance(pool_config, PoolConfig):
        raise InvalidFieldError("pool_config", pool_config, "a kvref.impl.interface.PoolConfig")
    return load_vllm()["KVCacheManager"](to_vllm_kv_cache_config(pool_config), **kv_cache_manager_kwargs(pool_config))
