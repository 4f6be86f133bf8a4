"""vLLM 0.33.0's multi-tier offloading (``vllm/v1/kv_offload/tiering/``), real classes on CPU.

:func:`build_vllm_tiering` goes through vLLM's own front door: an ``OffloadingConfig`` naming
``TieringOffloadingSpec``, whose ``get_manager()`` builds the scheduler-side
``SharedOffloadRegion`` (``/dev/shm``), the ``CPUPrimaryTierOffloadingManager`` and, through
``SecondaryTierFactory``, the secondary tiers with their back-pressure detectors:

* ``fs``: ``FileSystemTierManager`` on a temporary directory, with its real
  ``DualQueueThreadPool`` threads, real file I/O and its ``FsAsyncLookupManager`` thread;
* ``example``: ``ExampleSecondaryTierManager`` (in memory, synchronous).

Nothing is faked. To make runs reproducible the harness decides *when* the threads act:

* **Jobs.** Each fs task is wrapped in a gate (an ``Event`` per job): a pool thread takes the task
  and waits until :meth:`VllmTiering.finish_job` opens the gate, then runs vLLM's task (or raises
  ``OSError``, an I/O error injected by the trace); the harness then waits, bounded by
  :data:`WAIT_S`, until vLLM's pool has put the job on its finished queue. One job at a time, so
  the finished queue's order is the trace's.
* **Lookups.** The lookup worker's queue is swapped for :class:`GatedQueue`: the worker takes a
  batch only when :meth:`VllmTiering.run_lookup_worker` releases one, and the harness waits until
  the worker is back at the queue (its answers posted).
* **I/O errors.** A store job the trace fails runs vLLM's own write path with writes that come up
  short (``os`` of the fs block I/O module, inside :func:`virtual_time`), so vLLM's error handling
  runs and must leave no temporary file; a failed load raises ``OSError`` from the gate.
* **Time.** ``time`` in the manager, metrics, back-pressure and thread-pool modules is a proxy whose
  ``monotonic`` is the trace's :class:`VirtualClock` while a :func:`virtual_time` block is active;
  job submit times (stamped with the real clock by ``TransferJob``'s default) are restamped with
  the virtual clock as the job reaches its tier.

A wait that runs out raises :class:`TierTimeout` naming the job or tier: never a hang.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
import threading
import time as _real_time
from collections import deque
from typing import Any

from kvref.impl.reference.offload.tiering.clock import VirtualClock
from kvref.spec.errors import InvalidFieldError, check_int

#: longest the harness waits for a vLLM thread to reach the point the trace asked for
WAIT_S = 10.0
#: longest a tier's drain loop may keep polling (its jobs have all ended by then unless one never will)
DRAIN_WAIT_S = 2.0
_TIME_MODULES = ("vllm.v1.kv_offload.tiering.manager", "vllm.v1.kv_offload.tiering.metrics",
                 "vllm.v1.kv_offload.tiering.backpressure", "vllm.v1.kv_offload.tiering.fs.thread_pool")
#: modules whose drain loops sleep between polls: the proxy bounds such a loop (it needs optional
#: packages: kvcr, nixl)
_DRAIN_MODULES = ("vllm.v1.kv_offload.tiering.kvcr.manager", "vllm.v1.kv_offload.tiering.obj.manager")
_ENGINES = iter(range(1 << 62))
#: the fs tier's block I/O module: its ``os`` is :class:`_FsIoOs` inside a :func:`virtual_time` block
_FS_IO_MODULE = "vllm.v1.kv_offload.tiering.fs.io"
_SHORT_WRITES = threading.local()  # .on: this pool thread's writes come up short; .hits: how many did
_RENAME_RACES = threading.local()  # .on: another writer publishes first, the rename meets EEXIST; .hits


class TierTimeout(RuntimeError):
    """A vLLM tier thread did not reach the point the trace asked for within :data:`WAIT_S`."""


class _TimeProxy:
    """The ``time`` module with ``monotonic`` read from the active virtual clock (if any)."""

    clock: VirtualClock | None = None
    _streak_start: float | None = None
    _last_sleep = 0.0

    def monotonic(self) -> float:
        return self.clock.monotonic() if self.clock is not None else _real_time.monotonic()

    def sleep(self, seconds: float) -> None:
        """A drain loop's pause (``drain_jobs`` polls and sleeps until its jobs end): real, but a
        run of pauses longer than :data:`DRAIN_WAIT_S` raises :class:`TierTimeout` instead of spinning
        forever on a job that will never end (a fault the trace planted, say)."""
        now = _real_time.monotonic()
        if self._streak_start is None or now - self._last_sleep > 0.5:
            self._streak_start = now
        self._last_sleep = now
        if now - self._streak_start > DRAIN_WAIT_S:
            self._streak_start = None
            raise TierTimeout(f"a tier's drain loop still had jobs after {DRAIN_WAIT_S}s")
        _real_time.sleep(seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(_real_time, name)


class _FsIoOs:
    """The ``os`` module as vLLM's fs block I/O sees it: a pool thread running a store job the
    trace failed writes half of each block (a full disk's short write), so vLLM's own
    ``_store_block`` meets the error, removes its temporary file and raises."""

    def write(self, fd: int, data) -> int:
        if getattr(_SHORT_WRITES, "on", False):
            _SHORT_WRITES.hits += 1
            view = memoryview(data).cast("B")
            return os.write(fd, view[:len(view) // 2])
        return os.write(fd, data)

    def replace(self, src, dst) -> None:
        """A store job the trace races: another writer (same content-hashed name, so the same
        bytes) publishes the block after ``_store_block``'s "exists?" check, and the rename fails
        with ``EEXIST`` as on shared filesystems that do not replace (vLLM must count the block
        stored and remove its temporary file)."""
        if getattr(_RENAME_RACES, "on", False):
            _RENAME_RACES.hits += 1
            with open(src, "rb") as mine, open(dst, "wb") as other:
                other.write(mine.read())
            raise FileExistsError(errno.EEXIST, "kvref: another writer published the block", dst)
        os.replace(src, dst)

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)


_PROXY = _TimeProxy()
_FS_IO_OS = _FsIoOs()
_PROXY_LOCK = threading.Lock()


@contextlib.contextmanager
def virtual_time(clock: VirtualClock):
    """Make the tiering modules read ``clock``; restores the real ``time`` afterwards."""
    import importlib

    import logging

    mods = [importlib.import_module(m) for m in _TIME_MODULES]
    for name in _DRAIN_MODULES:
        try:
            mods.append(importlib.import_module(name))
        except ImportError:  # kvcr or nixl absent: that tier cannot be built either
            pass
    quiet = [logging.getLogger("vllm.v1.kv_offload.tiering.fs.thread_pool"),  # injected I/O errors are expected
             logging.getLogger("vllm.v1.kv_offload.tiering.factory"),  # so is kvref's out-of-tree tier
             logging.getLogger("vllm.v1.kv_offload.tiering.obj.manager"),  # and failed object transfers
             logging.getLogger("vllm.v1.kv_offload.tiering.manager"),  # and a tier's failed shutdown
             logging.getLogger("vllm.v1.kv_offload.tiering.spec"),  # and one in a refused config's clean-up
             logging.getLogger("vllm.distributed.nixl_utils")]  # NIXL is absent: kvref's agent stands in
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.CRITICAL)
    fs_io = importlib.import_module(_FS_IO_MODULE)
    with _PROXY_LOCK:
        saved = [m.time for m in mods]
        for m in mods:
            m.time = _PROXY
        _PROXY.clock = clock
        saved_os, fs_io.os = fs_io.os, _FS_IO_OS
    try:
        yield
    finally:
        with _PROXY_LOCK:
            _PROXY.clock = None
            for m, t in zip(mods, saved):
                m.time = t
            fs_io.os = saved_os
        for log, level in zip(quiet, levels):
            log.setLevel(level)


class GatedQueue:
    """Stands in for the lookup worker's input queue: ``get`` returns a batch only once released."""

    def __init__(self) -> None:
        self._items: deque = deque()
        self._released = 0
        self._taken = 0
        self.entered = 0  # calls of get() so far; the worker is idle again when entered == taken + 1
        self._cv = threading.Condition()

    def put(self, item) -> None:
        with self._cv:
            self._items.append(item)
            self._cv.notify_all()

    def get(self):
        with self._cv:
            self.entered += 1
            self._cv.notify_all()
            self._cv.wait_for(lambda: self._items and self._released > self._taken)
            self._taken += 1
            return self._items.popleft()

    def pending(self) -> int:
        with self._cv:
            return len(self._items)

    def release_one(self, what: str) -> None:
        with self._cv:
            self._released += 1
            self._cv.notify_all()
            if not self._cv.wait_for(lambda: self.entered == self._taken + 1 and self._taken == self._released,
                                     timeout=WAIT_S):
                raise TierTimeout(f"{what}: the lookup worker did not finish its batch within {WAIT_S}s")

    def release_all(self) -> None:
        with self._cv:
            self._released = 1 << 60
            self._cv.notify_all()


def _install_lookup_gate(tier) -> GatedQueue:
    lm = tier._lookup_manager
    gate = GatedQueue()
    old = lm._lookup_queue
    lm._lookup_queue = gate
    old.put([])  # the worker is blocked on the old queue: one empty batch moves it onto the gate
    with gate._cv:
        if not gate._cv.wait_for(lambda: gate.entered == 1, timeout=WAIT_S):
            raise TierTimeout(f"tier {tier.tier_type}: the lookup worker did not move to the gated queue")
    return gate


class _JobGates:
    """One gate per fs job: the pool thread running the job's task waits on it."""

    def __init__(self, tier) -> None:
        self.tier = tier
        self.pool = tier._pool
        self.gates: dict[int, list] = {}  # job id -> [Event, io_error]
        self.lock = threading.Lock()
        self.short_write_failures = 0  # failed store tasks whose error vLLM's own write path raised
        self.short_write_jobs = 0  # store tasks that wrote short and still returned (none, in vLLM 0.33.0)
        self.rename_races = 0  # blocks whose rename met EEXIST after another writer published them
        for name in ("enqueue_store", "enqueue_load"):
            setattr(self.pool, name, self._wrap(getattr(self.pool, name), name == "enqueue_store"))

    def _wrap(self, enqueue, store: bool):
        def gated_enqueue(job_id, n_tasks, tasks):
            gate = [threading.Event(), False, threading.Event(), False]  # go, io error, taken, rename race
            with self.lock:
                self.gates[job_id] = gate

            def gated(task):
                def run():
                    gate[2].set()  # a pool thread took the task (its transfer clock started)
                    gate[0].wait()
                    if gate[1] and store:  # vLLM's own write path fails (a short write)
                        _SHORT_WRITES.on, _SHORT_WRITES.hits = True, 0
                        try:
                            out = task()
                        except OSError:
                            self.short_write_failures += _SHORT_WRITES.hits > 0
                            raise
                        finally:
                            _SHORT_WRITES.on = False
                        if not _SHORT_WRITES.hits:  # nothing to write (the file was there): fail anyway
                            raise OSError(f"kvref: I/O error injected into job {job_id}")
                        self.short_write_jobs += 1  # vLLM's write path returned normally after a short write
                        return out
                    if gate[1]:
                        raise OSError(f"kvref: I/O error injected into job {job_id}")
                    if gate[3] and store:
                        _RENAME_RACES.on, _RENAME_RACES.hits = True, 0
                        try:
                            return task()
                        finally:
                            _RENAME_RACES.on = False
                            with self.lock:
                                self.rename_races += _RENAME_RACES.hits
                    return task()
                return run

            out = enqueue(job_id, n_tasks, [gated(t) for t in tasks])
            if not gate[2].wait(WAIT_S):
                raise TierTimeout(f"tier {self.tier.tier_type}: no pool thread took job {job_id} within {WAIT_S}s")
            return out
        return gated_enqueue

    def in_flight(self) -> list[int]:
        with self.lock:
            return sorted(j for j, g in self.gates.items() if not g[0].is_set())

    def finish(self, job_id: int, io_error: bool, rename_race: bool = False) -> None:
        with self.lock:
            gate = self.gates.get(job_id)
        if gate is None or gate[0].is_set():
            raise InvalidFieldError("job_id", job_id, f"a job in flight on tier {self.tier.tier_type} "
                                                      f"({self.in_flight()})")
        if rename_race and io_error:
            raise InvalidFieldError("rename_race", rename_race, "False when io_error is set")
        gate[1], gate[3] = io_error, rename_race
        gate[0].set()
        cond = self.pool._condition
        with cond:
            ok = cond.wait_for(lambda: any(f[0] == job_id for f in self.pool._finished_q), timeout=WAIT_S)
        if not ok:
            raise TierTimeout(f"tier {self.tier.tier_type}: job {job_id} did not finish within {WAIT_S}s")

    def release_all(self) -> None:
        for job_id in self.in_flight():
            self.finish(job_id, io_error=True)


def _restamp(tier, clock: VirtualClock) -> None:
    """Jobs carry the virtual submit time (vLLM stamps ``TransferJob`` with the real clock)."""
    for name in ("submit_store", "submit_load"):
        real = getattr(tier, name)

        def submit(job, _real=real):
            job.submit_time = clock.monotonic()
            return _real(job)
        setattr(tier, name, submit)


class VllmTiering:
    """vLLM's ``TieringOffloadingManager`` as :func:`build_vllm_tiering` made it, plus the harness."""

    def __init__(self, spec, manager, clock: VirtualClock, root: str) -> None:
        self.spec, self.manager, self.clock, self.root = spec, manager, clock, root
        #: the KVCR progress threads alive before this world was built (build_vllm_tiering sets it)
        self.progress_before: set[int] = set()
        self.primary = manager.primary_tier
        self.tiers = manager.secondary_tiers
        self.job_gates: dict[int, _JobGates] = {}
        self.lookup_gates: dict[int, GatedQueue] = {}
        for i, tier in enumerate(self.tiers):
            _restamp(tier, clock)
            if tier.tier_type == "fs":
                self.job_gates[i] = _JobGates(tier)
            if tier.tier_type in ("fs", "obj"):
                self.lookup_gates[i] = _install_lookup_gate(tier)
        self.kvcr_gates: dict[int, Any] = {}
        for i, tier in enumerate(self.tiers):
            if tier.tier_type == "kvcr":
                from kvref.impl.vllm.tiering_kvcr import KvcrGate

                self.kvcr_gates[i] = KvcrGate(tier, WAIT_S, TierTimeout)
        if manager._tier_poll_thread is not None:
            self._park_poll_thread()
        self.shutdown_calls: list = []  # what manager.shutdown() reached: tier indexes, then "primary"
        for i, tier in enumerate(self.tiers):
            tier.shutdown = self._recording(tier.shutdown, i)
        self._primary_shutdown = self.primary.shutdown
        self.primary.shutdown = self._recording(self.primary.shutdown, "primary")
        self._flat = self.primary.get_kv_memoryview().cast("B")
        self.row_bytes = self.primary.get_kv_memoryview().strides[0]
        self.ctx: dict[str, Any] = {}

    # -- the harness ------------------------------------------------------------------------

    def _park_poll_thread(self) -> None:
        """vLLM's tier-poll thread started in the constructor and runs a round every
        ``tier_poll_interval_s`` (an hour here). Before the trace starts, wait until it has run a
        round and is waiting for the next: the trace's own :meth:`poll_tiers` rounds are then the
        only ones, and shutdown's stop request ends its wait. The thread reads its stop event
        afresh at every round, so it is swapped for one that says when it is waited on; the old
        one is set to wake a thread already waiting (one more round, on an idle manager)."""
        m = self.manager
        parked = threading.Condition()

        class _StopEvent(threading.Event):
            waiting = False

            def wait(self, timeout=None):
                with parked:
                    self.waiting = True
                    parked.notify_all()
                return super().wait(timeout)

        old, m._tier_poll_stop = m._tier_poll_stop, _StopEvent()
        old.set()
        with parked:
            if not parked.wait_for(lambda: m._tier_poll_stop.waiting, timeout=WAIT_S):
                raise TierTimeout(f"the tier-poll thread did not finish its first round within {WAIT_S}s")

    def _recording(self, shutdown, what):
        def recorded() -> None:
            self.shutdown_calls.append(what)
            return shutdown()
        return recorded

    def kvcr_request_pin(self, tier_idx: int, keys) -> None:
        """A peer reads ``keys`` from tier ``tier_idx``'s engine: kvcr's remote side asks vLLM's
        adapter to pin them (the ``request_pin`` binding kvcr calls on a peer's read; kvcr discards
        and releases a pin result it did not ask for, as it does one whose read has ended)."""
        self.tiers[tier_idx]._framework_pin_adapter.request_pin([bytes(k) for k in keys])

    def poll_tiers(self) -> None:
        """One tier-poll round, as vLLM's thread runs it (under the manager's lock)."""
        with self.manager.lock:
            self.manager.poll_tiers()

    def finish_job(self, tier_idx: int, job_id: int, io_error: bool = False, rename_race: bool = False) -> None:
        """``rename_race``: a store job's blocks are published by another writer before its
        renames, which fail with ``EEXIST`` (:meth:`_FsIoOs.replace`); fs tiers only."""
        tier = self.tiers[tier_idx]
        if tier.tier_type == "obj":
            if rename_race:
                raise InvalidFieldError("rename_race", rename_race, "False on an obj tier (fs tiers only)")
            if job_id not in self.in_flight(tier_idx):
                raise InvalidFieldError("job_id", job_id, f"a transfer in flight on tier #{tier_idx}")
            tier._agent.complete(tier._transfers[job_id].xfer_handle, io_error)
            return
        self.job_gates[tier_idx].finish(job_id, io_error, rename_race)

    def obj_fault(self, tier_idx: int, stage: str) -> None:
        """The next NIXL call of kind ``stage`` that obj tier ``tier_idx`` makes fails
        (:meth:`kvref.impl.vllm.tiering_obj_agent.InMemoryObjAgent.arm`)."""
        tier = self.tiers[tier_idx] if 0 <= tier_idx < len(self.tiers) else None
        if tier is None or tier.tier_type != "obj":
            raise InvalidFieldError("tier_idx", tier_idx, "the index of an obj tier")
        tier._agent.arm(stage)

    def obj_agents(self) -> dict[int, Any]:
        """tier index -> the in-memory NIXL agent of each obj tier (see its ``leaks``)."""
        return {i: t._agent for i, t in enumerate(self.tiers) if t.tier_type == "obj"}

    def _object_name(self, tier_idx: int, key: bytes) -> str:
        return self.tiers[tier_idx]._file_mapper.get_file_name(key)

    def tier_bytes(self, tier_idx: int, key: bytes) -> bytes | None:
        """What tier ``tier_idx`` (fs or obj) holds for ``key``, or None."""
        tier = self.tiers[tier_idx]
        if tier.tier_type == "obj":
            return tier._agent.bucket.get(self._object_name(tier_idx, key))
        path = tier.file_mapper.get_file_name(key)
        if not os.path.exists(path):
            return None
        with open(path, "rb") as f:
            return f.read()

    def run_lookup_worker(self, tier_idx: int) -> bool:
        gate = self.lookup_gates[tier_idx]
        if not gate.pending():
            return False
        gate.release_one(f"tier #{tier_idx}")
        return True

    def lose_file(self, tier_idx: int, key: bytes) -> bool:
        if self.tiers[tier_idx].tier_type == "obj":
            return self.tiers[tier_idx]._agent.bucket.pop(self._object_name(tier_idx, key), None) is not None
        path = self.tiers[tier_idx].file_mapper.get_file_name(key)
        if os.path.exists(path):
            os.remove(path)
            return True
        return False

    def truncate_file(self, tier_idx: int, key: bytes, size: int) -> bool:
        if self.tiers[tier_idx].tier_type != "fs":
            return False  # an object is replaced whole
        path = self.tiers[tier_idx].file_mapper.get_file_name(key)
        if not os.path.exists(path) or not 0 <= size < self.row_bytes:
            return False
        os.truncate(path, min(size, os.path.getsize(path)))  # cut only: truncate() would extend a short file
        return True

    def temp_files(self) -> list[str]:
        """Temporary files an fs tier left behind (a failed store must remove its own)."""
        return sorted(os.path.join(d, f) for d, _, files in os.walk(self.root) for f in files if f.endswith(".tmp"))

    def write_chunk(self, chunk_id: int, payload: bytes) -> None:
        """What a GPU->CPU store writes into primary slot ``chunk_id``."""
        self._flat[chunk_id * self.row_bytes:(chunk_id + 1) * self.row_bytes] = payload

    def primary_bytes(self) -> bytes:
        return self._flat.tobytes()

    def shutdown(self) -> bool:
        """``manager.shutdown()``; True when a tier's shutdown failed as a trace asked
        (:class:`~kvref.impl.vllm.tiering_tiers.TierShutdownError`): vLLM then keeps the primary
        tier, which the harness releases itself (``shutdown_calls`` says what vLLM reached)."""
        from kvref.impl.vllm.tiering_tiers import TierShutdownError

        for gates in self.job_gates.values():
            gates.release_all()
        for gate in self.lookup_gates.values():
            gate.release_all()
        failed = False
        try:
            self._flat.release()
            try:
                self.manager.shutdown()
            except TierShutdownError:
                failed = True
                self._primary_shutdown()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
            # a KVCR loop vLLM's shutdown did not close (a tier's failed shutdown, a planted fault)
            from kvref.impl.vllm.tiering_kvcr import close_orphaned_kvcr_progress

            if self.kvcr_gates:  # the heap scan only where a KVCR tier was built
                close_orphaned_kvcr_progress(self.progress_before)
        return failed

    # -- observables ------------------------------------------------------------------------

    def req_context(self, req_id: str):
        from vllm.v1.kv_offload.base import ReqContext

        if req_id not in self.ctx:
            self.ctx[req_id] = ReqContext(req_id=req_id)
        return self.ctx[req_id]

    def set_load_tier_filter(self, req_id: str, matchers, everything: bool) -> None:
        """The request's ``load_tier_filter`` (what its ``kv_load_tiers`` asked for): ``matchers``
        are (medium, locality) names or None, as the reference's ``TierFilter`` holds them;
        ``everything``: vLLM's ``TierFilter.ALL``."""
        from vllm.v1.kv_offload.base import Locality, Medium, TierFilter, TierMatcher

        flt = TierFilter.ALL if everything else TierFilter(matchers=tuple(
            TierMatcher(medium=Medium[m] if m else None, locality=Locality[lc] if lc else None) for m, lc in matchers))
        self.req_context(req_id).load_tier_filter = flt

    def chunk_state(self) -> dict[bytes, tuple[int, int]]:
        pol = self.primary._policy
        items = pol.chunks.items() if hasattr(pol, "chunks") else list(pol.t1.items()) + list(pol.t2.items())
        return {bytes(k): (c.chunk_id, c.ref_cnt) for k, c in items}

    def jobs(self) -> dict[int, tuple]:
        return {j: (m.tier_idx, m.transfer_job.is_promotion, tuple(bytes(k) for k in m.transfer_job.keys),
                    tuple(int(c) for c in m.transfer_job.chunk_ids), m.transfer_job.req_context.req_id)
                for j, m in self.manager._jobs.items()}

    def pending_loads(self) -> dict[int, dict[str, tuple]]:
        return {t: {r: (tuple(e.keys), tuple(int(c) for c in e.chunk_ids)) for r, e in by.items()}
                for t, by in self.manager._pending_load_submissions.items()}

    def req_state(self) -> dict[str, tuple]:
        return {r: (s.pending_primary_stores, s.is_finished, s.request_level_tiers,
                    tuple(bytes(k) for k in s.pending_cascade_keys)) for r, s in self.manager._req_state.items()}

    def stored_keys(self, tier_idx: int, universe) -> set[bytes]:
        tier = self.tiers[tier_idx]
        if tier.tier_type in ("fs", "obj"):
            return {k for k in universe if self.tier_bytes(tier_idx, k) is not None}
        if tier.tier_type == "kvcr":
            return {k for k, (state, _) in self.kvcr_gates[tier_idx].residency().items() if state == "ready"}
        return {bytes(k) for k in tier.chunks}  # the example tier and kvref's RequestLevelTier

    def lookup_state(self, tier_idx: int) -> dict:
        lm = self.tiers[tier_idx]._lookup_manager
        return {bytes(k): (s.phase.name.lower(), s.result, tuple(sorted(s.request_ids)))
                for k, s in lm._lookup_state.items()}

    def in_flight(self, tier_idx: int) -> list[int]:
        tier = self.tiers[tier_idx]
        if tier.tier_type == "obj":
            busy = set(tier._agent.in_flight())
            return sorted(j for j, e in tier._transfers.items() if e.xfer_handle in busy)
        gates = self.job_gates.get(tier_idx)
        return gates.in_flight() if gates is not None else []

    def detector_snapshot(self, tier_idx: int) -> tuple | None:
        d = self.tiers[tier_idx].bp_detector
        if d is None:
            return None
        p = d.policy
        return (d._ema, d._under_pressure, d._completions, d._healthy_streak, d._pressure_cleared_at,
                d._cooldown_count, d._consecutive_failures, d._failure_tripped, d._last_update,
                p._stores_dropped, p._blocks_dropped, getattr(p, "_drop_accumulator", 0.0))

    def take_events(self) -> list[tuple]:
        return [(tuple(bytes(k) for k in e.keys), e.medium.name, e.removed) for e in self.manager.take_events()]

    def metric_definitions(self) -> dict[str, str]:
        """What vLLM declares to Prometheus for this configuration: metric name -> "counter",
        "gauge" or "histogram" (``TieringOffloadingSpec.build_metric_definitions``)."""
        from vllm.v1.kv_offload.base import OffloadingGaugeMetadata, OffloadingHistogramMetadata

        defs = type(self.spec).build_metric_definitions(self.spec.extra_config)
        return {n: "histogram" if isinstance(d, OffloadingHistogramMetadata) else
                "gauge" if isinstance(d, OffloadingGaugeMetadata) else "counter" for n, d in defs.items()}

    def config_info(self) -> tuple[tuple[str, ...], list[dict]]:
        """(the info label names vLLM declares, the label mappings the manager reports)."""
        keys = type(self.spec).config_info_keys(self.spec.extra_config)
        return tuple(keys), [dict(m) for m in self.manager.config_info()]

    def take_stats(self, prefix: tuple[str, ...] = ("vllm:kv_offload_tiering_", "vllm:kvcr_")) -> dict[str, float]:
        """``get_stats().reduce()`` cut to the tiering and KVCR metrics (the primary tier's own are
        conform-offload's); KVCR's duration histograms by count only (their sums are wall-clock)."""
        stats = self.manager.get_stats()
        if stats is None:
            return {}
        return {k: v for k, v in stats.reduce().items()
                if k.startswith(prefix) and not (k.startswith("vllm:kvcr_duration") and k.endswith("_sum"))}


def build_vllm_tiering(num_chunks: int, tiers: list[dict], clock: VirtualClock, cache_policy: str = "lru",
                       enable_events: bool = True, self_describing_events: bool | None = None,
                       extra: dict | None = None, data_parallel_rank_local: int | None = None) -> VllmTiering:
    """vLLM's tiering manager for ``tiers`` (dicts: ``type`` "fs" or "example", optional
    ``backpressure`` as vLLM's tier config takes it); fs tiers get their own temporary directory.
    ``self_describing_events``: the spec's ``self_describing_kv_events`` (default: on when a
    KVCR tier is configured, which needs it for its local DRAM inventory). ``extra``: more of the
    spec's extra config (top-level ``backpressure``, ``store_threshold``, ...), set last.
    ``data_parallel_rank_local``: the parallel config's (a KVCR tier binds the control port at it)."""
    check_int("data_parallel_rank_local", data_parallel_rank_local, minimum=0, allow_none=True)
    if extra is not None and not isinstance(extra, dict):
        raise InvalidFieldError("extra", extra, "None or a dict of the spec's extra config")
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None  # tmpfs: files cost no disk I/O
    root = tempfile.mkdtemp(prefix="kvref-tiering-", dir=shm)
    tier_cfgs = []
    for i, t in enumerate(tiers):
        cfg = dict(t)
        if cfg.get("type") == "obj":
            cfg.setdefault("store_config", {"bucket": "kvref", "endpoint_override": "in-memory"})
            cfg.setdefault("prefix", f"tier{i}")
            cfg.setdefault("io_threads", 1)
            cfg.setdefault("enable_kv_events", enable_events)
        if cfg.get("type") == "fs":
            cfg.setdefault("root_dir", os.path.join(root, f"tier{i}"))
            cfg.setdefault("n_read_threads", 24)
            cfg.setdefault("n_write_threads", 24)
            cfg.setdefault("enable_kv_events", enable_events)
        tier_cfgs.append(cfg)
    ocfg = OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layer",), 0),), worker_kv_bytes_per_block=64,
        enable_kv_cache_events=enable_events,
        extra_config={"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": num_chunks * 4096,
                      "eviction_policy": cache_policy, "secondary_tiers": tier_cfgs,
                      # KVCR's local-DRAM inventory events name their tier (kvcr refuses otherwise)
                      "self_describing_kv_events": (any(t.get("type") == "kvcr" for t in tiers)
                                                    if self_describing_events is None else self_describing_events),
                      # a tier-poll thread (for tiers that opt in) that waits an hour between rounds:
                      # the trace runs the rounds (VllmTiering.poll_tiers)
                      "tier_poll_interval_s": 3600.0, **(extra or {})},
        engine_id=f"kvref-tiering-{os.getpid()}-{next(_ENGINES)}",
        model=OffloadingModelConfig(name="kvref", dtype="float16", max_model_len=4096),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=data_parallel_rank_local,
                                          is_parallelism_agnostic=False),
        replicated_layout=False)
    bucket: dict[str, bytes] = {}
    from kvref.impl.vllm.tiering_kvcr import close_orphaned_kvcr_progress, kvcr_progress_threads, note_kvcr_start

    progress_before = kvcr_progress_threads()
    if any(t.get("type") == "kvcr" for t in tiers):
        note_kvcr_start()
    try:
        spec = TieringOffloadingSpec(ocfg)
        with _in_memory_nixl(bucket, any(t.get("type") == "obj" for t in tiers)):
            manager = spec.get_manager()
    except Exception:
        shutil.rmtree(root, ignore_errors=True)
        if any(t.get("type") == "kvcr" for t in tiers):  # a KVCR startup failure leaves its loop running
            close_orphaned_kvcr_progress(progress_before)
        raise
    if manager.primary_tier._num_chunks != num_chunks:
        raise InvalidFieldError("num_chunks", num_chunks, f"the {manager.primary_tier._num_chunks} chunks "
                                                          "vLLM's spec made of cpu_bytes_to_use")
    world = VllmTiering(spec, manager, clock, root)
    world.progress_before = progress_before
    return world


@contextlib.contextmanager
def _in_memory_nixl(bucket: dict, needed: bool):
    """While the obj tiers are built, ``nixl_agent`` is kvref's in-memory object store agent
    (:mod:`kvref.impl.vllm.tiering_obj_agent`: NIXL is not installed)."""
    if not needed:
        yield
        return
    import vllm.v1.kv_offload.tiering.obj.manager as obj

    from kvref.impl.vllm.tiering_obj_agent import InMemoryObjAgent

    saved = obj.nixl_agent, obj.nixl_agent_config
    obj.nixl_agent = lambda name, config: InMemoryObjAgent(name, config, bucket)
    obj.nixl_agent_config = lambda **kw: kw
    try:
        yield
    finally:
        obj.nixl_agent, obj.nixl_agent_config = saved


def schedule_end_context(new_req_ids=()) -> Any:
    from vllm.v1.kv_offload.base import ScheduleEndContext

    return ScheduleEndContext(new_req_ids=tuple(new_req_ids), preempted_req_ids=())


__all__ = ["GatedQueue", "TierTimeout", "VllmTiering", "build_vllm_tiering", "schedule_end_context",
           "virtual_time"]
