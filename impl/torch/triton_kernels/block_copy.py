"""Whole-page block copies between two block arrays, as a Triton kernel (the offload data path).

An offload job is a list of ``(src_block, dst_block)`` pairs; one program copies one ``CHUNK``
of one page, so a job of ``n`` pages of ``P`` elements runs ``n * ceil(P / CHUNK)`` programs and
every page moves in parallel, whether or not the ids are contiguous (the torch path merges runs
instead and issues one ``copy_`` per run). Pages are moved as raw integers of the element width
(``view(int16/int32/int64)``): a copy is bit-exact by construction, NaN payloads included.

On CUDA the host side is a pinned buffer, which kernels address directly (unified virtual
addressing; Triton accepts pinned tensors since triton-lang/triton#1197), so a store is the
kernel writing over PCIe/NVLink into host memory and a load the kernel reading from it — no
``cudaMemcpy``. On CPU tensors it runs in Triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvref.spec.errors import InvalidFieldError

CHUNK = 1024
_AS_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _copy_blocks_kernel(src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, stride_src, stride_dst, page,
                        CHUNK: tl.constexpr):
    p = tl.program_id(0)
    c = tl.program_id(1)
    s = tl.load(src_ids_ptr + p).to(tl.int64)
    d = tl.load(dst_ids_ptr + p).to(tl.int64)
    i = c * CHUNK + tl.arange(0, CHUNK)
    m = i < page
    tl.store(dst_ptr + d * stride_dst + i, tl.load(src_ptr + s * stride_src + i, mask=m), mask=m)


def launch_device(src: torch.Tensor, dst: torch.Tensor) -> torch.device:
    """The device a copy between ``src`` and ``dst`` launches on: the CUDA side when either is on
    CUDA (then the other, if on the host, must be pinned: a kernel cannot address pageable
    memory), else the CPU (the interpreter).

    The host side is the tensor that is *not* on CUDA. Issue #24: the first version asked the CUDA
    tensor whether it was pinned (always False), so every store/load through
    ``OffloadCopier(backend="triton")`` on CUDA was refused with "unpinned host tensor".
    """
    if src.is_cuda and dst.is_cuda and src.device != dst.device:
        raise InvalidFieldError("src/dst", (str(src.device), str(dst.device)), "tensors on one CUDA device")
    if not (src.is_cuda or dst.is_cuda):
        return src.device
    cuda_side, host_side = (src, dst) if src.is_cuda else (dst, src)
    if host_side.device.type not in ("cpu", "cuda"):
        raise InvalidFieldError("src/dst", str(host_side.device), "a CUDA tensor and a pinned host (cpu) tensor")
    if not host_side.is_cuda and not host_side.is_pinned():
        raise InvalidFieldError("src/dst", "unpinned host tensor", "a pinned host tensor beside a CUDA tensor "
                                "(torch.empty(..., pin_memory=True); see offload_copy.host_buffer)")
    return torch.device("cuda", cuda_side.device.index or 0)


def copy_blocks_triton(src: torch.Tensor, dst: torch.Tensor, src_ids, dst_ids, chunk: int = CHUNK) -> None:
    """``dst[dst_ids[i]] = src[src_ids[i]]`` for whole rows (pages) of two ``[blocks, page]`` tensors.

    The ids are lists or 1-D tensors of equal length; destinations must be distinct (a copy writes
    each destination once). One of ``src``/``dst`` may be a pinned host tensor when the other is on
    CUDA; the launch goes to the CUDA side.
    """
    from . import require_triton

    if src.dim() != 2 or dst.dim() != 2 or src.shape[1] != dst.shape[1] or src.dtype != dst.dtype:
        raise InvalidFieldError("src/dst", (tuple(src.shape), src.dtype, tuple(dst.shape), dst.dtype),
                                "two [blocks, page] tensors with the same page size and dtype")
    if src.stride(1) != 1 or dst.stride(1) != 1:
        raise InvalidFieldError("src/dst", (src.stride(), dst.stride()), "pages with contiguous elements")
    s_ids = torch.as_tensor(src_ids, dtype=torch.int64).reshape(-1)
    d_ids = torch.as_tensor(dst_ids, dtype=torch.int64).reshape(-1)
    if s_ids.shape != d_ids.shape:
        raise InvalidFieldError("src_ids/dst_ids", (s_ids.numel(), d_ids.numel()), "two id lists of equal length")
    if s_ids.numel() and (int(s_ids.min()) < 0 or int(s_ids.max()) >= src.shape[0]):
        raise InvalidFieldError("src_ids", s_ids.tolist(), f"ids in [0, {src.shape[0]})")
    if d_ids.numel() and (int(d_ids.min()) < 0 or int(d_ids.max()) >= dst.shape[0]):
        raise InvalidFieldError("dst_ids", d_ids.tolist(), f"ids in [0, {dst.shape[0]})")
    if len(set(d_ids.tolist())) != d_ids.numel():
        raise InvalidFieldError("dst_ids", d_ids.tolist(), "distinct destination blocks")
    if chunk < 1 or chunk & (chunk - 1):
        raise InvalidFieldError("chunk", chunk, "a power of two")
    launch = launch_device(src, dst)
    require_triton(launch)
    if not s_ids.numel():
        return
    as_int = _AS_INT[src.element_size()]
    s_view, d_view = src.view(as_int), dst.view(as_int)
    page = src.shape[1]
    grid = (s_ids.numel(), triton.cdiv(page, chunk))
    if launch.type == "cuda":
        with torch.cuda.device(launch):
            _copy_blocks_kernel[grid](s_view, d_view, s_ids.to(launch), d_ids.to(launch),
                                      s_view.stride(0), d_view.stride(0), page, CHUNK=chunk)
    else:
        _copy_blocks_kernel[grid](s_view, d_view, s_ids, d_ids, s_view.stride(0), d_view.stride(0), page,
                                  CHUNK=chunk)
