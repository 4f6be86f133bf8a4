"""vLLM 0.33.0's ``SharedOffloadRegion`` (the CPU offload tier's ``/dev/shm`` region) built for
several workers of one engine in this process, as its workers build it (#22).

With a barrier the workers are threads that meet at a ``threading.Barrier`` (vLLM's workers meet
at a collective): whichever opens the file first creates it, the others join and wait for its
size, and the path is unlinked once all have mapped it. Without one they are built one after the
other and the creator unlinks at ``cleanup()``. Compared with the layout functions of
:mod:`kvref.impl.reference.offload.shared_region_layout` by
:mod:`kvref.models.machines.shared_offload_region`.

``min_segment_bytes`` lowers vLLM's ``_MIN_SEGMENT_BYTES`` (1 GiB) while the regions are built,
so that small test regions are split into several files as multi-GiB ones are (one mapping over
back-to-back files, ``_map_segments``); everything else runs as released.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any


@contextlib.contextmanager
def _segment_minimum(min_segment_bytes: int):
    import vllm.v1.kv_offload.cpu.shared_offload_region as mod

    saved = mod._MIN_SEGMENT_BYTES
    mod._MIN_SEGMENT_BYTES = min_segment_bytes
    try:
        yield
    finally:
        mod._MIN_SEGMENT_BYTES = saved


def build_regions(engine_id: str, num_chunks: int, ranks: list[int | None], kv_bytes_per_chunk: int,
                  cpu_page_size: int, *, barrier: bool, populate_shard: bool, num_segments: int,
                  min_segment_bytes: int, fail_first_creator: bool = False) -> list[Any]:
    """One region (or the exception its construction raised) per entry of ``ranks``.

    ``fail_first_creator``: the first worker's creator memory check refuses (vLLM then removes
    the files it made and re-raises)."""
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    n = len(ranks)
    meet = threading.Barrier(n, timeout=30) if barrier else None
    out: list[Any] = [None] * n

    def refuse(size: int) -> None:
        raise MemoryError(f"kvref: planted refusal of {size} bytes")

    def build(i: int) -> None:
        try:
            out[i] = SharedOffloadRegion(
                engine_id, num_chunks, ranks[i], kv_bytes_per_chunk, cpu_page_size,
                barrier=meet.wait if meet is not None else None,
                creator_memory_check=refuse if fail_first_creator and i == 0 else None,
                populate_shard=(i, n) if populate_shard else None, num_segments=num_segments)
        except BaseException as exc:  # noqa: BLE001 - compared as an outcome
            out[i] = exc

    with _segment_minimum(min_segment_bytes):
        if barrier:
            threads = [threading.Thread(target=build, args=(i,)) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
        else:
            for i in range(n):
                build(i)
    return out


def region_segments(region: Any) -> list[tuple[str, int, int]]:
    return [tuple(s) for s in region._segments]


def slot_ranges(region: Any) -> list[tuple[int, int]]:
    return list(region.iter_worker_slot_ranges())


def add_views(region: Any, sizes: list[int], canonical: bool) -> list[Any]:
    """The views for ``sizes`` (None where vLLM refuses one: its slot or row is full)."""
    make = region.create_next_canonical_view if canonical else region.create_next_worker_view
    views = []
    for s in sizes:
        try:
            views.append(make(s))
        except AssertionError:
            views.append(None)
    return views


def kv_memoryview(region: Any) -> memoryview:
    return region.create_kv_memoryview()


def base_bytes(region: Any) -> bytes:
    return region.base_tensor.numpy().tobytes()


def cleanup(region: Any) -> tuple[bool, bool]:
    """``cleanup()``; returns (mapping kept, fd closed): vLLM keeps a mapping a native user still
    exports (a live memoryview of it) rather than unmap it under them."""
    import logging

    log = logging.getLogger("vllm.v1.kv_offload.cpu.shared_offload_region")
    level = log.level
    log.setLevel(logging.ERROR)  # "Keeping ... mapped" is the outcome being checked, not news
    try:
        region.cleanup()
    finally:
        log.setLevel(level)
    return region.mmap_obj is not None, region.fd is None
