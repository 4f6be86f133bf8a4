"""vLLM 0.33.0's tier-poll thread (``TieringOffloadingManager._tier_poll_loop``), one pass at a time.

:func:`drive_poll_loop` takes a :class:`~kvref.impl.vllm.tiering.VllmTiering` whose manager runs a
tier-poll thread (a tier with ``tolerates_off_thread_polling``: kvref's ``PolledTier``) and makes
each pass of vLLM's real loop happen when the trace says:

* the manager's lock is a :class:`GatedLock`: a plain lock for every other thread, while the poll
  thread's ``acquire`` either goes through or, while the trace says another thread holds the lock
  (:attr:`PollGate.contended`), times out at once (vLLM waits ``_TIER_POLL_LOCK_TIMEOUT_S`` for
  that answer); after a pass that timed out, the thread's next ``acquire`` waits for the trace's
  next pass;
* the thread's stop event is a :class:`GateEvent` whose ``wait`` (the pause between rounds) lasts
  until the trace's next pass or the stop request.

:meth:`PollGate.step` lets one pass run and waits, bounded by ``WAIT_S``, until the thread waits
again or has returned. vLLM's ``_TIER_POLL_JOIN_TIMEOUT_S`` (5 s) stays as it is, except for a
shutdown with the thread stuck in a round (:func:`stuck_join_timeout`), where it is
:data:`STUCK_JOIN_TIMEOUT_S` instead (both waits then time out whatever their length). The
manager's log is captured (:class:`LogCapture`).
"""

from __future__ import annotations

import contextlib
import logging
import threading

from kvref.spec.errors import InvalidFieldError

#: vLLM's join/lock timeout in ``shutdown`` when the program has made the thread stuck (seconds, real):
#: the join and the lock both time out for certain then, so a short wait decides the same
STUCK_JOIN_TIMEOUT_S = 0.02
MANAGER_MODULE = "vllm.v1.kv_offload.tiering.manager"
#: the messages of the manager's log that belong to the tier-poll thread, by the name the reference uses
LOG_EVENTS = (("KV offload tier-poll thread has not acquired the manager lock", "stalled"),
              ("KV offload tier-poll round failed", "round_failed"),
              ("KV offload tier-poll thread stopping after", "gave_up"),
              ("KV offload tier-poll thread did not exit within", "join_timeout"))


class PollGate:
    """When the tier-poll thread may take its next pass, and where it waits meanwhile."""

    def __init__(self, wait_s: float, timeout_error: type[Exception]) -> None:
        self.cv = threading.Condition()
        self.granted = 0
        self.taken = 0
        self.parked_at: str | None = None  # "wait", "acquire", None (running) or "exited"
        self.contended = False
        self.slow = False  # a thread waiting after a round does not see the stop request (descheduled)
        self.after_contended = False
        self.stop: GateEvent | None = None
        self.thread: threading.Thread | None = None
        self.wait_s, self.timeout_error = wait_s, timeout_error

    def park(self, where: str) -> None:
        with self.cv:
            self.parked_at = where
            self.cv.notify_all()
            self.cv.wait_for(lambda: self.granted > self.taken or (self.stop.is_set() and not
                                                                   (self.slow and where == "wait")))
            if self.granted > self.taken:
                self.taken += 1
            self.parked_at = None
            self.cv.notify_all()

    def wake(self) -> None:
        """A slow thread is scheduled again."""
        with self.cv:
            self.slow = False
            self.cv.notify_all()

    def wait_parked(self, what: str) -> str:
        with self.cv:
            if not self.cv.wait_for(lambda: self.parked_at is not None or not self.thread.is_alive(),
                                    timeout=self.wait_s):
                raise self.timeout_error(f"{what}: the tier-poll thread did not finish its pass within {self.wait_s}s")
            return self.parked_at if self.thread.is_alive() else "exited"

    def step(self, what: str) -> str:
        """One pass of the loop; returns where the thread waits afterwards (or ``"exited"``)."""
        with self.cv:
            if self.parked_at is None or not self.thread.is_alive():
                raise InvalidFieldError("step", what, "a pass of a tier-poll thread waiting for one")
            self.granted += 1
            self.cv.notify_all()
            self.cv.wait_for(lambda: self.taken == self.granted or not self.thread.is_alive(), timeout=self.wait_s)
        self.thread.join(0.001)
        return self.wait_parked(what)


class GateEvent(threading.Event):
    """The loop's stop event: ``wait`` (the pause after a round) lasts until the next pass."""

    def __init__(self, gate: PollGate) -> None:
        super().__init__()
        self.gate = gate

    def wait(self, timeout=None) -> bool:
        if not self.is_set():
            self.gate.park("wait")
        return self.is_set()

    def set(self) -> None:
        super().set()
        with self.gate.cv:
            self.gate.cv.notify_all()


class GatedLock:
    """The manager lock; the tier-poll thread's acquisitions follow :class:`PollGate`."""

    def __init__(self, gate: PollGate) -> None:
        self._lock = threading.Lock()
        self.gate = gate

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        gate = self.gate
        if threading.current_thread() is gate.thread:
            if gate.after_contended:
                gate.park("acquire")
            gate.after_contended = gate.contended
            return False if gate.contended else self._lock.acquire()
        if gate.contended:  # the trace says another thread holds it
            if blocking and timeout is None or blocking and timeout < 0:
                raise InvalidFieldError("timeout", timeout, "a bounded wait while the lock is held elsewhere")
            return False
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


class LogCapture(logging.Handler):
    """The tier-poll thread's messages in the manager's log, as the reference names them."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.events: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        for prefix, name in LOG_EVENTS:
            if msg.startswith(prefix):
                self.events.append(name)

    def take(self) -> list[str]:
        out, self.events = self.events, []
        return out


@contextlib.contextmanager
def stuck_join_timeout():
    """vLLM's shutdown join/lock timeout is :data:`STUCK_JOIN_TIMEOUT_S` for the ``with`` block."""
    import importlib

    mod = importlib.import_module(MANAGER_MODULE)
    saved, mod._TIER_POLL_JOIN_TIMEOUT_S = mod._TIER_POLL_JOIN_TIMEOUT_S, STUCK_JOIN_TIMEOUT_S
    try:
        yield
    finally:
        mod._TIER_POLL_JOIN_TIMEOUT_S = saved


@contextlib.contextmanager
def drive_poll_loop(tiering, wait_s: float, timeout_error: type[Exception]):
    """Yields (:class:`PollGate`, :class:`LogCapture`) with vLLM's tier-poll thread moved onto the
    gate (it first finishes the round the move wakes it for), inside a ``virtual_time`` block."""
    manager = tiering.manager
    if manager._tier_poll_thread is None:
        raise InvalidFieldError("tiering", tiering, "a tiering manager running a tier-poll thread")
    log = logging.getLogger(MANAGER_MODULE)
    gate = PollGate(wait_s, timeout_error)
    gate.thread = manager._tier_poll_thread
    gate.stop = GateEvent(gate)
    capture = LogCapture()
    saved_level, saved_propagate = log.level, log.propagate
    manager._lock = GatedLock(gate)
    old_stop, manager._tier_poll_stop = manager._tier_poll_stop, gate.stop
    old_stop.set()  # wakes the parked thread: one more round, then it waits on the gate
    gate.wait_parked("moving the tier-poll thread onto the gate")
    log.addHandler(capture)
    log.setLevel(logging.DEBUG)
    log.propagate = False  # the failures are planted: keep their tracebacks out of the output
    try:
        yield gate, capture
    finally:
        log.removeHandler(capture)
        log.setLevel(saved_level)
        log.propagate = saved_propagate
        gate.contended = False
        gate.stop.set()
        gate.wake()


__all__ = ["GateEvent", "GatedLock", "LOG_EVENTS", "LogCapture", "PollGate", "STUCK_JOIN_TIMEOUT_S", "drive_poll_loop",
           "stuck_join_timeout"]
