"""The K/V write of a step's new tokens through the slot mapping, as a Triton kernel.

One program per token: ``slot = block * block_size + offset`` picks the page and the row in it,
and the token's ``[Hkv, D]`` keys and values are stored there (K half, then V half of the page).
Elements are stored as they are, never re-rounded: the caller casts to the cache's dtype first,
so the cache holds the same bits the torch path (``KVCacheTensors.write_kv``) writes. A negative
slot (vLLM's ``PAD_SLOT_ID = -1`` for padded tokens) is skipped by the kernel; the public entry
rejects it, like the torch path, because nothing in kvref pads, unless ``allow_padding=True``
(then ``-1`` entries are skipped, as vLLM's ``reshape_and_cache`` skips them; any other negative
slot is still an error). Offsets are int64 (slot, token index), so any pool torch can allocate
is addressable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvref.spec.errors import InvalidFieldError


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, cache_ptr, slots_ptr, stride_kt, stride_vt, stride_cb, stride_ckv, stride_cs,
                     BLOCK_SIZE: tl.constexpr, ROW: tl.constexpr, ROW_P: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot >= 0:
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        i = tl.arange(0, ROW_P)
        m = i < ROW
        dst = cache_ptr + blk * stride_cb + off * stride_cs + i
        tl.store(dst, tl.load(k_ptr + t * stride_kt + i, mask=m), mask=m)
        tl.store(dst + stride_ckv, tl.load(v_ptr + t * stride_vt + i, mask=m), mask=m)


def write_kv_triton(kv_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    allow_padding: bool = False) -> None:
    """Store ``k``/``v`` (``[T, Hkv, D]``) at ``slots`` (``[T]``) of one layer's ``kv_cache``
    (``[num_blocks, 2, block_size, Hkv, D]``, a view whose ``[Hkv, D]`` rows are contiguous).
    ``allow_padding``: skip tokens whose slot is ``-1`` (vLLM's ``PAD_SLOT_ID``)."""
    from .availability import require_triton

    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise InvalidFieldError("kv_cache", tuple(kv_cache.shape), "[num_blocks, 2, block_size, Hkv, D]")
    nb, _, bs, hkv, d = kv_cache.shape
    want = (slots.shape[0], hkv, d) if slots.dim() == 1 else None
    if want is None or tuple(k.shape) != want or tuple(v.shape) != want:
        raise InvalidFieldError("k/v", (tuple(k.shape), tuple(v.shape)), f"[T, Hkv, D] = {want} matching slots [T]")
    if not isinstance(allow_padding, bool):
        raise InvalidFieldError("allow_padding", allow_padding, "a bool")
    low = -1 if allow_padding else 0
    if slots.numel() and (int(slots.min()) < low or int(slots.max()) >= nb * bs):
        raise InvalidFieldError("slots", "out of range", f"slots in [{low}, {nb * bs})"
                                + (" (-1: a padded token, skipped)" if allow_padding else ""))
    if kv_cache.stride(4) != 1 or kv_cache.stride(3) != d:
        raise InvalidFieldError("kv_cache", tuple(kv_cache.stride()), "a view with contiguous [Hkv, D] rows")
    require_triton(kv_cache.device)
    if not slots.numel():
        return
    dev = kv_cache.device
    kk = k.to(device=dev, dtype=kv_cache.dtype).reshape(k.shape[0], hkv * d).contiguous()
    vv = v.to(device=dev, dtype=kv_cache.dtype).reshape(v.shape[0], hkv * d).contiguous()
    sl = slots.to(dev).to(torch.int64).contiguous()
    row = hkv * d
    _write_kv_kernel[(sl.shape[0],)](kk, vv, kv_cache, sl, kk.stride(0), vv.stride(0),
                                     kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
                                     BLOCK_SIZE=bs, ROW=row, ROW_P=1 << max(0, (row - 1).bit_length()))
