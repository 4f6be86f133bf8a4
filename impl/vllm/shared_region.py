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

The host conditions a worker meets in the field are played too: a kernel older than 5.14 (no
``MADV_POPULATE_WRITE``: ``madvise`` fails with EINVAL and vLLM pre-faults page by page, keeping
bytes a peer already wrote), a ``madvise`` that fails otherwise (the error must surface and the
half-built region be released), a collective that fails at the barrier, and a creator that fails
while joiners already opened its file (they must give up, not spin for 30 s).
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from typing import Any, Callable

from kvref.spec.errors import InvalidFieldError

#: how long a joiner waits for the creator to size the file (vLLM's 30 s default shortened: the
#: workers here are threads of one process, and a creator that never sizes it, e.g. one failing
#: without removing its file, must show within a check's budget as the joiners' TimeoutError)
JOIN_TIMEOUT_S = 10.0

#: how ``madvise(MADV_POPULATE_WRITE)`` behaves on the simulated host: the real kernel's, a kernel
#: without it (EINVAL), or a refusal (EPERM)
POPULATE_MODES = ("kernel", "fallback", "error")


@contextlib.contextmanager
def _segment_minimum(min_segment_bytes: int):
    import vllm.v1.kv_offload.cpu.shared_offload_region as mod

    saved = mod._MIN_SEGMENT_BYTES
    mod._MIN_SEGMENT_BYTES = min_segment_bytes
    try:
        yield
    finally:
        mod._MIN_SEGMENT_BYTES = saved


@contextlib.contextmanager
def _join_timeout(seconds: float | None = None):
    import vllm.v1.kv_offload.cpu.shared_offload_region as mod

    fn = mod._wait_for_file_size
    saved = fn.__defaults__
    fn.__defaults__ = (JOIN_TIMEOUT_S if seconds is None else seconds,)
    try:
        yield
    finally:
        fn.__defaults__ = saved


@contextlib.contextmanager
def _quiet_region_log():
    """vLLM's region warnings (a kept mapping, the per-page fallback, peers released after a
    failure) are the outcomes being checked, not news."""
    import logging

    log = logging.getLogger("vllm.v1.kv_offload.cpu.shared_offload_region")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


@contextlib.contextmanager
def _populate_mode(mode: str):
    """vLLM's ``_madvise_populate_write`` as the host in ``mode`` answers it (module global, read
    at each call by ``_get_populate_write_fn``)."""
    import vllm.v1.kv_offload.cpu.shared_offload_region as mod

    if mode == "kernel":
        yield
        return
    code = errno.EINVAL if mode == "fallback" else errno.EPERM

    def refused(mmap_obj, offset: int, length: int) -> None:
        raise OSError(code, f"kvref: madvise(MADV_POPULATE_WRITE) refused ({errno.errorcode[code]})")

    saved = mod._madvise_populate_write
    mod._madvise_populate_write = refused
    try:
        yield
    finally:
        mod._madvise_populate_write = saved


def open_fds(path_prefix: str) -> int:
    """How many of this process's descriptors refer to a file whose path starts with the prefix
    (unlinked ones included: the kernel names them ``<path> (deleted)``)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}").startswith(path_prefix):
                n += 1
    return n


def mapped(path_prefix: str) -> bool:
    """Whether any mapping of this process is backed by a file whose path starts with the prefix."""
    with open("/proc/self/maps") as f:
        return any(path_prefix in line for line in f)


def _refuse_after_joiners(path: str, joiners: int) -> Callable[[int], None]:
    """A creator memory check that refuses once ``joiners`` other workers opened the file."""
    def refuse(size: int) -> None:
        import time

        deadline = time.monotonic() + 20
        while open_fds(path) < joiners + 1 and time.monotonic() < deadline:
            time.sleep(0.002)
        raise MemoryError(f"kvref: planted refusal of {size} bytes after {joiners} joiners opened the file")
    return refuse


def _failing_barrier(worker: int) -> Callable[[], None]:
    calls = [0]

    def barrier() -> None:
        calls[0] += 1
        raise RuntimeError(f"kvref: collective failed (worker {worker}, call {calls[0]})")
    return barrier


def build_regions(engine_id: str, num_chunks: int, ranks: list[int | None], kv_bytes_per_chunk: int,
                  cpu_page_size: int, *, barrier: bool, populate_shard: bool, num_segments: int,
                  min_segment_bytes: int, fail_first_creator: bool = False, creator_fails_late: bool = False,
                  barrier_fails: bool = False, populate: str = "kernel",
                  after_first: Callable[[Any], None] | None = None,
                  join_timeout_s: float | None = None) -> list[Any]:
    """One region (or the exception its construction raised) per entry of ``ranks``.

    ``fail_first_creator``: the first worker's creator memory check refuses (vLLM then removes
    the files it made and re-raises). ``creator_fails_late`` (with a barrier): whichever worker
    creates the file refuses once every other worker opened it. ``barrier_fails``: each worker's
    barrier raises at every call. ``populate``: one of :data:`POPULATE_MODES`. ``after_first``
    (without a barrier): called with the first region built, before the next worker builds.
    ``join_timeout_s``: how long a joiner waits for the file's size (default :data:`JOIN_TIMEOUT_S`)."""
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    n = len(ranks)
    meet = threading.Barrier(n, timeout=30) if barrier else None
    out: list[Any] = [None] * n

    def refuse(size: int) -> None:
        raise MemoryError(f"kvref: planted refusal of {size} bytes")

    path = f"/dev/shm/vllm_offload_{engine_id}.mmap"

    def check(i: int):
        if creator_fails_late:
            return _refuse_after_joiners(path, n - 1)
        return refuse if fail_first_creator and i == 0 else None

    def build(i: int) -> None:
        try:
            out[i] = SharedOffloadRegion(
                engine_id, num_chunks, ranks[i], kv_bytes_per_chunk, cpu_page_size,
                barrier=_failing_barrier(i) if barrier_fails else meet.wait if meet is not None else None,
                creator_memory_check=check(i),
                populate_shard=(i, n) if populate_shard else None, num_segments=num_segments)
        except BaseException as exc:  # noqa: BLE001 - compared as an outcome
            out[i] = exc

    if populate not in POPULATE_MODES:
        raise InvalidFieldError("populate", populate, f"one of {POPULATE_MODES}")
    with _segment_minimum(min_segment_bytes), _populate_mode(populate), _quiet_region_log(), \
            _join_timeout(join_timeout_s):
        if barrier and not barrier_fails:
            threads = [threading.Thread(target=build, args=(i,)) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
        else:
            built = False
            for i in range(n):
                build(i)
                if after_first is not None and not built and not isinstance(out[i], BaseException):
                    built = True
                    after_first(out[i])
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
    with _quiet_region_log():  # "Keeping ... mapped" is the outcome being checked, not news
        region.cleanup()
    return region.mmap_obj is not None, region.fd is None


def write_base(region: Any, data: bytes) -> None:
    """Write ``data`` over the whole region through this worker's mapping (what a worker's stores
    do, before a later worker maps and pre-faults it)."""
    import torch

    region.base_tensor.copy_(torch.frombuffer(bytearray(data), dtype=torch.int8))
