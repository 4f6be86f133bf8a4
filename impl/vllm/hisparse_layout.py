"""vLLM 0.33.0's HiSparse startup layout (``v1/hisparse/layout.py``), driven on plain layer sets (#22/#23).

Builds vLLM's own ``MLAAttentionSpec`` per layer (sparse and indexer roles, index-group leaders)
and calls ``_lay_out_hisparse_groups`` then ``create_hisparse_layout``, the two pure steps of
``get_hisparse_kv_cache_groups``/``get_hisparse_kv_cache_config`` that need no GPU tensor. The
``vllm_config`` is a namespace holding only the fields those steps read (attention's
``hisparse_config``, the model's ``index_topk`` and ``max_model_len``, the parallel config and
no speculative config). The outcome is normalised to plain names and ints for
:mod:`kvref.spec.hisparse_layout` to be compared with.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Sequence


def vllm_sparse_mla_specs(source: Sequence[tuple[str, int, bool]], indexer: Sequence[tuple[str, int]],
                          block_size: int) -> dict[str, Any]:
    """vLLM's own ``MLAAttentionSpec`` per layer: ``source`` (name, head_size, index-group leader)
    with the sparse role, ``indexer`` (name, head_size) with the indexer role, uint8 pages."""
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SparseCacheRole

    specs: dict[str, Any] = {}
    for name, head, leader in source:
        specs[name] = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=head, dtype=torch.uint8,
                                       cache_role=SparseCacheRole.SPARSE, is_index_group_leader=leader)
    for name, head in indexer:
        specs[name] = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=head, dtype=torch.uint8,
                                       cache_role=SparseCacheRole.INDEXER)
    return specs


#: ways a first group breaks vLLM's HiSparse partition checks (kvref.spec.hisparse_layout.check_hisparse_first_group)
FLAWS = ("block_size", "deepseek_v4", "full_attention")


def _spoil(specs: dict[str, Any], flaw: str | None, block_size: int) -> None:
    import dataclasses

    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    names = list(specs)
    if flaw == "block_size":
        specs[names[-1]] = dataclasses.replace(specs[names[-1]], block_size=2 * block_size)
    elif flaw == "deepseek_v4":
        specs[names[0]] = dataclasses.replace(specs[names[0]], model_version="deepseek_v4")
    elif flaw == "full_attention":
        specs["model.layers.extra.attn"] = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=64,
                                                             dtype=torch.uint8)
    elif flaw is not None:
        raise ValueError(f"flaw={flaw!r}: one of {FLAWS}")


def vllm_hisparse_layout(source: Sequence[tuple[str, int, bool]], indexer: Sequence[tuple[str, int]],
                         block_size: int, top_k: int, device_buffer_size: int | None, host_budget: int,
                         max_model_len: int, flaw: str | None = None) -> dict[str, Any]:
    """vLLM's layout of ``source`` (name, head_size, leader) and ``indexer`` (name, head_size) layers.

    ``flaw`` spoils the first group the way :data:`FLAWS` says (the last layer at twice the block
    size, the first source layer a DeepSeek-V4 MLA spec, or one full-attention layer beside them).

    Returns ``{"error": message}`` when vLLM rejects it, else the groups as
    ``(role, layer names, page_size, blocks_per_request)`` and the host pool's block count/stride.
    """
    import logging

    from vllm.v1.hisparse.layout import _lay_out_hisparse_groups, create_hisparse_layout
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, UniformTypeKVCacheSpecs

    specs = vllm_sparse_mla_specs(source, indexer, block_size)
    _spoil(specs, flaw, block_size)
    parallel = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, prefill_context_parallel_size=1,
                               decode_context_parallel_size=1, world_size=1, distributed_executor_backend="mp",
                               nnodes_within_dp=1)
    cfg = SimpleNamespace(
        attention_config=SimpleNamespace(hisparse_config=SimpleNamespace(device_buffer_size=device_buffer_size,
                                                                        eager_host_mirror=True)),
        model_config=SimpleNamespace(hf_config=SimpleNamespace(index_topk=top_k), max_model_len=max_model_len),
        speculative_config=None, parallel_config=parallel)
    group = KVCacheGroupSpec(list(specs), UniformTypeKVCacheSpecs.from_specs(specs))
    # the unaligned-buffer warning is advice to an operator, not an observable here
    logging.getLogger("vllm.v1.hisparse.runtime").setLevel(logging.ERROR)
    try:
        groups = _lay_out_hisparse_groups(cfg, [group])
        laid = create_hisparse_layout(cfg, groups, host_budget)
    except ValueError as exc:
        return {"error": str(exc)}
    out = []
    for g in groups:
        spec = g.kv_cache_spec
        out.append((f"{g.role.name}:{type(spec).__name__}", tuple(g.layer_names),
                    spec.page_size_bytes, getattr(spec, "blocks_per_request", None), g.host_resident,
                    g.enable_kv_transfer))
    return {"groups": out, "host": (laid.host_num_blocks, laid.host_block_stride),
            "device_groups": len(laid.device_groups)}
