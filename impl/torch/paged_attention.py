"""Paged attention through block tables, and the dense attention it must equal.

``paged_attention`` reads each request's keys and values through its block table row
(``block = table[row, pos // block_size]``, ``offset = pos % block_size``), so the numbers are
only right if the bookkeeping is: a block freed too early (its row entry nulled, or the block
handed to another request and overwritten), shared wrongly, or restored from the wrong offload
slot shows up as an output that differs from ``dense_attention`` over the contiguous sequence.

Masks (``AttentionMask``): ``causal`` (key ``j <= p``), ``sliding_window`` (``p - w < j <= p``,
the ``w`` most recent tokens including itself, as vLLM's ``get_num_skipped_tokens`` assumes) and
``chunked_local`` (``j`` in the same ``attention_chunk_size`` chunk as ``p``, ``j <= p``).

Precision: half types accumulate in float32, float32 in float32, float64 in float64. Tolerances
used by the tests (paged vs dense on the same stored K/V): float64 1e-10 (near exact: only the
summation order over masked padding differs), float32 1e-5, float16 1e-2, bfloat16 2e-2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvref.spec.errors import InvalidFieldError, check_int
from kvref.spec.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}

KINDS = ("causal", "sliding_window", "chunked_local")


@dataclass(frozen=True)
class AttentionMask:
    kind: str = "causal"
    size: int = 0  # window (sliding_window) or chunk (chunked_local)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidFieldError("AttentionMask.kind", self.kind, "one of " + ", ".join(KINDS))
        if self.kind != "causal":
            check_int("AttentionMask.size", self.size, minimum=1)

    @classmethod
    def for_spec(cls, spec: KVCacheSpec) -> "AttentionMask":
        """The mask a layer of ``spec`` computes with (promoted full-attention layers keep theirs)."""
        if isinstance(spec, SlidingWindowSpec):
            return cls("sliding_window", spec.sliding_window)
        if isinstance(spec, ChunkedLocalAttentionSpec):
            return cls("chunked_local", spec.attention_chunk_size)
        if isinstance(spec, FullAttentionSpec) and spec.sliding_window is not None:
            return cls("sliding_window", spec.sliding_window)
        if isinstance(spec, FullAttentionSpec) and spec.attention_chunk_size is not None:
            return cls("chunked_local", spec.attention_chunk_size)
        return cls("causal")

    def allowed(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Bool ``[T, L]``: may query at ``q_pos[t]`` read key at ``k_pos[l]``."""
        q = q_pos[:, None]
        k = k_pos[None, :]
        ok = k <= q
        if self.kind == "sliding_window":
            ok &= k > q - self.size
        elif self.kind == "chunked_local":
            ok &= k >= torch.div(q, self.size, rounding_mode="floor") * self.size
        return ok


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """q ``[T, Hq, D]``, k/v ``[T, L, Hkv, D]``, allowed ``[T, L]`` -> ``[T, Hq, D]`` (GQA)."""
    t, hq, d = q.shape
    hkv = k.shape[2]
    if hq % hkv:
        raise InvalidFieldError("num_query_heads", hq, f"a multiple of num_kv_heads={hkv}")
    acc = _acc_dtype(q.dtype)
    qg = q.to(acc).reshape(t, hkv, hq // hkv, d)                       # [T, Hkv, G, D]
    scores = torch.matmul(qg, k.to(acc).permute(0, 2, 3, 1)) * scale   # [T, Hkv, G, L]
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # a query with no readable key (cannot happen causally)
    out = torch.matmul(probs, v.to(acc).permute(0, 2, 1, 3))          # [T, Hkv, G, D]
    return out.reshape(t, hq, d).to(q.dtype)


def _check_paged_args(query, kv_cache, block_table, context_lens, query_rows, query_positions) -> None:
    """Shapes and ranges, checked before any work (bad input is a ValueError, never a torch error)."""
    if query.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise InvalidFieldError("query/kv_cache", (tuple(query.shape), tuple(kv_cache.shape)),
                                "query [T, Hq, D] and kv_cache [num_blocks, 2, block_size, Hkv, D]")
    if query.shape[-1] != kv_cache.shape[-1]:
        raise InvalidFieldError("query", tuple(query.shape), f"head size {kv_cache.shape[-1]} like the cache")
    if block_table.dim() != 2 or context_lens.dim() != 1 or context_lens.shape[0] != block_table.shape[0]:
        raise InvalidFieldError("block_table/context_lens", (tuple(block_table.shape), tuple(context_lens.shape)),
                                "block_table [B, W] and context_lens [B]")
    t = query.shape[0]
    if query_rows.shape != (t,) or query_positions.shape != (t,):
        raise InvalidFieldError("query_rows/query_positions", (tuple(query_rows.shape), tuple(query_positions.shape)),
                                f"one entry per query token ({t})")
    if t and (int(query_rows.min()) < 0 or int(query_rows.max()) >= block_table.shape[0]):
        raise InvalidFieldError("query_rows", query_rows.tolist(), f"rows in [0, {block_table.shape[0]})")
    bs = kv_cache.shape[2]
    if context_lens.numel() and (int(context_lens.min()) < 0
                                 or int(context_lens.max()) > block_table.shape[1] * bs):
        raise InvalidFieldError("context_lens", context_lens.tolist(),
                                f"lengths in [0, {block_table.shape[1] * bs}] (the table's width x block size)")
    if block_table.numel() and (int(block_table.min()) < 0 or int(block_table.max()) >= kv_cache.shape[0]):
        raise InvalidFieldError("block_table", "ids out of range", f"block ids in [0, {kv_cache.shape[0]})")


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    context_lens: torch.Tensor, query_rows: torch.Tensor, query_positions: torch.Tensor,
                    mask: AttentionMask = AttentionMask(), scale: float | None = None) -> torch.Tensor:
    """Attention of ``query`` tokens over K/V read through block tables.

    Args:
        query: ``[T, Hq, D]`` query tokens of all requests of the step (prefill chunks and decodes).
        kv_cache: ``[num_blocks, 2, block_size, Hkv, D]`` (one layer, see ``KVCacheTensors.kv``).
        block_table: ``[B, W]`` int32 block ids per request row (0 = null block).
        context_lens: ``[B]`` tokens whose K/V is in the cache per row (the step's new tokens
            included: write them before attending).
        query_rows: ``[T]`` batch row of each query token.
        query_positions: ``[T]`` position of each query token in its request.
        mask: causal / sliding window / chunked local.
        scale: softmax scale (default ``D ** -0.5``).
    Returns:
        ``[T, Hq, D]`` in ``query.dtype``.
    """
    _check_paged_args(query, kv_cache, block_table, context_lens, query_rows, query_positions)
    num_blocks, _, bs, hkv, d = kv_cache.shape
    dev = kv_cache.device
    length = int(context_lens.max()) if context_lens.numel() else 0
    pos = torch.arange(length, device=dev)
    rows = query_rows.to(dev).long()
    # Gather whole pages of each request (block-granular, contiguous copies), then flatten the
    # block and offset dims into positions: [B, L, Hkv, D] for K and for V.
    nblk = -(-length // bs)
    table = block_table.to(dev).long()[:, :nblk]
    pages = kv_cache.index_select(0, table.reshape(-1)).view(table.shape[0], nblk, 2, bs, hkv, d)
    k = pages[:, :, 0].reshape(table.shape[0], nblk * bs, hkv, d)[:, :length]
    v = pages[:, :, 1].reshape(table.shape[0], nblk * bs, hkv, d)[:, :length]
    if not (rows.numel() == table.shape[0] and bool((rows == torch.arange(rows.numel(), device=dev)).all())):
        k, v = k.index_select(0, rows), v.index_select(0, rows)  # several queries per request
    qpos = query_positions.to(dev).long()
    allowed = mask.allowed(qpos, pos) & (pos[None, :] < context_lens.to(dev).long()[rows][:, None])
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return _attend(query.to(dev), k, v, allowed, scale)


def dense_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    query_positions: torch.Tensor, mask: AttentionMask = AttentionMask(),
                    scale: float | None = None) -> torch.Tensor:
    """The same attention over one request's contiguous K/V (``[N, Hkv, D]``, position = index)."""
    n = keys.shape[0]
    pos = torch.arange(n, device=keys.device)
    allowed = mask.allowed(query_positions.to(keys.device).long(), pos)
    t = query.shape[0]
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return _attend(query, keys[None].expand(t, *keys.shape), values[None].expand(t, *values.shape), allowed, scale)
