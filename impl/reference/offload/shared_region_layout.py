"""The layout of the CPU offload tier's shared host region (vLLM's ``SharedOffloadRegion``,
``v1/kv_offload/cpu/shared_offload_region.py``), as pure functions.

Every worker of one engine maps the same ``/dev/shm/vllm_offload_<engine>.mmap`` file (split into
several files beneath one contiguous mapping when it is large), ``num_chunks`` rows of
``row_stride`` bytes. Row ``c`` holds, per worker ``r``, a ``cpu_page_size`` slot at
``c * row_stride + r * cpu_page_size`` into which that worker's tensors are packed one after the
other (a worker view); in the canonical layout every worker instead shares views carved from the
start of each row. What a worker pre-faults are its slots, rounded out to pages, starting on a
different file per worker when the region is split (so the workers fault different files first).

The region's files are pure plumbing, but where a worker's KV bytes land is what a load reads
back: a view one slot off, or a segment mapped at the wrong offset, returns another worker's (or
another chunk's) KV. :mod:`kvref.models.machines.shared_offload_region` compares vLLM's region
with these functions and with the bytes every worker sees.
"""

from __future__ import annotations

from kvref.spec.errors import InvalidFieldError, check_int
from kvref.spec.mathutil import cdiv


#: the most chunk rows the functions lay out (a list per row is returned: refuse absurd sizes)
MAX_CHUNKS = 1 << 24


def _round_up(x: int, m: int) -> int:
    return cdiv(x, m) * m


def region_segments(mmap_path: str, num_chunks: int, row_stride: int, num_segments: int,
                    min_segment_bytes: int) -> list[tuple[str, int, int]]:
    """``(path, byte offset, length)`` per backing file: at most ``num_segments`` files of whole
    rows, none smaller than ``min_segment_bytes`` (one file when the region is too small to
    split); the first file is ``mmap_path`` itself, the others ``mmap_path.<i>``."""
    for name, value, low in (("num_chunks", num_chunks, 0), ("row_stride", row_stride, 1),
                             ("num_segments", num_segments, 1), ("min_segment_bytes", min_segment_bytes, 1)):
        check_int(name, value, minimum=low)
    if num_chunks > MAX_CHUNKS:
        raise InvalidFieldError("num_chunks", num_chunks, f"an int in [0, {MAX_CHUNKS}]")
    total = num_chunks * row_stride
    segments = min(num_segments, total // min_segment_bytes)
    rows = max(1, cdiv(num_chunks, max(1, segments)))
    return [(f"{mmap_path}.{i}" if i else mmap_path, row * row_stride, min(rows, num_chunks - row) * row_stride)
            for i, row in enumerate(range(0, max(num_chunks, 1), rows))]


def worker_slot_ranges(rank: int, num_chunks: int, row_stride: int, cpu_page_size: int, page_size: int,
                       segmented: bool) -> list[tuple[int, int]]:
    """The page-aligned ``(offset, length)`` ranges of worker ``rank``'s slots, one per row, in the
    order it pre-faults them: from row ``rank * num_chunks // workers_per_row`` on (wrapping) when
    the region spans several files, else from row 0."""
    for name, value, low in (("rank", rank, 0), ("num_chunks", num_chunks, 0), ("row_stride", row_stride, 1),
                             ("cpu_page_size", cpu_page_size, 1), ("page_size", page_size, 1)):
        check_int(name, value, minimum=low)
    if num_chunks > MAX_CHUNKS:
        raise InvalidFieldError("num_chunks", num_chunks, f"an int in [0, {MAX_CHUNKS}]")
    if cpu_page_size > row_stride:
        raise InvalidFieldError("cpu_page_size", cpu_page_size, f"<= row_stride={row_stride} (a row holds every slot)")
    first = rank * num_chunks // (row_stride // cpu_page_size) if segmented else 0
    out = []
    for i in range(num_chunks):
        start = ((first + i) % num_chunks) * row_stride + rank * cpu_page_size
        aligned = start - start % page_size
        out.append((aligned, _round_up(start + cpu_page_size, page_size) - aligned))
    return out


def worker_view_offsets(rank: int, cpu_page_size: int, sizes: list[int]) -> list[int | None]:
    """The storage offset (within row 0) of each of worker ``rank``'s tensor views, packed in its
    slot; None for one that would overflow the slot (refused, nothing allocated)."""
    check_int("rank", rank, minimum=0)
    check_int("cpu_page_size", cpu_page_size, minimum=1)
    if not isinstance(sizes, list) or any(type(s) is not int or s < 0 for s in sizes):
        raise InvalidFieldError("sizes", sizes, "a list of tensor page sizes (ints >= 0)")
    out: list[int | None] = []
    offset, end = rank * cpu_page_size, (rank + 1) * cpu_page_size
    for s in sizes:
        if offset + s > end:
            out.append(None)  # refused: the next view starts where this one would have
            continue
        out.append(offset)
        offset += s
    return out


def canonical_view_offsets(row_stride: int, sizes: list[int]) -> list[int | None]:
    """The storage offsets of the canonical views, carved from the start of every row; None for
    one that would not fit in the row."""
    check_int("row_stride", row_stride, minimum=1)
    return worker_view_offsets(0, row_stride, sizes)
