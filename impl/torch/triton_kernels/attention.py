"""Paged attention over block tables as one Triton kernel (prefill chunks and decodes alike).

One program per (query token, KV head) computes the ``GROUP = Hq / Hkv`` query heads that share
the KV head (GQA: K/V are read once for the group). It walks the request's block table only over
the blocks the mask can reach — ``[lo, hi)`` with ``hi = min(pos + 1, context_len)`` and ``lo`` =
0 (causal), ``pos - window + 1`` (sliding window) or the chunk start (chunked local) — with an
online softmax (running max and sum, rescaled per block), so memory traffic is the keys the
query may read and nothing else. That is also why it catches what the torch oracle catches: a
block inside the window that the bookkeeping nulled or handed to another request is read here
and gives wrong numbers; blocks outside the window are never read, exactly like vLLM's kernels,
which is what makes freeing them sound (``get_num_skipped_tokens``).

Arithmetic: float64 inputs accumulate in float64, everything else in float32 (half types are
loaded and converted: Triton's interpreter has no bfloat16 arithmetic). The scale is passed in a
one-element tensor of the accumulation type, because a Python float argument would be a float32
scalar and cost float64 its near-exactness. Scores use broadcast multiply + sum, not ``tl.dot``:
``tl.dot`` needs tiles of at least 16 and no float64, and decode is bound by memory, not FLOPs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvref.spec.errors import InvalidFieldError

from ..paged_attention import AttentionMask, _check_paged_args

_MASK_CODE = {"causal": 0, "sliding_window": 1, "chunked_local": 2}


@triton.jit
def _paged_attention_kernel(
    q_ptr, cache_ptr, out_ptr, table_ptr, ctx_ptr, rows_ptr, qpos_ptr, scale_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_ckv, stride_cs, stride_ch, stride_tb,
    mask_size,
    MASK_KIND: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
    HEAD: tl.constexpr, HEAD_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_P: tl.constexpr,
    ACC_F64: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.load(rows_ptr + t).to(tl.int64)
    qpos = tl.load(qpos_ptr + t).to(tl.int64)
    ctx = tl.load(ctx_ptr + row).to(tl.int64)
    if ACC_F64:
        acc_ty = tl.float64
    else:
        acc_ty = tl.float32
    scale = tl.load(scale_ptr).to(acc_ty)

    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, HEAD_P)
    gd_mask = (g[:, None] < GROUP) & (d[None, :] < HEAD)
    heads = h * GROUP + g
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=gd_mask, other=0.0)
    q = q.to(acc_ty)

    # The keys this query may read: [lo, hi).
    hi = tl.minimum(qpos + 1, ctx)
    lo = qpos * 0
    if MASK_KIND == 1:
        lo = tl.maximum(qpos - mask_size + 1, 0)
    if MASK_KIND == 2:
        lo = (qpos // mask_size) * mask_size
    first = lo // BLOCK_SIZE
    last = (hi + BLOCK_SIZE - 1) // BLOCK_SIZE

    m_i = tl.full([GROUP_P], float("-inf"), acc_ty)
    l_i = tl.zeros([GROUP_P], acc_ty)
    acc = tl.zeros([GROUP_P, HEAD_P], acc_ty)
    s = tl.arange(0, BLOCK_P)
    for b in range(first, last):
        blk = tl.load(table_ptr + row * stride_tb + b).to(tl.int64)
        pos = b * BLOCK_SIZE + s
        valid = (s < BLOCK_SIZE) & (pos >= lo) & (pos < hi)
        sd_mask = valid[:, None] & (d[None, :] < HEAD)
        base = cache_ptr + blk * stride_cb + s[:, None] * stride_cs + h * stride_ch + d[None, :]
        k = tl.load(base, mask=sd_mask, other=0.0).to(acc_ty)                       # [BLOCK_P, HEAD_P]
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale              # [GROUP_P, BLOCK_P]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(base + stride_ckv, mask=sd_mask, other=0.0).to(acc_ty)         # [BLOCK_P, HEAD_P]
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new

    # A query with no readable key (not reachable causally) gives 0, like the torch oracle.
    denom = tl.where(l_i > 0, l_i, 1.0)
    out = acc / denom[:, None]
    tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=gd_mask)


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def paged_attention_triton(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                           context_lens: torch.Tensor, query_rows: torch.Tensor, query_positions: torch.Tensor,
                           mask: AttentionMask = AttentionMask(), scale: float | None = None) -> torch.Tensor:
    """Same contract as :func:`kvref.impl.torch.paged_attention.paged_attention`, as a Triton kernel.

    ``kv_cache`` may be a strided view (``KVCacheTensors.kv``: pages padded to the widest group);
    only its innermost dimension must be contiguous.
    """
    from . import require_triton

    _check_paged_args(query, kv_cache, block_table, context_lens, query_rows, query_positions)
    if not isinstance(mask, AttentionMask):
        raise InvalidFieldError("mask", mask, "an AttentionMask")
    dev = kv_cache.device
    require_triton(dev)
    t, hq, d = query.shape
    _, _, bs, hkv, _ = kv_cache.shape
    if hq % hkv:
        raise InvalidFieldError("num_query_heads", hq, f"a multiple of num_kv_heads={hkv}")
    if kv_cache.stride(-1) != 1:
        raise InvalidFieldError("kv_cache", tuple(kv_cache.stride()), "a view whose head dimension is contiguous")
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    q = query.to(dev).contiguous()
    out = torch.empty_like(q)
    if t == 0:
        return out
    table = block_table.to(dev).to(torch.int32).contiguous()
    ctx = context_lens.to(dev).to(torch.int64).contiguous()
    rows = query_rows.to(dev).to(torch.int64).contiguous()
    qpos = query_positions.to(dev).to(torch.int64).contiguous()
    scale_t = torch.tensor([d ** -0.5 if scale is None else scale], dtype=acc, device=dev)
    group = hq // hkv
    _paged_attention_kernel[(t, hkv)](
        q, kv_cache, out, table, ctx, rows, qpos, scale_t,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), table.stride(0),
        mask.size if mask.kind != "causal" else 1,
        MASK_KIND=_MASK_CODE[mask.kind], GROUP=group, GROUP_P=_pow2(group), HEAD=d, HEAD_P=_pow2(d),
        BLOCK_SIZE=bs, BLOCK_P=_pow2(bs), ACC_F64=acc == torch.float64,
    )
    return out
