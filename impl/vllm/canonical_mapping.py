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


def strided_tensor(kind: str, block_size: int, heads: int, head_size: int, elem_size: int,
                   strides: tuple[int, ...]):
    """A layer tensor of ``kind``'s shape whose page dims have the given element ``strides``
    (split: (K/V half, token, head, x); packed: (head, token, x)) and whose blocks follow each other,
    so vLLM recognizes (or refuses) its layout from these strides alone."""
    import torch

    dims = (2, block_size, heads, head_size) if kind == "split" else (heads, block_size, 2 * head_size)
    block = 1 + sum((n - 1) * st for n, st in zip(dims, strides))
    storage = torch.zeros(NUM_BLOCKS * block, dtype=getattr(torch, _DTYPES[elem_size]))
    return storage.as_strided((NUM_BLOCKS, *dims), (block, *strides))


def vllm_mappings(page: AttentionPage | None, total_kv_heads: int, tp_size: int, *, block_size: int,
                  heads: int, head_size: int, elem_size: int, mla: bool = False,
                  world_size: int | None = None, dcp: int = 1, pcp: int = 1, interleave: int = 1,
                  layer_kind: str | None = None, kind: str | None = None, strides: tuple[int, ...] | None = None,
                  tensor_elem: int | None = None, per_token_head: bool = False, tensor_form: str = "tensor",
                  mla_tokens_per_state: int = 1, uniform: bool = False,
                  page_size_padded: int | None = None) -> list[ReferenceMapping | None]:
    """Every rank's mapping of one layer as vLLM derives it, over the ``tp x pcp`` grid (None where
    vLLM returns none: a worker group that is not exactly that grid, a layer with no canonical page).

    ``layer_kind``: ``"attention"`` (default; ``"mla"`` when ``mla``), ``"mla"``, ``"mamba"`` or
    ``"other"`` (a HiSparse resident page); ``kind`` + ``strides``: the attention tensor's page kind and
    element strides (else ``page``'s dense layout); ``tensor_elem``: the tensor's element size when
    it differs from the spec's; ``tensor_form``: ``"tensor"``, ``"list"`` (several tensors) or
    ``"absent"``; ``uniform``: the group's spec is a ``UniformTypeKVCacheSpecs``."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import derive_canonical_mappings
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        HiSparseResidentSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVQuantMode,
        MambaSpec,
        MLAAttentionSpec,
        UniformTypeKVCacheSpecs,
    )

    dtype = getattr(torch, _DTYPES[elem_size])
    layer_kind = layer_kind or ("mla" if mla else "attention")
    quant = KVQuantMode.INT8_PER_TOKEN_HEAD if per_token_head else KVQuantMode.NONE
    if layer_kind == "mla":
        spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=head_size, dtype=dtype,
                                kv_quant_mode=quant, tokens_per_state=mla_tokens_per_state)
        tensor = torch.zeros(NUM_BLOCKS, block_size, head_size, dtype=dtype)
    elif layer_kind == "mamba":
        spec = MambaSpec(block_size=block_size, shapes=((heads, head_size), (block_size,)), dtypes=(dtype, dtype),
                         page_size_padded=page_size_padded)
        tensor = [torch.zeros(NUM_BLOCKS, heads, head_size, dtype=dtype)]
    elif layer_kind == "other":
        spec = HiSparseResidentSpec(block_size=block_size, page_size=block_size * head_size * elem_size)
        tensor = torch.zeros(NUM_BLOCKS, block_size * head_size, dtype=dtype)
    else:
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=dtype,
                                 kv_quant_mode=quant, page_size_padded=page_size_padded)
        elem = tensor_elem or elem_size
        if kind is not None and strides is not None:
            tensor = strided_tensor(kind, block_size, heads, head_size, elem, strides)
        else:
            tensor = layer_tensor(page, block_size, heads, head_size, elem)
    if tensor_form == "list":
        tensor = [tensor, tensor]
    group_spec = UniformTypeKVCacheSpecs(block_size=block_size, kv_cache_specs={"layer": spec}) if uniform else spec
    kcfg = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(["layer"], group_spec)])
    caches = {} if tensor_form == "absent" else {"layer": tensor}
    out = []
    for rank in range(tp_size * pcp):
        vc = SimpleNamespace(
            parallel_config=SimpleNamespace(tensor_parallel_size=tp_size, prefill_context_parallel_size=pcp,
                                            decode_context_parallel_size=dcp, cp_kv_cache_interleave_size=interleave,
                                            world_size=world_size or tp_size * pcp, rank=rank),
            model_config=SimpleNamespace(get_total_num_kv_heads=lambda: total_kv_heads))
        m = derive_canonical_mappings(vc, kcfg, caches).get("layer")
        out.append(None if m is None else _expand(m))
    return out
