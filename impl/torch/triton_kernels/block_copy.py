"""Whole-page block copies between two block arrays, as a Triton kernel (the offload data path).

An offload job is a list of ``(src_block, dst_block)`` pairs over every layer; one program
copies one ``CHUNK`` of one page of one layer, so a job of ``n`` pages of ``P`` words over ``L``
layers is ONE launch of ``n * ceil(P / CHUNK) * L`` programs and every page moves in parallel,
whether or not the ids are contiguous (the torch path merges runs instead and issues one
``copy_`` per run and layer: a scattered job is one copy per block, issue #24). The layers'
base addresses travel in a small int64 table (cast to pointers in the kernel). Pages are moved
as raw integer words — 8 bytes where sizes, strides and addresses allow, down to the element
width — so a copy is bit-exact by construction, NaN payloads included.

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
_TL_INT = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}


@triton.jit
def _copy_pages_kernel(src_addr_ptr, dst_addr_ptr, src_stride_ptr, dst_stride_ptr, src_ids_ptr, dst_ids_ptr, page,
                       CHUNK: tl.constexpr, WORD: tl.constexpr, VEC: tl.constexpr):
    """``dst[layer][dst_ids[p]] = src[layer][src_ids[p]]`` for one ``CHUNK`` of one page of one
    layer; the layers' base addresses and row strides (in words) come from small tables, so a
    whole job — every pair of every layer — is one launch. Addresses, row strides and the page
    are multiples of 16 bytes (``VEC`` words; checked by the wrapper), which the compiler is told:
    rows move as 16-byte vectors."""
    p = tl.program_id(0)
    c = tl.program_id(1)
    layer = tl.program_id(2)
    src_base = tl.multiple_of(tl.multiple_of(tl.load(src_addr_ptr + layer), 16).to(tl.pointer_type(WORD)), 16)
    dst_base = tl.multiple_of(tl.multiple_of(tl.load(dst_addr_ptr + layer), 16).to(tl.pointer_type(WORD)), 16)
    s_row = tl.multiple_of(tl.load(src_ids_ptr + p).to(tl.int64) * tl.load(src_stride_ptr + layer), VEC)
    d_row = tl.multiple_of(tl.load(dst_ids_ptr + p).to(tl.int64) * tl.load(dst_stride_ptr + layer), VEC)
    page = tl.multiple_of(page, VEC)
    i = c * CHUNK + tl.arange(0, CHUNK)
    m = i < page
    tl.store(dst_base + d_row + i, tl.load(src_base + s_row + i, mask=m), mask=m)


def _word(tensors: list[torch.Tensor]) -> int:
    """The widest integer word (bytes) that divides every row's bytes, stride and address: pages
    move as raw words (bit-exact by construction, NaN payloads included), 8-byte words where the
    layout allows (16-byte vectors of two)."""
    size = 8
    for t in tensors:
        e = t.element_size()
        for v in (t.shape[1] * e, t.stride(0) * e, t.data_ptr()):
            while v % size:
                size //= 2
    return max(size, 1)


def copy_pages_triton(srcs: list[torch.Tensor], dsts: list[torch.Tensor], src_ids, dst_ids,
                      chunk: int = CHUNK, num_warps: int | None = None, validate_ids: bool = True) -> None:
    """``dsts[l][dst_ids[i]] = srcs[l][src_ids[i]]`` for every layer ``l`` and pair ``i``, as ONE
    kernel launch (issue #24: the torch copier's scattered jobs cost one ``copy_`` per block and
    reached 9-14 % of a pinned-host copy). Each ``srcs[l]``/``dsts[l]`` is a ``[blocks, page]``
    tensor with contiguous pages, all of one dtype and page size; the ids are lists or 1-D
    tensors of equal length with distinct destinations. One side may be pinned host memory when
    the other is on CUDA (the kernel reads or writes it directly); on CPU tensors the kernel runs
    in Triton's interpreter. ``chunk`` (words per program) and ``num_warps`` (CUDA only) tune the
    launch; neither changes what is copied. ``validate_ids=False`` skips the range and
    distinctness checks of the ids, for a caller that checked them against the same bounds.
    A caller copying between the same tensors job after job keeps a :class:`PageCopyPlan`
    instead (the offload copier: the tensor checks and layer tables once, issue #24)."""
    if validate_ids is not True and validate_ids is not False:
        raise InvalidFieldError("validate_ids", validate_ids, "True or False")
    PageCopyPlan(srcs, dsts, chunk, num_warps).launch(src_ids, dst_ids, validate_ids=validate_ids)


class PageCopyPlan:
    """Everything of a :func:`copy_pages_triton` launch that depends only on the tensors: checked
    once, the layer table (base addresses and row strides) built once and kept on the launch
    device. ``launch`` then only moves the job's ids (one small pinned copy) and launches: on an
    H200 host the per-call tensor checks and tables were ~0.3 ms of a 2.9 ms scattered job, time
    the device sat idle (issue #24). The plan keeps its tensors alive; it is valid while their
    storage is (an offload copier's own cache and host buffers)."""

    def __init__(self, srcs: list[torch.Tensor], dsts: list[torch.Tensor], chunk: int = CHUNK,
                 num_warps: int | None = None) -> None:
        from .availability import require_triton

        if not isinstance(srcs, (list, tuple)) or not isinstance(dsts, (list, tuple)) or len(srcs) != len(dsts) \
                or not srcs:
            raise InvalidFieldError("srcs/dsts", (type(srcs).__name__, type(dsts).__name__),
                                    "two equally long, non-empty lists of [blocks, page] tensors (one per layer)")
        first = srcs[0]
        if not isinstance(first, torch.Tensor):
            raise InvalidFieldError("srcs", type(first).__name__, "tensors")
        for a in list(srcs) + list(dsts):
            if not isinstance(a, torch.Tensor) or a.dim() != 2 or a.shape[1] != first.shape[1] \
                    or a.dtype != first.dtype:
                raise InvalidFieldError("src/dst", (tuple(getattr(a, "shape", ())), getattr(a, "dtype", None),
                                                    tuple(first.shape), first.dtype),
                                        "two [blocks, page] tensors with the same page size and dtype")
            if a.stride(1) != 1:
                raise InvalidFieldError("src/dst", tuple(a.stride()), "pages with contiguous elements")
        launches = {launch_device(a, b) for a, b in zip(srcs, dsts)}
        if len(launches) != 1:
            raise InvalidFieldError("srcs/dsts", sorted(map(str, launches)), "every layer on one device pair")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1 or chunk & (chunk - 1):
            raise InvalidFieldError("chunk", chunk, "a power of two")
        if num_warps is not None and (isinstance(num_warps, bool) or num_warps not in (1, 2, 4, 8, 16, 32)):
            raise InvalidFieldError("num_warps", num_warps, "a power of two from 1 to 32")
        self.launch_on = launches.pop()
        require_triton(self.launch_on)
        self.srcs, self.dsts, self.chunk, self.num_warps = list(srcs), list(dsts), chunk, num_warps
        self.n_src, self.n_dst = min(a.shape[0] for a in srcs), min(a.shape[0] for a in dsts)
        self.word = _word(self.srcs + self.dsts)
        elem = first.element_size()
        self.page = first.shape[1] * elem // self.word
        self.aligned = all(a.data_ptr() % 16 == 0 and a.stride(0) * elem % 16 == 0 for a in self.srcs + self.dsts) \
            and first.shape[1] * elem % 16 == 0
        table = torch.tensor([a.data_ptr() for a in self.srcs] + [a.data_ptr() for a in self.dsts]
                             + [a.stride(0) * elem // self.word for a in self.srcs]
                             + [a.stride(0) * elem // self.word for a in self.dsts], dtype=torch.int64)
        if self.launch_on.type == "cuda":  # non-blocking from pinned memory: building a plan never syncs
            table = table.pin_memory().to(self.launch_on, non_blocking=True)
        self.tables = table.split([len(srcs)] * 4)

    def launch(self, src_ids, dst_ids, validate_ids: bool = True) -> None:
        """Copy ``src_ids[i]`` to ``dst_ids[i]`` in every layer (lists or 1-D int tensors)."""
        s_ids = torch.as_tensor(src_ids, dtype=torch.int64).reshape(-1)
        d_ids = torch.as_tensor(dst_ids, dtype=torch.int64).reshape(-1)
        if s_ids.shape != d_ids.shape:
            raise InvalidFieldError("src_ids/dst_ids", (s_ids.numel(), d_ids.numel()), "two id lists of equal length")
        if validate_ids:
            _check_ids(s_ids, d_ids, self.n_src, self.n_dst)
        n = s_ids.numel()
        if not n:
            return
        # both id lists travel in ONE copy, from pinned memory and non-blocking on CUDA (a blocking
        # copy is a stream sync per job; the caching host allocator keeps the pinned buffer alive
        # until the copy has run)
        ids = torch.cat([s_ids.cpu(), d_ids.cpu()])
        if self.launch_on.type == "cuda":
            ids = ids.pin_memory().to(self.launch_on, non_blocking=True)
        args = (*self.tables, *ids.split([n, n]), self.page)
        grid = (n, triton.cdiv(self.page, self.chunk), len(self.srcs))
        kernel, hint = (_copy_pages_kernel, dict(VEC=16 // self.word)) if self.aligned \
            else (_copy_pages_kernel_unaligned, {})
        if self.launch_on.type == "cuda":
            with torch.cuda.device(self.launch_on):
                tuning = {"num_warps": self.num_warps} if self.num_warps else {}
                kernel[grid](*args, CHUNK=self.chunk, WORD=_TL_INT[self.word], **hint, **tuning)
        else:
            kernel[grid](*args, CHUNK=self.chunk, WORD=_TL_INT[self.word], **hint)


@triton.jit
def _copy_pages_kernel_unaligned(src_addr_ptr, dst_addr_ptr, src_stride_ptr, dst_stride_ptr, src_ids_ptr,
                                 dst_ids_ptr, page, CHUNK: tl.constexpr, WORD: tl.constexpr):
    """:func:`_copy_pages_kernel` without the 16-byte alignment hint (a tensor view whose pages
    start off a 16-byte boundary)."""
    p = tl.program_id(0)
    c = tl.program_id(1)
    layer = tl.program_id(2)
    src_base = tl.load(src_addr_ptr + layer).to(tl.pointer_type(WORD))
    dst_base = tl.load(dst_addr_ptr + layer).to(tl.pointer_type(WORD))
    s_row = tl.load(src_ids_ptr + p).to(tl.int64) * tl.load(src_stride_ptr + layer)
    d_row = tl.load(dst_ids_ptr + p).to(tl.int64) * tl.load(dst_stride_ptr + layer)
    i = c * CHUNK + tl.arange(0, CHUNK)
    m = i < page
    tl.store(dst_base + d_row + i, tl.load(src_base + s_row + i, mask=m), mask=m)


def _check_ids(s_ids: torch.Tensor, d_ids: torch.Tensor, n_src: int, n_dst: int) -> None:
    if s_ids.numel() and (int(s_ids.min()) < 0 or int(s_ids.max()) >= n_src):
        raise InvalidFieldError("src_ids", s_ids.tolist(), f"ids in [0, {n_src})")
    if d_ids.numel() and (int(d_ids.min()) < 0 or int(d_ids.max()) >= n_dst):
        raise InvalidFieldError("dst_ids", d_ids.tolist(), f"ids in [0, {n_dst})")
    if len(set(d_ids.tolist())) != d_ids.numel():
        raise InvalidFieldError("dst_ids", d_ids.tolist(), "distinct destination blocks")


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
    """``dst[dst_ids[i]] = src[src_ids[i]]`` for whole rows (pages) of two ``[blocks, page]`` tensors
    (one layer of :func:`copy_pages_triton`: one launch)."""
    copy_pages_triton([src], [dst], src_ids, dst_ids, chunk)
