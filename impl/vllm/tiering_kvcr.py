"""vLLM 0.33.0's KVCR secondary tier (``tiering/kvcr/manager.py``) on CPU, driven reproducibly.

The tier is built by vLLM's own factory from ``{"type": "kvcr", ...}`` (:func:`kvcr_tier_config`):
the real ``kvcr`` 0.1.1 library with its local-DRAM backend (``secondary_g2_slots`` slots of an
anonymous ``mmap``), real NIXL with its UCX backend copying between the primary tier's
``SharedOffloadRegion`` and those slots, and kvcr's progress thread. Nothing is faked; the harness
only decides *when* things happen:

* **Copies.** KVCR hands each local copy (``_LocalCopyOp``) to its progress thread. The progress
  thread's completed queue is swapped for :class:`_NotifyingQueue`, and ``submit`` waits (bounded
  by :data:`~kvref.impl.vllm.tiering.WAIT_S`) until the thread has published that copy: a copy is
  done by the time the manager call that started it returns, and becomes visible to the tier only
  when the tiering manager next polls it (``get_finished_jobs`` -> ``poll_completed``), exactly
  as a fast NIXL transfer is seen on the scheduler thread. :meth:`KvcrGate.fail_next` makes the
  next copy report failure (a NIXL transfer error) instead.
* **Time.** KVCR's operational clock (LRU recency, deadlines) is a counter that advances by one per
  reading, so recency order is the order of events and no deadline (``operation_timeout_ms`` is
  large) expires during a trace.

The control channel binds a free loopback port; no peer is configured, so no remote path runs (a
framework pin needs a second engine asking this one for blocks: out of scope, see
docs/differences.md).
"""

from __future__ import annotations

import itertools
import queue
import threading

from kvref.impl.vllm.loopback_port import free_loopback_port as _free_port
from kvref.spec.errors import InvalidFieldError, check_int

#: longest a KVCR operation may stay open (ms); the counter clock never gets there
_TIMEOUT_MS = 10 ** 9
#: KVCR tiers asked for (:func:`note_kvcr_start`) since :func:`release_kvcr_agents` last looked
_STARTS = [0]


def kvcr_tier_config(slots: int, policy: str = "lru", telemetry: bool = True) -> dict:
    """vLLM's tier config for a KVCR tier with ``slots`` local-DRAM slots (one chunk each)."""
    check_int("slots", slots, minimum=1)
    if policy not in ("lru", "fifo"):
        raise InvalidFieldError("policy", policy, "'lru' or 'fifo' (the policies that need no G3 tier)")
    return {"type": "kvcr", "router_capabilities": ["router_hint"], "control_host": "127.0.0.1",
            "control_ports": [_free_port()], "control_advertise_host": "127.0.0.1",
            "secondary_g2_slots": slots, "policy": policy, "enable_telemetry": bool(telemetry),
            "operation_timeout_ms": _TIMEOUT_MS, "abandon_timeout_ms": 2 * _TIMEOUT_MS}


class _NotifyingQueue:
    """The progress thread's completed queue (``put``/``get_nowait``), counting what it published."""

    def __init__(self, copy_type: type) -> None:
        self._items: list = []
        self._copy_type = copy_type
        self.copies = 0
        self.cv = threading.Condition()

    def put(self, item) -> None:
        with self.cv:
            self._items.append(item)
            self.copies += isinstance(item, self._copy_type)
            self.cv.notify_all()

    def get_nowait(self):
        with self.cv:
            if not self._items:
                raise queue.Empty
            return self._items.pop(0)


class KvcrGate:
    """Installed on one KVCR tier: copies finish before the call that started them returns."""

    def __init__(self, tier, wait_s: float, timeout_error: type[Exception] = TimeoutError) -> None:
        """``timeout_error``: raised (naming the copy) when the progress thread misses ``wait_s``."""
        from kvcr.local_dram import _LocalCopyOp

        self.tier = tier
        core = tier._kvcr._core
        self.core = core
        ticks = itertools.count(1)
        core._clock = lambda: float(next(ticks))
        progress = core._progress
        done = _NotifyingQueue(_LocalCopyOp)
        progress._completed = done
        self.done = done
        self.submitted = 0
        self._fail_next = 0
        real_submit = progress.submit

        def submit(item) -> None:
            if not isinstance(item, _LocalCopyOp):
                real_submit(item)
                return
            self.submitted += 1
            want = self.submitted
            real_submit(item)
            with done.cv:
                if not done.cv.wait_for(lambda: done.copies >= want, timeout=wait_s):
                    raise timeout_error(f"tier {tier.tier_type}: KVCR's progress thread did not finish copy "
                                      f"{item.op_id} within {wait_s}s")
            if self._fail_next:
                self._fail_next -= 1
                item.success = False  # the NIXL transfer reported an error
        progress.submit = submit

    def fail_next(self) -> None:
        """One more of the next copies this tier starts fails (its NIXL transfer ends in error)."""
        self._fail_next += 1

    # -- observables ------------------------------------------------------------------------

    def residency(self) -> dict[bytes, tuple[str, int]]:
        """key -> (state "filling"/"ready"/"discarding", claims) of every local-DRAM block."""
        out = {}
        for key, rec in self.core._block_record_map.items():
            res = rec.local_dram
            if res is not None:
                out[bytes(key)] = (res.state.name.lower(), res.claim_count)
        return out

    def slot_bytes(self, key: bytes) -> bytes | None:
        """What the local-DRAM slot of ``key`` holds (None when it holds no READY copy)."""
        rec = self.core._block_record_map.get(key)
        res = rec.local_dram if rec is not None else None
        if res is None or res.state.name != "READY":
            return None
        dram = self.core._local_dram
        label, slot = res.slots[0]
        base, length, size = dram._pools[label.partition(":")[0]]
        import ctypes

        return ctypes.string_at(base + slot * size, size)


def kvcr_built(tier) -> dict:
    """What vLLM's KVCR tier handed kvcr when it started it: the control port it binds, its local
    DRAM bytes (None: none), whether a G3 tier runs, the policy class and whether an inventory sink
    is installed (compared with the reference's ``kvcr_built_tier``)."""
    core = tier._kvcr._core
    mapping = tier._local_dram_mmap
    return {"control_port": core.framework_control._bind_port,
            "local_dram_bytes": None if mapping is None else len(mapping), "g3": core._g3 is not None,
            "policy": type(core._policy._policy).__name__, "inventory": core._inventory_sink_callback is not None}


def retained_native_buffers() -> int:
    """How many buffers vLLM's KVCR tier keeps mapped for the life of the process (after startup
    failures that could not stop native work)."""
    from vllm.v1.kv_offload.tiering.kvcr import manager

    return len(manager._RETAINED_NATIVE_BUFFERS)


def kvcr_progress_threads() -> set[int]:
    """Idents of the live ``kvcr-progress`` threads (one per KVCR instance kvcr started)."""
    return {t.ident for t in threading.enumerate() if t.name == "kvcr-progress" and t.is_alive() and t.ident}


def close_orphaned_kvcr_progress(before: set[int]) -> int:
    """Close the KVCR progress loops that nothing will close: those started since ``before``
    (:func:`kvcr_progress_threads`) still running, and any whose thread ended with its NIXL agent
    still held. kvcr's startup failures (a G3 backend that does not exist ends the loop's thread
    during start-up) and a trace a planted fault ended leave them behind. Each NIXL agent's UCX
    threads poll with a zero timeout, about 0.15 of a core each, for the life of the process: an
    accumulated handful made every later test of a one-process suite crawl (CI ran past 5,400 s,
    stop 33). A loop that refuses to close (a fault left a transfer active) has its agent dropped.

    A loop whose thread ended with a failure keeps it (``_failure``, raised again by every later
    call), and kvcr keeps the core of a failed start-up for the life of the process
    (``kvcr.api._NONQUIESCENT_STARTUP_RESOURCES``): the failure's traceback holds the frames of
    the loop's start-up, whose locals hold its NIXL agent even after the loop let go of it. Those
    tracebacks are dropped (the failure keeps its type and message), so the agent and its threads
    go. Returns how many loops were closed, dropped or freed of a traceback."""
    import gc

    try:
        from kvcr.progress import _KVCRProgress
    except ImportError:  # kvcr is not installed: no KVCR tier was built
        return 0
    new = kvcr_progress_threads() - before
    # by the real type: isinstance asks an object's __class__, which lazy proxies on the heap answer
    # by importing (openai's module client imports half its package) and torch's old aliases by warning
    loops = [obj for obj in gc.get_objects() if issubclass(type(obj), _KVCRProgress)]
    from kvref.impl.vllm.native_agents import drop_tracebacks

    found = 0
    for obj in loops:
        thread = getattr(obj, "_thread", None)
        running = thread is not None and thread.is_alive()
        if running and thread.ident in new:
            found += 1
            try:
                obj.close()
            except Exception:  # noqa: BLE001 - a loop that cannot close: its agent is dropped below
                pass
            running = thread.is_alive()
        if not running and getattr(obj, "_nixl_agent", None) is not None:
            found += 1
            try:
                obj._close_nixl()
            except Exception:  # noqa: BLE001 - active transfers or registrations: drop the agent anyway
                pass
            obj._nixl_agent = None
        failure = getattr(obj, "_failure", None)
        if not running and failure is not None and failure.__traceback__ is not None:
            found += 1
            drop_tracebacks(failure)
    if found:
        gc.collect()
    return found


def note_kvcr_start() -> None:
    """A KVCR tier is about to be built (:func:`~kvref.impl.vllm.tiering.build_vllm_tiering`):
    the next :func:`release_kvcr_agents` looks for what it left."""
    _STARTS[0] += 1


def release_kvcr_agents() -> int:
    """Close every KVCR progress loop still running and free the agents of ended ones
    (:func:`close_orphaned_kvcr_progress` sparing none), if a KVCR tier was asked for since the
    last call (otherwise no heap scan: nothing to find). For the end of a check or a test module,
    when no tiering world is in use any more. Returns how many loops were closed or freed."""
    if not _STARTS[0]:
        return 0
    _STARTS[0] = 0
    return close_orphaned_kvcr_progress(set())


__all__ = ["KvcrGate", "close_orphaned_kvcr_progress", "kvcr_built", "kvcr_progress_threads", "kvcr_tier_config",
           "note_kvcr_start", "release_kvcr_agents", "retained_native_buffers"]
