"""vLLM 0.33.0's canonical page mappings (``offloading/canonical_mapping.derive_canonical_mappings``)
for one attention layer, every rank, in the reference's terms
(:class:`kvref.impl.reference.offload.canonical_mapping.ReferenceMapping`: the canonical byte of
every local byte), so the two can be compared byte for byte.

The layer's KV cache tensor is built as vLLM's attention backends shape it — ``(num_blocks, 2,
block_size, heads, head_size)`` for split K/V pages, ``(num_blocks, heads, block_size,
2*head_size)`` for packed ones — with NHD or HND strides; vLLM recognizes the layout from the
shape and strides alone.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kvref.impl.reference.offload.canonical_mapping import AttentionPage, ReferenceMapping

_DTYPES = {1: "int8", 2: "float16", 4: "float32"}
NUM_BLOCKS = 3


def layer_tensor(page: AttentionPage | None, block_size: int, heads: int, head_size: int, elem_size: int):
    """The layer's KV cache tensor in ``page``'s layout (None: a layout vLLM does not recognize,
    flat ``(num_blocks, page elements)`` pages)."""
    import torch

    dtype = getattr(torch, _DTYPES[elem_size])
    nb, bs, h, hs = NUM_BLOCKS, block_size, heads, head_size
    if page is None:
        return torch.zeros(nb, 2 * bs * h * hs, dtype=dtype)
    if page.kind == "split":
        if page.order == "NHD":
            return torch.zeros(nb, 2, bs, h, hs, dtype=dtype)
        return torch.zeros(nb, 2, h, bs, hs, dtype=dtype).permute(0, 1, 3, 2, 4)
    if page.order == "HND":
        return torch.zeros(nb, h, bs, 2 * hs, dtype=dtype)
    return torch.zeros(nb, bs, h, 2 * hs, dtype=dtype).permute(0, 2, 1, 3)


def _expand(mapping: Any) -> ReferenceMapping:
    """vLLM's runs as a byte map; a local byte covered twice or never is ``-1`` there (the reference
    never has one)."""
    byte_map = [-1] * mapping.local_page_size_bytes
    seen = set()
    for run in mapping.runs:
        for i in range(run.num_fragments):
            for b in range(run.fragment_size):
                local = run.local_offset + i * run.local_stride + b
                if local in seen or not 0 <= local < len(byte_map):
                    byte_map[local % max(1, len(byte_map))] = -1
                    continue
                seen.add(local)
                byte_map[local] = run.canonical_offset + i * run.canonical_stride + b
    return ReferenceMapping(mapping.canonical_page_size_bytes, mapping.local_page_size_bytes, tuple(byte_map),
                            mapping.num_writers, mapping.writer_index, mapping.parallelism_agnostic)


def vllm_mappings(page: AttentionPage | None, total_kv_heads: int, tp_size: int, *, block_size: int,
                  heads: int, head_size: int, elem_size: int, mla: bool = False,
                  world_size: int | None = None) -> list[ReferenceMapping | None]:
    """Every rank's mapping of one layer as vLLM derives it (None where vLLM returns none: a worker
    group that is not exactly the TP grid)."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import derive_canonical_mappings
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec

    dtype = getattr(torch, _DTYPES[elem_size])
    if mla:
        spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=head_size, dtype=dtype)
        tensor = torch.zeros(NUM_BLOCKS, block_size, head_size, dtype=dtype)
    else:
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=dtype)
        tensor = layer_tensor(page, block_size, heads, head_size, elem_size)
    kcfg = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    out = []
    for rank in range(tp_size):
        vc = SimpleNamespace(
            parallel_config=SimpleNamespace(tensor_parallel_size=tp_size, prefill_context_parallel_size=1,
                                            decode_context_parallel_size=1, cp_kv_cache_interleave_size=1,
                                            world_size=world_size or tp_size, rank=rank),
            model_config=SimpleNamespace(get_total_num_kv_heads=lambda: total_kv_heads))
        m = derive_canonical_mappings(vc, kcfg, {"layer": tensor}).get("layer")
        out.append(None if m is None else _expand(m))
    return out
