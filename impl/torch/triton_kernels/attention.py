"""Paged attention over block tables as one Triton kernel (prefill chunks and decodes alike).

One program per (query token, KV head, head block, split) computes the ``GROUP = Hq / Hkv`` query
heads that share the KV head (GQA: K/V are read once for the group) — all of them, or a block of
them when the group is too wide for registers (a 16-head MLA group at 576 lanes). It walks only the keys the mask can
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
#: the most blocks a pool may have: the block table goes to the kernel as int32
MAX_BLOCKS = 2**31 - 1


@triton.jit
def _paged_attention_kernel(
    q_ptr, cache_ptr, out_ptr, table_ptr, ctx_ptr, rows_ptr, qpos_ptr, scale_ptr, m_ptr, l_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_os, stride_mt, stride_mh,
    stride_cb, stride_ckv, stride_cs, stride_ch, stride_tb,
    mask_size, num_splits,
    MASK_KIND: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_BLOCKS: tl.constexpr,
    HEAD: tl.constexpr, HEAD_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    ACC_F64: tl.constexpr, SPLIT: tl.constexpr, USE_DOT: tl.constexpr,
):
    # int64 program ids: every offset below is computed in int64 (``t * stride_ot`` of a split
    # launch passes 2**31 at 8192 tokens x 64 heads x 32 splits x 128 lanes)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) // HEAD_BLOCKS
    hb = tl.program_id(1) % HEAD_BLOCKS
    sp = tl.program_id(2)
    row = tl.load(rows_ptr + t).to(tl.int64)
    qpos = tl.load(qpos_ptr + t).to(tl.int64)
    ctx = tl.load(ctx_ptr + row).to(tl.int64)
    if ACC_F64:
        acc_ty = tl.float64
    else:
        acc_ty = tl.float32
    scale = tl.load(scale_ptr).to(acc_ty)

    # This program's query heads: ``GROUP_P`` of the group's ``GROUP`` (several head blocks when the
    # group is too wide to keep ``[GROUP_P, HEAD_P]`` in registers); padding lanes are masked.
    g = hb * GROUP_P + tl.arange(0, GROUP_P)
    d = tl.arange(0, HEAD_P)
    gd_mask = (g[:, None] < GROUP) & (d[None, :] < HEAD)
    heads = (h * GROUP + g).to(tl.int64)
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


def _tile_for(f64: bool, head_p: int, group_b: int, on_cuda: bool) -> int:
    """Default positions per loop step (CUDA; the CPU interpreter takes 32, fewer loop steps).

    Chosen from the register report of the ahead-of-time compile for sm_90 (BENCHMARKS.md), 8 warps:
    the ``tl.dot`` path holds ``q`` and ``acc`` (``[group_b, head_p]``) and a K and a V tile
    (``[tile, head_p]``) in float32: tile 32 up to 256 lanes of half types (the first draft's
    64 x 4 warps spilled 1.4 KB of stack per thread at head 128), 16 beyond (head 256 float32
    spilled 8 bytes at tile 32, the 576-wide MLA latent padded to 1024 lanes 352 bytes). The
    float64 broadcast path also holds a ``[group_b, tile, head_p]`` product: at most 8192 of them.
    """
    if not on_cuda:
        return 32
    if f64:
        return max(1, min(8, 8192 // (group_b * head_p)))
    return 32 if head_p <= 128 else 16


def _group_block(group_p: int, head_p: int, use_dot: bool) -> int:
    """Query heads per program: all of the group while ``[heads, head_p]`` stays small enough to
    live in registers (4096 elements on the dot path, 2048 in float64), else blocks of that size
    (a 128-head MLA group at 1024 lanes would need 512 registers per thread for ``acc`` alone).
    ``tl.dot`` needs at least 16 rows."""
    budget = max(1, (4096 if use_dot else 2048) // head_p)
    fits = 1 << (budget.bit_length() - 1)  # the largest power of two <= budget
    return max(16 if use_dot else 1, min(group_p, fits))


def kernel_config(dtype: torch.dtype, mask_kind: str, num_q_heads: int, num_kv_heads: int, head_size: int,
                  block_size: int, on_cuda: bool, split: bool, tile: int | None = None,
                  num_warps: int | None = None, group_block: int | None = None) -> tuple[dict, int | None]:
    """The kernel's compile-time constants and ``num_warps`` for one launch (``num_warps`` None on
    the CPU). One function for the wrapper and for :mod:`.aot`, so what is compiled ahead of time
    is what runs. The grid's second axis is ``num_kv_heads * consts["HEAD_BLOCKS"]``.

    Defaults: 8 warps on CUDA; ``tile`` from :func:`_tile_for`; query heads per program
    (``group_block``, a power of two, >= 16 on the ``tl.dot`` path) from :func:`_group_block` —
    the same on the CPU, so the interpreter runs the head blocking a GPU launch runs. ``tl.dot``
    is used when the tile and head size are >= 16 and the dtype is not float64.
    """
    f64 = dtype == torch.float64
    head_p = _pow2(head_size)
    group = num_q_heads // num_kv_heads
    use_dot_ok = not f64 and head_size >= 16
    if group_block is not None and (isinstance(group_block, bool) or not isinstance(group_block, int)
                                    or group_block < 1 or group_block & (group_block - 1)):
        raise InvalidFieldError("group_block", group_block, "a power of two")
    if tile is None:
        gb = group_block or _group_block(_pow2(group), head_p, use_dot_ok)
        tile = _tile_for(f64, head_p, max(16, gb) if use_dot_ok else gb, on_cuda)
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1 or tile & (tile - 1):
        raise InvalidFieldError("tile", tile, "a power of two")
    use_dot = use_dot_ok and tile >= 16
    if group_block is None:
        group_block = _group_block(_pow2(group), head_p, use_dot)
    elif use_dot:
        group_block = max(16, group_block)  # tl.dot's minimum rows
    group_block = min(group_block, max(16, _pow2(group)) if use_dot else _pow2(group))
    if on_cuda and num_warps is None:
        num_warps = 8
    return dict(MASK_KIND=_MASK_CODE[mask_kind], GROUP=group, GROUP_P=group_block,
                HEAD_BLOCKS=-(-group // group_block), HEAD=head_size, HEAD_P=head_p, BLOCK_SIZE=block_size,
                TILE=tile, ACC_F64=f64, SPLIT=split, USE_DOT=use_dot), (num_warps if on_cuda else None)


def paged_attention_triton(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                           context_lens: torch.Tensor, query_rows: torch.Tensor, query_positions: torch.Tensor,
                           mask: AttentionMask = AttentionMask(), scale: float | None = None,
                           num_splits: int | None = None, tile: int | None = None,
                           num_warps: int | None = None, group_block: int | None = None,
                           validate: bool = True) -> torch.Tensor:
    """Same contract as :func:`kvref.impl.torch.paged_attention.paged_attention`, as a Triton kernel.

    ``kv_cache`` may be a strided view (``KVCacheTensors.kv``: pages padded to the widest group);
    only its innermost dimension must be contiguous. Tuning (results do not depend on them beyond
    rounding): ``num_splits`` (key-range partitions, default :func:`default_splits`), ``tile``
    (positions per loop step, a power of two; ``tl.dot`` is used when the tile and head size are
    >= 16), ``group_block`` (query heads per program, a power of two) and ``num_warps`` (CUDA
    only); defaults in :func:`kernel_config`. Any head size, GQA ratio and block size (powers of
    two or not) is accepted: padding lanes and heads are masked.

    Offsets are int64 throughout (block ids, positions and program ids are widened before they
    meet a stride), so any cache torch can allocate is addressable; the one 32-bit value is the
    block table, copied to int32: pools of more than ``2**31 - 1`` blocks are rejected.

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
    if kv_cache.shape[0] > MAX_BLOCKS:
        raise InvalidFieldError("kv_cache", kv_cache.shape[0], f"at most {MAX_BLOCKS} blocks (int32 block table)")
    if kv_cache.stride(-1) != 1:
        raise InvalidFieldError("kv_cache", tuple(kv_cache.stride()), "a view whose head dimension is contiguous")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1):
        raise InvalidFieldError("num_splits", num_splits, "an int >= 1")
    if num_warps is not None and (isinstance(num_warps, bool) or num_warps not in (1, 2, 4, 8, 16, 32)):
        raise InvalidFieldError("num_warps", num_warps, "a power of two from 1 to 32")
    consts, warps = kernel_config(query.dtype, mask.kind, hq, hkv, d, bs, dev.type == "cuda", False, tile, num_warps,
                                  group_block)
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
    _paged_attention_kernel[(t, hkv * consts["HEAD_BLOCKS"], num_splits)](
        q, kv_cache, dst, table, ctx, rows, qpos, scale_t, m, l_,
        q.stride(0), q.stride(1), *strides,
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), table.stride(0),
        mask.size if mask.kind != "causal" else 1, num_splits, **consts, **extra,
    )
    if split:
        return _combine(m, l_, part, q.dtype)
    return out
