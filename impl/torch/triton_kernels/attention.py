"""Paged attention over block tables as one Triton kernel (prefill chunks and decodes alike).

One program per (query token, KV head, split) computes the ``GROUP = Hq / Hkv`` query heads that
share the KV head (GQA: K/V are read once for the group). It walks only the keys the mask can
reach — ``[lo, hi)`` with ``hi = min(pos + 1, context_len)`` and ``lo`` = 0 (causal),
``pos - window + 1`` (sliding window) or the chunk start (chunked local) — in tiles of ``TILE``
positions whose block ids are gathered from the block table per position (so a tile may span
several small blocks, and several tiles one big block), with an online softmax (running max and
sum, rescaled per tile). Memory traffic is the keys the query may read and nothing else. That is
also why it catches what the torch oracle catches: a block inside the window that the
bookkeeping nulled or handed to another request is read here and gives wrong numbers; blocks
outside the window are never read, exactly like vLLM's kernels, which is what makes freeing
them sound (``get_num_skipped_tokens``).

Long contexts with few (token, head) pairs — a small decode batch — leave a GPU mostly idle, so
the key range can be cut into ``num_splits`` parts (flash-decoding; vLLM's paged attention v2
partitions the same way): each part writes its running max, sum and unnormalised output, and a
combine step rescales them to the common max and divides once.

Arithmetic: float64 inputs accumulate in float64, everything else in float32 (half types are
loaded and converted: Triton's interpreter has no bfloat16 arithmetic, its bfloat16 ``tl.dot``
returns garbage). The scale is passed in a one-element tensor of the accumulation type, because
a Python float argument would be a float32 scalar and cost float64 its near-exactness. Two ways
to form ``q k^T`` and ``p v``, chosen by ``USE_DOT``: ``tl.dot`` on float32 operands with
``input_precision="ieee"`` (no TF32 rounding; the query heads padded to 16 rows, as ``tl.dot``
needs M, N, K >= 16) for every type but float64, which ``tl.dot`` does not take and which uses a
broadcast multiply + sum instead. Decode is bound by memory, not FLOPs, so giving up tensor-core
half-precision dots costs little; what ``tl.dot`` buys is a register-tiled product instead of a
``[group, tile, head]`` temporary.
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
    q_ptr, cache_ptr, out_ptr, table_ptr, ctx_ptr, rows_ptr, qpos_ptr, scale_ptr, m_ptr, l_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_os, stride_mt, stride_mh,
    stride_cb, stride_ckv, stride_cs, stride_ch, stride_tb,
    mask_size, num_splits,
    MASK_KIND: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
    HEAD: tl.constexpr, HEAD_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    ACC_F64: tl.constexpr, SPLIT: tl.constexpr, USE_DOT: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
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

    # The keys this query may read: [lo, hi); this split's share of its tiles.
    hi = tl.minimum(qpos + 1, ctx)
    lo = qpos * 0
    if MASK_KIND == 1:
        lo = tl.maximum(qpos - mask_size + 1, 0)
    if MASK_KIND == 2:
        lo = (qpos // mask_size) * mask_size
    n_tiles = tl.maximum(hi - lo + TILE - 1, 0) // TILE
    per_split = (n_tiles + num_splits - 1) // num_splits
    tile_lo = sp * per_split
    tile_hi = tl.minimum(tile_lo + per_split, n_tiles)

    m_i = tl.full([GROUP_P], float("-inf"), acc_ty)
    l_i = tl.zeros([GROUP_P], acc_ty)
    acc = tl.zeros([GROUP_P, HEAD_P], acc_ty)
    s = tl.arange(0, TILE)
    for i in range(tile_lo, tile_hi):
        pos = lo + i * TILE + s
        valid = pos < hi
        blk = tl.load(table_ptr + row * stride_tb + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        sd_mask = valid[:, None] & (d[None, :] < HEAD)
        base = cache_ptr + blk[:, None] * stride_cb + (pos % BLOCK_SIZE)[:, None] * stride_cs + h * stride_ch \
            + d[None, :]
        k = tl.load(base, mask=sd_mask, other=0.0).to(acc_ty)                       # [TILE, HEAD_P]
        if USE_DOT:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale        # [GROUP_P, TILE]
        else:
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale          # [GROUP_P, TILE]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(base + stride_ckv, mask=sd_mask, other=0.0).to(acc_ty)         # [TILE, HEAD_P]
        if USE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new

    if SPLIT:
        # Partial results for the combine step (``acc`` unnormalised, in the accumulation type).
        ml = t * stride_mt + heads * stride_mh + sp
        tl.store(m_ptr + ml, m_i, mask=g < GROUP)
        tl.store(l_ptr + ml, l_i, mask=g < GROUP)
        tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + sp * stride_os + d[None, :], acc,
                 mask=gd_mask)
    else:
        # A query with no readable key (not reachable causally) gives 0, like the torch oracle.
        denom = tl.where(l_i > 0, l_i, 1.0)
        out = acc / denom[:, None]
        tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=gd_mask)


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _combine(m: torch.Tensor, l_: torch.Tensor, acc: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Merge ``num_splits`` partial softmaxes: ``m``/``l_`` ``[T, Hq, S]``, ``acc`` ``[T, Hq, S, D]``."""
    top = m.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w = torch.exp(m - top)                       # a split with no keys has m = -inf: weight 0
    total = (w * l_).sum(-1)
    out = (w[..., None] * acc).sum(-2)
    out = torch.where(total[..., None] > 0, out / total.clamp_min(torch.finfo(total.dtype).tiny)[..., None],
                      torch.zeros_like(out))
    return out.to(dtype)


def default_splits(num_programs: int, max_keys: int, tile: int, device: torch.device) -> int:
    """Splits so a GPU gets about four programs per SM, never a split shorter than four tiles;
    1 on the CPU (the interpreter gains nothing from them)."""
    if device.type != "cuda" or num_programs <= 0:
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = -(-4 * sms // num_programs)
    return max(1, min(want, max_keys // (4 * tile), 32))


def kernel_config(dtype: torch.dtype, mask_kind: str, num_q_heads: int, num_kv_heads: int, head_size: int,
                  block_size: int, on_cuda: bool, split: bool, tile: int | None = None,
                  num_warps: int | None = None) -> tuple[dict, int | None]:
    """The kernel's compile-time constants and ``num_warps`` for one launch (``num_warps`` None on
    the CPU). One function for the wrapper and for :mod:`.aot`, so what is compiled ahead of time
    is what runs.

    CUDA defaults, chosen from the register report of the ahead-of-time compile for sm_90
    (BENCHMARKS.md): tile 32 with 8 warps on the ``tl.dot`` path (64 x 4 warps spilled 1.4 KB of
    stack per thread at 255 registers), tile 8 with 8 warps on the float64 broadcast path (16 x 4
    spilled ~100 bytes at 255 registers; 8 x 8 needs 157 and spills nothing).
    """
    f64 = dtype == torch.float64
    if tile is None:
        tile = (8 if f64 else 32) if on_cuda else 32
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1 or tile & (tile - 1):
        raise InvalidFieldError("tile", tile, "a power of two")
    use_dot = not f64 and tile >= 16 and head_size >= 16
    if on_cuda and num_warps is None:
        num_warps = 8
    group = num_q_heads // num_kv_heads
    return dict(MASK_KIND=_MASK_CODE[mask_kind], GROUP=group,
                GROUP_P=max(16, _pow2(group)) if use_dot else _pow2(group), HEAD=head_size,
                HEAD_P=_pow2(head_size), BLOCK_SIZE=block_size, TILE=tile, ACC_F64=f64, SPLIT=split,
                USE_DOT=use_dot), (num_warps if on_cuda else None)


def paged_attention_triton(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                           context_lens: torch.Tensor, query_rows: torch.Tensor, query_positions: torch.Tensor,
                           mask: AttentionMask = AttentionMask(), scale: float | None = None,
                           num_splits: int | None = None, tile: int | None = None,
                           num_warps: int | None = None, validate: bool = True) -> torch.Tensor:
    """Same contract as :func:`kvref.impl.torch.paged_attention.paged_attention`, as a Triton kernel.

    ``kv_cache`` may be a strided view (``KVCacheTensors.kv``: pages padded to the widest group);
    only its innermost dimension must be contiguous. Tuning (results do not depend on them beyond
    rounding): ``num_splits`` (key-range partitions, default :func:`default_splits`), ``tile``
    (positions per loop step, a power of two; ``tl.dot`` is used when the tile and head size are
    >= 16) and ``num_warps`` (CUDA only); defaults in :func:`kernel_config`.

    ``validate=False`` skips the range checks of the arguments, which read device values back to
    the host (a device sync per check); for timing loops over arguments already checked once.
    """
    from . import require_triton

    if validate:
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
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1):
        raise InvalidFieldError("num_splits", num_splits, "an int >= 1")
    if num_warps is not None and (isinstance(num_warps, bool) or num_warps not in (1, 2, 4, 8, 16, 32)):
        raise InvalidFieldError("num_warps", num_warps, "a power of two from 1 to 32")
    consts, warps = kernel_config(query.dtype, mask.kind, hq, hkv, d, bs, dev.type == "cuda", False, tile, num_warps)
    if num_splits is None:
        # The table's reach bounds the context without reading it back when not validating.
        max_keys = (int(context_lens.max()) if context_lens.numel() else 0) if validate else block_table.shape[1] * bs
        num_splits = default_splits(t * hkv, max_keys, consts["TILE"], dev)
    consts["SPLIT"] = split = num_splits > 1
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
    if split:
        part = torch.empty((t, hq, num_splits, d), dtype=acc, device=dev)
        m = torch.empty((t, hq, num_splits), dtype=acc, device=dev)
        l_ = torch.empty_like(m)
        dst, strides = part, (part.stride(0), part.stride(1), part.stride(2), m.stride(0), m.stride(1))
    else:
        m = l_ = scale_t  # unused
        dst, strides = out, (out.stride(0), out.stride(1), 0, 0, 0)
    extra = {"num_warps": warps} if warps else {}
    _paged_attention_kernel[(t, hkv, num_splits)](
        q, kv_cache, dst, table, ctx, rows, qpos, scale_t, m, l_,
        q.stride(0), q.stride(1), *strides,
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), table.stride(0),
        mask.size if mask.kind != "causal" else 1, num_splits, **consts, **extra,
    )
    if split:
        return _combine(m, l_, part, q.dtype)
    return out
