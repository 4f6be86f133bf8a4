"""Paged attention over block tables as Triton kernels: a split-K (flash-decoding) pass and a
reduce pass (prefill chunks and decodes alike).

**Pass 1** — one program per (query token, KV head, head block, split). All ``GROUP = Hq / Hkv``
query heads that share the KV head are packed into the program (GQA: each K/V tile is read once
for the whole group; a group too wide for registers — the 128-head MLA group — runs in head
blocks of ``GROUP_P``). It walks only the keys the mask can reach — ``[lo, hi)`` with
``hi = min(pos + 1, context_len)`` and ``lo`` = 0 (causal), ``pos - window + 1`` (sliding
window) or the chunk start (chunked local) — in tiles of ``TILE`` positions aligned to absolute
positions, this split's share of them. When ``TILE`` divides the block size (``PAGE_TILES``) a
tile lies in one block: one block-table entry per tile and a ``[TILE, head]`` K (and V) slab
loaded as rows of contiguous head elements (vectorized: the compiler's report in BENCHMARKS.md);
otherwise (block sizes below 16 or not powers of two: 5, 12, 80, 528, ...) the block id is
gathered per position, so a tile may span several blocks and a block several tiles. Online
softmax (running max and sum, rescaled per tile). Memory traffic is the keys the query may read
and nothing else: a block inside the window that the bookkeeping nulled or handed to another
request is read and gives wrong numbers; blocks outside the window are never read, exactly like
vLLM's kernels, which is what makes freeing them sound (``get_num_skipped_tokens``).

**Pass 2** (:func:`_combine_kernel`, only when ``num_splits > 1``) — one program per (query
token, query head): rescales each split's unnormalised output to the common max and divides once
(vLLM's paged attention v2 and flash-decoding reduce the same way).

**Head dimension.** ``tl.arange`` needs powers of two; a head of ``HEAD`` lanes is cut into a
power-of-two part ``HEAD_A`` (the largest <= ``HEAD``) and a padded remainder ``HEAD_B`` (576 =
512 + 64 for the MLA latent, 80 = 64 + 16), two products summed, instead of padding to the next
power of two (1024 lanes for 576: 78 % more shared memory and tensor-core work for nothing).

**Arithmetic.** float64 accumulates in float64 (broadcast multiply + sum: ``tl.dot`` does not take
float64), everything else in float32. Compiled on CUDA, half types use ``tl.dot`` on their native
operands (tensor cores, float32 accumulation: products of two half values are exact in float32);
for ``p v`` the float32 probabilities are cut into ``p_hi + p_lo``, both in the input type, and
both products accumulated (FlashAttention and vLLM's Triton decode kernel round ``p`` once, to
8 bits in bfloat16, which measured 2.5x the torch path's relative error vs float64 here; the
second product costs tensor-core time a memory-bound decode has spare). float32 uses
``tl.dot(..., input_precision="ieee")`` (no TF32 rounding). Triton's interpreter has no bfloat16
``tl.dot`` (it returns garbage), so interpreted kernels (``NATIVE_DOT`` off) convert the operands
to float32 and apply the same roundings explicitly: the same numbers as the compiled path up to
the summation order. The
scale is passed in a one-element tensor of the accumulation type (a Python float argument would
be a float32 scalar and cost float64 its near-exactness).

**Shared memory** (issue #24: the 128-head MLA shape asked 329,920 B on an sm_90 whose limit is
232,448 B, and did not launch). :func:`shared_memory_bound` bounds the compiled kernel's need per
configuration (checked against the compiler's ``metadata.shared`` in the tests); on CUDA the
wrapper picks the largest default tile / pipeline depth whose bound fits the device's
``shared_memory_per_block_optin`` (sm_90: 227 KiB, sm_80: 163 KiB), refuses an explicit tuning
that cannot fit, and should a compiler still ask for more than the device has, steps down to the
next configuration instead of failing the launch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from kvref.spec.errors import InvalidFieldError

from ..paged_attention import AttentionMask, _check_paged_args
from .availability import note_decorated

_MASK_CODE = {"causal": 0, "sliding_window": 1, "chunked_local": 2}
#: the most blocks a pool may have: the block table goes to the kernel as int32
MAX_BLOCKS = 2**31 - 1
#: shared memory per block (opt-in maximum) of the GPU targets checked ahead of time, bytes
#: (CUDA C Programming Guide, "Features and Technical Specifications": 227 KiB on sm_90, 163 KiB on sm_80)
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
#: the most key-range splits a launch uses (the reduce pass loads their maxima as one vector)
MAX_SPLITS = 64


@triton.jit
def _paged_attention_kernel(
    q_ptr, cache_ptr, out_ptr, table_ptr, ctx_ptr, rows_ptr, qpos_ptr, scale_ptr, m_ptr, l_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_os, stride_mt, stride_mh,
    stride_cb, stride_ckv, stride_cs, stride_ch, stride_tb,
    mask_size, num_splits,
    MASK_KIND: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_BLOCKS: tl.constexpr,
    HEAD: tl.constexpr, HEAD_A: tl.constexpr, HEAD_B: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr, ACC_F64: tl.constexpr, SPLIT: tl.constexpr, USE_DOT: tl.constexpr,
    NATIVE_DOT: tl.constexpr, PAGE_TILES: tl.constexpr, HAS_B: tl.constexpr, SPLIT_P: tl.constexpr,
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

    # This program's query heads (padding lanes and heads masked), both head parts.
    g = hb * GROUP_P + tl.arange(0, GROUP_P)
    g_ok = g < GROUP
    heads = (h * GROUP + g).to(tl.int64)
    da = tl.arange(0, HEAD_A)
    db = tl.arange(0, HEAD_B)
    b_ok = db < HEAD - HEAD_A
    q_row = q_ptr + t * stride_qt + heads[:, None] * stride_qh
    qa = tl.load(q_row + da[None, :], mask=g_ok[:, None], other=0.0)
    if not NATIVE_DOT:
        qa = qa.to(acc_ty)
    if HAS_B:
        qb = tl.load(q_row + HEAD_A + db[None, :], mask=g_ok[:, None] & b_ok[None, :], other=0.0)
        if not NATIVE_DOT:
            qb = qb.to(acc_ty)

    # The keys this query may read: [lo, hi); tiles aligned to TILE; this split's share of them.
    hi = tl.minimum(qpos + 1, ctx)
    lo = qpos * 0
    if MASK_KIND == 1:
        lo = tl.maximum(qpos - mask_size + 1, 0)
    if MASK_KIND == 2:
        lo = (qpos // mask_size) * mask_size
    first = lo // TILE
    n_tiles = tl.maximum((hi + TILE - 1) // TILE - first, 0)
    per_split = (n_tiles + num_splits - 1) // num_splits
    tile_lo = first + sp * per_split
    tile_hi = tl.minimum(tile_lo + per_split, first + n_tiles)

    m_i = tl.full([GROUP_P], float("-inf"), acc_ty)
    l_i = tl.zeros([GROUP_P], acc_ty)
    acc_a = tl.zeros([GROUP_P, HEAD_A], acc_ty)
    acc_b = tl.zeros([GROUP_P, HEAD_B], acc_ty)
    s = tl.arange(0, TILE)
    head_off = h * stride_ch
    for i in range(tile_lo, tile_hi):
        start = i * TILE
        pos = start + s
        valid = (pos >= lo) & (pos < hi)
        if PAGE_TILES:
            # the whole tile lies in one block: one table entry, rows of one page
            blk = tl.load(table_ptr + row * stride_tb + start // BLOCK_SIZE).to(tl.int64)
            kv = cache_ptr + blk * stride_cb + head_off + ((start % BLOCK_SIZE) + s)[:, None] * stride_cs
        else:
            blk = tl.load(table_ptr + row * stride_tb + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
            kv = cache_ptr + blk[:, None] * stride_cb + head_off + (pos % BLOCK_SIZE)[:, None] * stride_cs
        ka = tl.load(kv + da[None, :], mask=valid[:, None], other=0.0)                    # [TILE, HEAD_A]
        if USE_DOT:
            if NATIVE_DOT:
                scores = tl.dot(qa, tl.trans(ka), input_precision="ieee")
            else:
                scores = tl.dot(qa, tl.trans(ka.to(acc_ty)), input_precision="ieee")
        else:
            scores = tl.sum(qa[:, None, :] * ka.to(acc_ty)[None, :, :], axis=2)
        if HAS_B:
            kb = tl.load(kv + HEAD_A + db[None, :], mask=valid[:, None] & b_ok[None, :], other=0.0)
            if USE_DOT:
                if NATIVE_DOT:
                    scores += tl.dot(qb, tl.trans(kb), input_precision="ieee")
                else:
                    scores += tl.dot(qb, tl.trans(kb.to(acc_ty)), input_precision="ieee")
            else:
                scores += tl.sum(qb[:, None, :] * kb.to(acc_ty)[None, :, :], axis=2)
        scores = tl.where(valid[None, :], scores * scale, float("-inf"))                  # [GROUP_P, TILE]
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        va = tl.load(kv + stride_ckv + da[None, :], mask=valid[:, None], other=0.0)
        if USE_DOT:
            # p = p_hi + p_lo, both in the input type: two tensor-core products keep ~16 bits of p
            # (one would round p to 8 bits in bfloat16: 2.5x the relative error of the torch path)
            if NATIVE_DOT:
                p_hi = p.to(va.dtype)
                acc_a = tl.dot(p_hi, va, acc_a * alpha[:, None], input_precision="ieee")
                if SPLIT_P:  # half types: the part of p their rounding dropped
                    p_lo = (p - p_hi.to(acc_ty)).to(va.dtype)
                    acc_a = tl.dot(p_lo, va, acc_a, input_precision="ieee")
            else:
                p_hi = p.to(va.dtype).to(acc_ty)  # the roundings the native products apply
                pv = p_hi + (p - p_hi).to(va.dtype).to(acc_ty)
                acc_a = acc_a * alpha[:, None] + tl.dot(pv, va.to(acc_ty), input_precision="ieee")
        else:
            acc_a = acc_a * alpha[:, None] + tl.sum(p[:, :, None] * va.to(acc_ty)[None, :, :], axis=1)
        if HAS_B:
            vb = tl.load(kv + stride_ckv + HEAD_A + db[None, :], mask=valid[:, None] & b_ok[None, :], other=0.0)
            if USE_DOT:
                if NATIVE_DOT:
                    acc_b = tl.dot(p_hi, vb, acc_b * alpha[:, None], input_precision="ieee")
                    if SPLIT_P:
                        acc_b = tl.dot(p_lo, vb, acc_b, input_precision="ieee")
                else:
                    acc_b = acc_b * alpha[:, None] + tl.dot(pv, vb.to(acc_ty), input_precision="ieee")
            else:
                acc_b = acc_b * alpha[:, None] + tl.sum(p[:, :, None] * vb.to(acc_ty)[None, :, :], axis=1)
        m_i = m_new

    if SPLIT:
        # Partial results for the reduce pass (``acc`` unnormalised, in the accumulation type).
        ml = t * stride_mt + heads * stride_mh + sp
        tl.store(m_ptr + ml, m_i, mask=g_ok)
        tl.store(l_ptr + ml, l_i, mask=g_ok)
        o_row = out_ptr + t * stride_ot + heads[:, None] * stride_oh + sp * stride_os
        tl.store(o_row + da[None, :], acc_a, mask=g_ok[:, None])
        if HAS_B:
            tl.store(o_row + HEAD_A + db[None, :], acc_b, mask=g_ok[:, None] & b_ok[None, :])
    else:
        # A query with no readable key (not reachable causally) gives 0, like the torch oracle.
        denom = tl.where(l_i > 0, l_i, 1.0)
        o_row = out_ptr + t * stride_ot + heads[:, None] * stride_oh
        tl.store(o_row + da[None, :], (acc_a / denom[:, None]).to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
        if HAS_B:
            tl.store(o_row + HEAD_A + db[None, :], (acc_b / denom[:, None]).to(out_ptr.dtype.element_ty),
                     mask=g_ok[:, None] & b_ok[None, :])


@triton.jit
def _combine_kernel(part_ptr, m_ptr, l_ptr, out_ptr, stride_pt, stride_ph, stride_ps, stride_mt, stride_mh,
                    stride_ot, stride_oh, num_splits,
                    HEAD: tl.constexpr, HEAD_P: tl.constexpr, SPLITS_P: tl.constexpr, ACC_F64: tl.constexpr):
    """Pass 2: ``out = sum_s w_s acc_s / sum_s w_s l_s`` with ``w_s = exp(m_s - max_s m_s)``; a
    split that read no key has ``m = -inf`` (weight 0); a query that read none gives 0."""
    t = tl.program_id(0).to(tl.int64)
    hq = tl.program_id(1).to(tl.int64)
    if ACC_F64:
        acc_ty = tl.float64
    else:
        acc_ty = tl.float32
    sidx = tl.arange(0, SPLITS_P)
    m_row = t * stride_mt + hq * stride_mh
    m = tl.load(m_ptr + m_row + sidx, mask=sidx < num_splits, other=float("-inf"))
    top = tl.max(m, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    d = tl.arange(0, HEAD_P)
    total = tl.zeros([1], acc_ty)
    out = tl.zeros([HEAD_P], acc_ty)
    p_row = part_ptr + t * stride_pt + hq * stride_ph
    for sp in range(0, num_splits):
        w = tl.exp(tl.load(m_ptr + m_row + sp) - top)
        total += w * tl.load(l_ptr + m_row + sp)
        out += w * tl.load(p_row + sp * stride_ps + d, mask=d < HEAD, other=0.0)
    out = tl.where(total > 0, out / tl.where(total > 0, total, 1.0), 0.0)
    tl.store(out_ptr + t * stride_ot + hq * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD)


note_decorated(_paged_attention_kernel)  # interpreted() reads how triton decorated the kernels


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def head_parts(head_size: int, use_dot: bool) -> tuple[int, int]:
    """``(HEAD_A, HEAD_B)``: the largest power of two <= ``head_size`` and the remainder padded to a
    power of two (at least 16 on the ``tl.dot`` path, whose K dimension needs 16; at least 1)."""
    a = 1 << (int(head_size).bit_length() - 1)
    rest = head_size - a
    b = max(16 if use_dot else 1, _pow2(rest)) if rest else (16 if use_dot else 1)
    return a, b


def default_splits(num_programs: int, max_keys: int, tile: int, device: torch.device) -> int:
    """Key-range splits so a GPU gets about 16 programs per SM (several waves: the last one's
    imbalance stays small; the partials cost ``T x Hq x splits x head`` float32, a few % of the
    K/V bytes at the decode shapes), never a split shorter than two tiles, at most
    :data:`MAX_SPLITS`; 1 on the CPU (the interpreter gains nothing from them)."""
    if device.type != "cuda" or num_programs <= 0:
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    want = -(-16 * sms // num_programs)
    return max(1, min(want, max_keys // (2 * tile), MAX_SPLITS))


@lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _group_block(group_p: int, head_p: int, use_dot: bool) -> int:
    """Query heads per program: all of the group while ``[heads, head_p]`` stays small enough to
    live in registers (8192 elements on the dot path, 2048 in float64), else blocks of that size
    (a 128-head MLA group at 576 lanes would need hundreds of registers per thread for ``acc``
    alone). ``tl.dot`` needs at least 16 rows."""
    budget = max(1, (8192 if use_dot else 2048) // head_p)
    fits = 1 << (budget.bit_length() - 1)  # the largest power of two <= budget
    return max(16 if use_dot else 1, min(group_p, fits))


def shared_memory_bound(consts: dict, dtype: torch.dtype, num_stages: int) -> int:
    """Upper bound of the shared memory (bytes per program) the compiled pass-1 kernel asks for.

    The terms: the K and V tiles, one buffer each per pipeline stage (``num_stages``; the
    pipeliner stages the loads of the loop through shared memory), in the operand type (native
    half types on the ``tl.dot`` path, the accumulation type when converted); the ``q``
    operand and the probabilities ``p`` staged for ``tl.dot``; the layout conversions of the
    ``[GROUP_P, TILE]`` scores and of one K/V tile; 1 KiB for reductions. Checked against the
    compiler's ``metadata.shared`` for sm_80 and sm_90 in ``tests/impl/torch/test_triton_compile.py``
    (the bound must not be below it for any configuration the wrapper can choose)."""
    head = consts["HEAD_A"] + (consts["HEAD_B"] if consts["HAS_B"] else 0)
    tile, group = consts["TILE"], consts["GROUP_P"]
    elem = torch.empty((), dtype=dtype).element_size()
    op = elem if consts["USE_DOT"] else max(elem, 4)
    acc = 8 if consts["ACC_F64"] else 4
    kv = 2 * max(1, num_stages) * tile * head * op
    staging = group * head * op + group * tile * (op + acc) + tile * head * max(op, 4)
    return kv + staging + 1024


def device_shared_limit(device: torch.device) -> int:
    """Shared memory a program may use on ``device`` (bytes): the opt-in maximum per block."""
    return _shared_limit(device.index if device.index is not None else torch.cuda.current_device())


@lru_cache(maxsize=None)
def _shared_limit(index: int) -> int:
    device = torch.device("cuda", index)
    props = torch.cuda.get_device_properties(device)
    limit = getattr(props, "shared_memory_per_block_optin", None)
    if not limit:
        from triton.runtime import driver

        limit = driver.active.utils.get_device_properties(device.index or 0)["max_shared_mem"]
    return int(limit)


@dataclass(frozen=True)
class KernelConfig:
    """One launch configuration of pass 1: the compile-time constants, ``num_warps`` and
    ``num_stages`` (``None`` on the CPU: the interpreter takes neither) and the shared-memory bound
    (:func:`shared_memory_bound`)."""

    consts: dict
    num_warps: int | None
    num_stages: int | None
    shared_bytes: int


def _check_pow2(name: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1
                              or value & (value - 1)):
        raise InvalidFieldError(name, value, "a power of two")


def _consts(dtype, mask_kind, group, head_size, block_size, on_cuda, split, tile, group_block) -> dict:
    f64 = dtype == torch.float64
    use_dot = not f64 and head_size >= 16 and tile >= 16
    head_a, head_b = head_parts(head_size, use_dot)
    gb = group_block or _group_block(_pow2(group), head_a + head_b, use_dot)
    if use_dot:
        gb = max(16, gb)  # tl.dot's minimum rows
    gb = min(gb, max(16, _pow2(group)) if use_dot else _pow2(group))
    return dict(MASK_KIND=_MASK_CODE[mask_kind], GROUP=group, GROUP_P=gb, HEAD_BLOCKS=-(-group // gb),
                HEAD=head_size, HEAD_A=head_a, HEAD_B=head_b, BLOCK_SIZE=block_size, TILE=tile, ACC_F64=f64,
                SPLIT=split, USE_DOT=use_dot, NATIVE_DOT=on_cuda and use_dot and not f64,
                PAGE_TILES=block_size % tile == 0, HAS_B=head_size > head_a,
                SPLIT_P=dtype in (torch.bfloat16, torch.float16))


def candidate_configs(dtype: torch.dtype, mask_kind: str, num_q_heads: int, num_kv_heads: int, head_size: int,
                      block_size: int, on_cuda: bool, split: bool, tile: int | None = None,
                      num_warps: int | None = None, group_block: int | None = None,
                      num_stages: int | None = None) -> list[KernelConfig]:
    """Every configuration the wrapper may launch for these arguments, in order of preference
    (what is not given explicitly is stepped down: pipeline stages 2 -> 1, then the tile halved,
    to 16 on the ``tl.dot`` path). On the CPU (the interpreter) one: tile 32 unless given.

    CUDA defaults, from the compiler's report for sm_90 (BENCHMARKS.md): ``num_warps`` 4, 8 when
    a program's ``[GROUP_P, head]`` query block passes 8 KiB (the MLA latent; float32 at head 256,
    which spilled 72 bytes per thread with 4 warps); tile 32 up to 256 lanes of head
    (bfloat16, head 128: 94-96 registers, 22.5 KB of shared memory, 16-byte loads; tile 64 needed
    106-141 registers, fewer programs per SM for the same bytes in flight), 16 beyond; in float64 at most
    ``8192 / (GROUP_P * head)`` (the broadcast product ``[GROUP_P, TILE, head]`` lives in
    registers). A block size the tile divides gives ``PAGE_TILES`` (one table entry per tile;
    8 warps: with 4, ptxas kept an 8-byte stack frame for some of these)."""
    _check_pow2("group_block", group_block)
    _check_pow2("tile", tile)
    if num_stages is not None and (isinstance(num_stages, bool) or not isinstance(num_stages, int)
                                   or not 1 <= num_stages <= 4):
        raise InvalidFieldError("num_stages", num_stages, "an int from 1 to 4")
    group = num_q_heads // num_kv_heads
    if not on_cuda:
        consts = _consts(dtype, mask_kind, group, head_size, block_size, False, split, tile or 32, group_block)
        return [KernelConfig(consts, None, None, shared_memory_bound(consts, dtype, 1))]
    f64 = dtype == torch.float64
    a, b = head_parts(head_size, not f64 and head_size >= 16)
    head = a + b if head_size > a else a
    if tile is not None:
        tiles = [tile]
    else:
        top = 32 if head <= 256 else 16
        if f64:
            gb = group_block or _group_block(_pow2(group), head, False)
            top = 1 << (max(1, min(8, 8192 // (gb * head))).bit_length() - 1)  # a power of two
        floor = 1 if f64 or head_size < 16 else 16
        tiles = [top]
        while tiles[-1] // 2 >= floor:
            tiles.append(tiles[-1] // 2)
    out = []
    for tl_ in tiles:
        consts = _consts(dtype, mask_kind, group, head_size, block_size, True, split, tl_, group_block)
        lanes = consts["HEAD_A"] + (consts["HEAD_B"] if consts["HAS_B"] else 0)
        op_bytes = torch.empty((), dtype=dtype).element_size()
        # 8 warps also for one-table-entry tiles (the tile divides the block): with 4 warps ptxas
        # kept an 8-byte stack frame on sm_90 for some of them (blocks 64 and 1568, head 128,
        # 72 registers), with 8 none
        warps = num_warps or (8 if consts["GROUP_P"] * lanes * op_bytes > 8192 or consts["PAGE_TILES"] else 4)
        for stages in ([num_stages] if num_stages else [2, 1]):
            out.append(KernelConfig(consts, warps, stages, shared_memory_bound(consts, dtype, stages)))
    return out


def kernel_config(dtype: torch.dtype, mask_kind: str, num_q_heads: int, num_kv_heads: int, head_size: int,
                  block_size: int, on_cuda: bool, split: bool, tile: int | None = None,
                  num_warps: int | None = None, group_block: int | None = None, num_stages: int | None = None,
                  shared_limit: int | None = None) -> KernelConfig:
    """The configuration the wrapper launches (and :mod:`.aot` compiles): the first of
    :func:`candidate_configs` whose shared-memory bound fits ``shared_limit`` (bytes; on CUDA the
    device's, :func:`device_shared_limit`; ``None``: no limit). An explicit tuning that cannot fit
    is an :class:`InvalidFieldError` naming the need and the limit."""
    cands = candidate_configs(dtype, mask_kind, num_q_heads, num_kv_heads, head_size, block_size, on_cuda, split,
                              tile, num_warps, group_block, num_stages)
    for c in cands:
        if shared_limit is None or c.shared_bytes <= shared_limit:
            return c
    c = cands[-1]
    raise InvalidFieldError("tile/num_stages/group_block", (c.consts["TILE"], c.num_stages, c.consts["GROUP_P"]),
                            f"a configuration whose shared memory (bound {c.shared_bytes} B) fits the device's "
                            f"{shared_limit} B per block: a smaller tile, fewer stages or a smaller group_block")


@lru_cache(maxsize=1024)
def _launch_plan(args: tuple, types: tuple, limit) -> tuple[KernelConfig, tuple[KernelConfig, ...]]:
    """The configuration to launch and the ones to step down to, per distinct argument tuple:
    computed once (a decode step calls the wrapper per layer; recomputing the candidates each time
    was host time the GPU waited on, issue #24). ``types`` is part of the key so that ``tile=True``
    is not served what ``tile=1`` computed (equal and same hash, but one of them is refused)."""
    cfg = kernel_config(*args, shared_limit=limit)
    return cfg, tuple(_step_down(cfg, args))


def _step_down(cfg: KernelConfig, args: tuple) -> list[KernelConfig]:
    cands = candidate_configs(*args)
    return cands[cands.index(cfg):] if cfg in cands else [cfg]


def paged_attention_triton(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                           context_lens: torch.Tensor, query_rows: torch.Tensor, query_positions: torch.Tensor,
                           mask: AttentionMask = AttentionMask(), scale: float | None = None,
                           num_splits: int | None = None, tile: int | None = None,
                           num_warps: int | None = None, group_block: int | None = None,
                           validate: bool = True, num_stages: int | None = None) -> torch.Tensor:
    """Same contract as :func:`kvref.impl.torch.paged_attention.paged_attention`, as Triton kernels.

    ``kv_cache`` may be a strided view (``KVCacheTensors.kv``: pages padded to the widest group);
    only its innermost dimension must be contiguous. Tuning (results do not depend on them beyond
    rounding): ``num_splits`` (key-range partitions, at most :data:`MAX_SPLITS`, default
    :func:`default_splits`), ``tile`` (positions per loop step, a power of two; ``tl.dot`` is
    used when the tile and head size are >= 16), ``group_block`` (query heads per program, a power
    of two), ``num_warps`` and ``num_stages`` (CUDA only); defaults and the shared-memory fit in
    :func:`kernel_config`. Any head size, GQA ratio and block size (powers of two or not) is
    accepted: padding lanes and heads are masked.

    Offsets are int64 throughout (block ids, positions and program ids are widened before they
    meet a stride), so any cache torch can allocate is addressable; the one 32-bit value is the
    block table, copied to int32: pools of more than ``2**31 - 1`` blocks are rejected.

    ``validate=False`` skips the range checks of the arguments, which read device values back to
    the host (a device sync per check); for timing loops over arguments already checked once.
    """
    from .availability import require_triton

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
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or not 1 <= num_splits <= MAX_SPLITS):
        raise InvalidFieldError("num_splits", num_splits, f"an int from 1 to {MAX_SPLITS}")
    if num_warps is not None and (isinstance(num_warps, bool) or num_warps not in (1, 2, 4, 8, 16, 32)):
        raise InvalidFieldError("num_warps", num_warps, "a power of two from 1 to 32")
    on_cuda = dev.type == "cuda"
    args = (query.dtype, mask.kind, hq, hkv, d, bs, on_cuda, False, tile, num_warps, group_block, num_stages)
    limit = device_shared_limit(dev) if on_cuda else None
    try:
        cfg, rest = _launch_plan(args, tuple(map(type, args)), limit)
    except TypeError:  # an unhashable tuning value: the uncached path names it
        cfg = kernel_config(*args, shared_limit=limit)
        rest = None
    if num_splits is None:
        # The table's reach bounds the context without reading it back when not validating.
        max_keys = (int(context_lens.max()) if context_lens.numel() else 0) if validate else block_table.shape[1] * bs
        num_splits = default_splits(t * hkv * cfg.consts["HEAD_BLOCKS"], max_keys, cfg.consts["TILE"], dev)
    split = num_splits > 1
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    q = query.to(dev).contiguous()
    # Triton's interpreter converts float32 to bfloat16 by truncation (half of the values land one
    # unit below a compiled kernel's round-to-nearest-even): interpreted, the output is stored in
    # float32 and rounded by torch, so CPU runs show the compiled kernel's rounding.
    trunc = not on_cuda and q.dtype == torch.bfloat16
    out = torch.empty(q.shape, dtype=acc if trunc else q.dtype, device=dev)
    if t == 0:
        return out.to(q.dtype)
    table = block_table.to(dev).to(torch.int32).contiguous()
    ctx = context_lens.to(dev).to(torch.int64).contiguous()
    rows = query_rows.to(dev).to(torch.int64).contiguous()
    qpos = query_positions.to(dev).to(torch.int64).contiguous()
    # torch.full, not torch.tensor: a host value copied to the device is a blocking copy (a stream
    # sync per call, the GPU idle while Python prepares the next launch); a fill is a launch
    scale_t = torch.full((1,), d ** -0.5 if scale is None else scale, dtype=acc, device=dev)
    if split:
        part = torch.empty((t, hq, num_splits, d), dtype=acc, device=dev)
        m = torch.empty((t, hq, num_splits), dtype=acc, device=dev)
        l_ = torch.empty_like(m)
        dst, strides = part, (part.stride(0), part.stride(1), part.stride(2), m.stride(0), m.stride(1))
    else:
        m = l_ = scale_t  # unused
        dst, strides = out, (out.stride(0), out.stride(1), 0, 0, 0)
    run_args = (q, kv_cache, dst, table, ctx, rows, qpos, scale_t, m, l_, q.stride(0), q.stride(1), *strides,
                kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), table.stride(0),
                mask.size if mask.kind != "causal" else 1, num_splits)
    _launch_pass1(cfg, args, limit, split, (t, hkv * cfg.consts["HEAD_BLOCKS"], num_splits), run_args, rest)
    if split:
        _combine_kernel[(t, hq)](part, m, l_, out, part.stride(0), part.stride(1), part.stride(2), m.stride(0),
                                 m.stride(1), out.stride(0), out.stride(1), num_splits, HEAD=d, HEAD_P=_pow2(d),
                                 SPLITS_P=_pow2(num_splits), ACC_F64=acc == torch.float64,
                                 **({"num_warps": 4} if on_cuda else {}))
    return out.to(q.dtype) if trunc else out


def _launch_pass1(cfg: KernelConfig, args: tuple, limit, split: bool, grid: tuple, run_args: tuple,
                  rest: tuple | None = None) -> None:
    """Launch pass 1 with ``cfg``; on CUDA, should the compiled kernel still ask for more shared
    memory than the device has (a compiler laying out differently from the bound), step down
    through the remaining candidates of the same tuning instead of failing (issue #24)."""
    if cfg.num_warps is None:
        _paged_attention_kernel[grid](*run_args, **dict(cfg.consts, SPLIT=split))
        return
    from triton.runtime.errors import OutOfResources

    if rest is None:
        rest = _step_down(cfg, args)
    for i, c in enumerate(rest):
        consts = dict(c.consts, SPLIT=split)
        try:
            _paged_attention_kernel[grid[:1] + (grid[1] // cfg.consts["HEAD_BLOCKS"] * c.consts["HEAD_BLOCKS"],)
                                    + grid[2:]](*run_args, **consts, num_warps=c.num_warps, num_stages=c.num_stages)
            return
        except OutOfResources:
            if i == len(rest) - 1:
                raise
