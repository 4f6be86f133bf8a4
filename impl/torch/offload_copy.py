"""Offload data path: copy KV blocks between device memory and host buffers.

An offload *job* is a list of ``(gpu_block, cpu_block)`` pairs, as the offload schedulers emit
them (vLLM's ``SimpleCPUOffloadScheduler`` ``TransferMeta(gpu_ids, cpu_ids)``; the
OffloadingConnector's store/load specs). ``store`` copies device → host, ``load`` host → device,
for every layer's backing tensor (whole pages, all groups: groups alias the same backing).

On CUDA the host buffers are pinned and the copies run on a side stream ordered after the
current stream's work; each job returns a :class:`CopyHandle` with a completion event (vLLM's
workers report finished store/load events the same way). Consumers call ``handle.wait()``
(host side) or ``handle.wait_stream()`` (make the compute stream wait) before using the data.
On CPU the copies are plain synchronous ``copy_`` calls and handles are complete at once.

Runs of consecutive ``(gpu, cpu)`` pairs are merged into one copy, so a contiguous job costs one
``memcpy`` per layer. Round trips are bit-exact: pages are copied as raw elements, never cast.

``backend="triton"`` moves the pages with the block-copy kernel instead
(:mod:`.triton_kernels.block_copy`: ONE launch for the whole job, every page of every layer in
parallel, the kernel reading/writing the pinned host buffer directly) — the back-end for
scattered jobs: the torch path's merged runs degenerate to one ``copy_`` per block and layer
there (9-14 % of a pinned-host copy on an H200, issue #24); default ``"torch"``. Runs of at
least :attr:`OffloadCopier.COPY_ENGINE_MIN_BYTES` per layer still go to the copy engine
(``copy_``), which moves long contiguous runs faster than the kernel does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvref.spec.errors import InvalidFieldError, check_int

from .kv_cache_tensors import KVCacheTensors

Job = list[tuple[int, int]]


@dataclass
class CopyHandle:
    """Completion of one job (``event`` is None on CPU: already complete)."""

    kind: str
    num_blocks: int
    event: "torch.cuda.Event | None" = None

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def wait_stream(self, stream=None) -> None:
        """Make ``stream`` (default: the current CUDA stream) wait for this copy."""
        if self.event is not None:
            (stream or torch.cuda.current_stream()).wait_event(self.event)


def merge_runs(pairs: Job) -> list[tuple[int, int, int]]:
    """``(gpu_start, cpu_start, length)`` runs where both ids advance by one."""
    runs: list[tuple[int, int, int]] = []
    for g, c in sorted(pairs):
        if runs and runs[-1][0] + runs[-1][2] == g and runs[-1][1] + runs[-1][2] == c:
            g0, c0, n = runs[-1]
            runs[-1] = (g0, c0, n + 1)
        else:
            runs.append((g, c, 1))
    return runs


def host_buffer(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed host tensor to copy ``device`` blocks to and from: pinned when ``device`` is CUDA
    (asynchronous ``copy_`` needs it, and the Triton copy kernel addresses the host side
    directly, which only page-locked memory allows), pageable on the CPU (pinning needs a CUDA
    allocator). The one place the copier and the benchmarks build their host side (issue #24)."""
    if not isinstance(shape, (tuple, list)) or not 1 <= len(shape) <= 4:
        raise InvalidFieldError("shape", shape, "a tuple of 1 to 4 sizes")
    for n in shape:
        check_int("shape", n, minimum=0)
        if n > 2**62:  # torch takes int64 sizes: a larger one is a TypeError inside torch.zeros
            raise InvalidFieldError("shape", tuple(shape), "sizes of at most 2**62")
    if not isinstance(dtype, torch.dtype):
        raise InvalidFieldError("dtype", dtype, "a torch.dtype")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise InvalidFieldError("device", device, "a torch device: 'cpu' or 'cuda[:index]'") from None
    if dev.type not in ("cpu", "cuda"):
        raise InvalidFieldError("device", device, "'cpu' or 'cuda[:index]'")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidFieldError("device", device, "a CUDA device present on this machine (pinned memory needs one)")
    try:
        return torch.zeros(tuple(shape), dtype=dtype, pin_memory=dev.type == "cuda")
    except (RuntimeError, MemoryError, OverflowError, TypeError) as exc:  # a size no allocator can serve
        raise InvalidFieldError("shape", tuple(shape), f"a host buffer this machine can allocate ({exc})") from None


class OffloadCopier:
    """Host buffers mirroring ``cache``'s backing tensors, ``num_cpu_blocks`` pages per layer.

    ``backend``: ``"torch"`` (``copy_`` per merged run) or ``"triton"`` (the block-copy kernel).
    """

    #: with ``backend="triton"``, a run of consecutive pairs at least this many bytes per layer goes
    #: through the copy engine (one ``copy_`` per layer) instead of the kernel: on an H100 a
    #: contiguous 134 MB job moved at 0.66-0.68 of a pinned ``copy_`` through the kernel and 0.88
    #: as ``copy_`` per run, scattered pages at 0.73-0.76 through the kernel and 0.13-0.15 as
    #: ``copy_`` per block (issue #24, BENCHMARKS.md); 0 sends every run to the copy engine
    COPY_ENGINE_MIN_BYTES = 1 << 20

    def __init__(self, cache: KVCacheTensors, num_cpu_blocks: int, backend: str = "torch",
                 copy_engine_min_bytes: int | None = None) -> None:
        if not isinstance(cache, KVCacheTensors):
            raise InvalidFieldError("cache", cache, "a KVCacheTensors")
        check_int("num_cpu_blocks", num_cpu_blocks, minimum=1)
        from kvref.impl.interface import MAX_NUM_BLOCKS

        if num_cpu_blocks > MAX_NUM_BLOCKS:
            raise InvalidFieldError("num_cpu_blocks", num_cpu_blocks, f"an int in [1, {MAX_NUM_BLOCKS}]")
        from .triton_kernels import check_backend, require_triton

        self.backend = check_backend("backend", backend)
        check_int("copy_engine_min_bytes", copy_engine_min_bytes, minimum=0, allow_none=True)
        self.copy_engine_min_bytes = (self.COPY_ENGINE_MIN_BYTES if copy_engine_min_bytes is None
                                      else copy_engine_min_bytes)
        if backend == "triton":
            require_triton(cache.device)
        self.cache = cache
        self.num_cpu_blocks = num_cpu_blocks
        self.is_cuda = cache.device.type == "cuda"
        self.host = [host_buffer((num_cpu_blocks, cache.block_stride), cache.dtype, cache.device)
                     for _ in cache.backing]
        self.stream = torch.cuda.Stream(device=cache.device) if self.is_cuda else None
        self._plans: dict = {}  # kind -> PageCopyPlan (triton back-end, built on first use)

    def _check(self, job: Job, kind: str) -> Job:
        if not isinstance(job, (list, tuple)):
            raise InvalidFieldError("job", job, "a list of (gpu_block, cpu_block) pairs")
        pairs = self._plain_pairs(job)
        if pairs is None:  # something is off: the per-pair checks below name it
            pairs = self._checked_pairs(job)
        dst = [c for _, c in pairs] if kind == "store" else [g for g, _ in pairs]
        if len(set(dst)) != len(dst):
            raise InvalidFieldError("job", job, f"distinct destination blocks (a {kind} writes each once)")
        return pairs

    def _plain_pairs(self, job: Job) -> "list[tuple[int, int]] | None":
        """The pairs when every one is two plain in-range ints, checked a list at a time (a job of
        512 pairs spent more host time in per-pair checks than the copy kernel leaves idle: issue
        #24); ``None`` otherwise."""
        if not all(type(p) in (tuple, list) and len(p) == 2 for p in job):
            return None
        gs, cs = [p[0] for p in job], [p[1] for p in job]
        if not (all(type(g) is int for g in gs) and all(type(c) is int for c in cs)):
            return None
        if gs and (min(gs) < 0 or max(gs) >= self.cache.num_blocks or min(cs) < 0 or max(cs) >= self.num_cpu_blocks):
            return None
        return list(zip(gs, cs))

    def _checked_pairs(self, job: Job) -> "list[tuple[int, int]]":
        pairs = []
        for p in job:
            if not isinstance(p, (list, tuple)) or len(p) != 2:
                raise InvalidFieldError("job", p, "(gpu_block, cpu_block) pairs")
            g, c = p
            check_int("gpu_block", g, minimum=0)
            check_int("cpu_block", c, minimum=0)
            if g >= self.cache.num_blocks:
                raise InvalidFieldError("gpu_block", g, f"< {self.cache.num_blocks}")
            if c >= self.num_cpu_blocks:
                raise InvalidFieldError("cpu_block", c, f"< {self.num_cpu_blocks}")
            pairs.append((g, c))
        return pairs

    def _copy(self, job: Job, kind: str) -> CopyHandle:
        if isinstance(job, torch.Tensor) or type(job).__module__ == "numpy":
            runs, gpu, cpu = self._plan_table(self._check_table(job, kind))
        else:
            runs, gpu, cpu = self._plan_pairs(self._check(job, kind))
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.cache.device))
            ctx = torch.cuda.stream(self.stream)
        else:
            ctx = _nullcontext()
        with ctx:
            if len(gpu):
                # one launch for every pair the copy engine does not take, every layer (issue #24);
                # the ids were checked above against the same bounds: not again per job
                if kind == "store":
                    self._page_plan("store").launch(gpu, cpu, validate_ids=False)
                else:
                    self._page_plan("load").launch(cpu, gpu, validate_ids=False)
            for dev, host in zip(self.cache.backing, self.host):
                for g, c, n in runs:
                    if kind == "store":
                        host[c:c + n].copy_(dev[g:g + n], non_blocking=self.is_cuda)
                    else:
                        dev[g:g + n].copy_(host[c:c + n], non_blocking=self.is_cuda)
            event = None
            if self.stream is not None:
                event = torch.cuda.Event()
                event.record(self.stream)
        return CopyHandle(kind, len(job), event)

    def _page_plan(self, kind: str):
        """The kernel launch plan of one direction, built on first use and kept: this copier's
        tensors never change, so their checks and layer tables are paid once (issue #24)."""
        plans = self._plans
        if kind not in plans:
            from .triton_kernels.block_copy import PageCopyPlan

            src, dst = (self.cache.backing, self.host) if kind == "store" else (self.host, self.cache.backing)
            plans[kind] = PageCopyPlan(src, dst)
        return plans[kind]

    def _min_engine_run(self) -> int:
        """The fewest consecutive pairs the triton back-end hands to the copy engine."""
        page_bytes = self.cache.block_stride * self.cache.dtype.itemsize
        return max(1, -(-self.copy_engine_min_bytes // page_bytes))

    def _plan_pairs(self, pairs: Job) -> "tuple[list[tuple[int, int, int]], list[int], list[int]]":
        """``(runs for the copy engine, the kernel's gpu ids, its cpu ids)`` of a checked list job."""
        runs = merge_runs(pairs)
        if self.backend != "triton":
            return runs, [], []
        # long runs to the copy engine, the rest (scattered pages, short runs) to ONE launch
        shortest = self._min_engine_run()
        runs = [r for r in runs if r[2] >= shortest]
        if runs:
            taken = {(g + i, c + i) for g, c, n in runs for i in range(n)}
            pairs = [p for p in pairs if p not in taken]
        return runs, [g for g, _ in pairs], [c for _, c in pairs]

    def _check_table(self, job, kind: str) -> torch.Tensor:
        """An id-array job (what vLLM's offload workers hold: ``np.ndarray`` block ids) as an
        ``(n, 2)`` int64 CPU tensor, checked with a few tensor operations instead of a Python pass
        per pair: the host time per job that kept the scattered job under its goal (issue #24)."""
        try:
            ids = torch.as_tensor(job)
        except (TypeError, RuntimeError, ValueError):
            raise InvalidFieldError("job", type(job).__name__, "an (n, 2) integer array of (gpu_block, cpu_block) rows") from None
        if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex() or ids.dim() != 2 \
                or ids.shape[1] != 2:
            raise InvalidFieldError("job", (tuple(ids.shape), str(ids.dtype)),
                                    "an (n, 2) integer array of (gpu_block, cpu_block) rows")
        ids = ids.to("cpu", torch.int64)
        if ids.shape[0]:
            lo, hi = (t.tolist() for t in torch.aminmax(ids, dim=0))
            for field, col, bound in (("gpu_block", 0, self.cache.num_blocks), ("cpu_block", 1, self.num_cpu_blocks)):
                if lo[col] < 0 or hi[col] >= bound:
                    raise InvalidFieldError(field, lo[col] if lo[col] < 0 else hi[col], f"an int in [0, {bound})")
            dst = ids[:, 1 if kind == "store" else 0]
            if torch.unique(dst).numel() != dst.numel():
                seen = set()
                twice = next(d for d in dst.tolist() if d in seen or seen.add(d))
                raise InvalidFieldError("job", twice, f"distinct destination blocks (a {kind} writes each once)")
        return ids

    def _plan_table(self, ids: torch.Tensor) -> "tuple[list[tuple[int, int, int]], torch.Tensor, torch.Tensor]":
        """:meth:`_plan_pairs` for a checked id array, in a few tensor operations (each costs tens
        of microseconds of host time: as few as the plan allows): the same runs (``merge_runs``
        order: sorted by gpu then cpu id) and the same split."""
        n = ids.shape[0]
        if n == 0:
            return [], ids[:, 0], ids[:, 1]
        ordered = ids[(ids[:, 0] * self.num_cpu_blocks + ids[:, 1]).argsort()]
        extends = (ordered.diff(dim=0) == 1).all(1)  # pair i + 1 continues pair i's run
        shortest = self._min_engine_run() if self.backend == "triton" else 1
        if shortest > 1 and not bool(extends.any()):  # scattered: every pair to the kernel
            return [], ids[:, 0], ids[:, 1]
        begins = torch.cat([torch.ones(1, dtype=torch.bool), ~extends])
        starts = begins.nonzero().flatten()
        lengths = torch.diff(starts, append=torch.tensor([n]))
        long = lengths >= shortest
        runs = list(zip(ordered[starts[long], 0].tolist(), ordered[starts[long], 1].tolist(), lengths[long].tolist()))
        rest = ordered[~long[begins.cumsum(0) - 1]]  # each pair's run (repeat_interleave: ms under load)
        return runs, rest[:, 0], rest[:, 1]

    def store(self, job: Job) -> CopyHandle:
        """Device blocks → host blocks. ``job``: a list of ``(gpu_block, cpu_block)`` pairs, or an
        ``(n, 2)`` integer array of them (torch or numpy: checked and split without a Python pass
        per pair, the cheaper form for long jobs)."""
        return self._copy(job, "store")

    def load(self, job: Job) -> CopyHandle:
        """Host blocks → device blocks (the compute stream must ``wait_stream`` before reading)."""
        return self._copy(job, "load")


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
