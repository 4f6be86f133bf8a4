"""The tier-poll thread's loop (vLLM ``TieringOffloadingManager._tier_poll_loop`` and ``shutdown``).

Tiers that cannot wait for an engine step (a peer asking for blocks) opt into a thread that runs
``poll_tiers`` rounds under the manager lock. What the rest of the system sees of that thread:

* whether rounds still run off-thread (peers served between steps) or the thread has given up and
  only ``on_schedule_end`` serves those tiers;
* what it logs: a warning when it could not take the manager lock for more than
  :data:`TIER_POLL_STALL_WARN_S` (the stall clock restarts after each warning and at every round
  that gets the lock), a failed round's exception at most once per
  :data:`TIER_POLL_ERROR_LOG_INTERVAL_S`, and an error when it stops after
  :data:`TIER_POLL_GIVE_UP_AFTER_S` of consecutive failed rounds (a round that succeeds restarts
  that clock). A round that never gets the lock neither fails nor succeeds;
* what ``shutdown`` does with it: stop and join it before any tier is torn down (a tier transport
  closed under a live round can crash the process); a thread that does not exit in time gets an
  error log, and then the tiers are shut down under the manager lock (the thread exits when it
  next wakes, seeing the stop request), or, if even the lock is
  unavailable (the thread is stuck mid-round), ``shutdown`` raises and shuts nothing down.

:class:`TierPollLoop` follows one thread: :meth:`iteration` is one pass of the loop,
:meth:`shutdown` what ``shutdown()`` reaches. Logged events are names: ``"stalled"``,
``"round_failed"``, ``"gave_up"``, ``"join_timeout"``.
"""

from __future__ import annotations

import math

from kvref.spec.errors import InvalidFieldError

TIER_POLL_STALL_WARN_S = 30.0
TIER_POLL_GIVE_UP_AFTER_S = 30.0
TIER_POLL_ERROR_LOG_INTERVAL_S = 1.0


def _check_time(now) -> float:
    if isinstance(now, bool) or not isinstance(now, (int, float)) or not math.isfinite(now) or now < 0:
        raise InvalidFieldError("now", now, "a finite, non-negative monotonic time in seconds")
    return float(now)


def _check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise InvalidFieldError(name, value, "a bool")
    return value


class TierPollLoop:
    """One tier-poll thread, from its first round on."""

    def __init__(self) -> None:
        self.stalled_since: float | None = None
        self.failing_since: float | None = None
        self.last_error_log = 0.0
        self.alive = True
        self.rounds = 0  # poll_tiers rounds run (failed ones included)
        #: where the thread waits for its next pass: "wait" (the pause after a round) or "acquire"
        #: (straight back at the lock after a pass that did not get it)
        self.parked_at = "wait"

    def iteration(self, now: float, lock_free: bool, round_ok: bool = True) -> list[str]:
        """One pass: take the manager lock (``lock_free`` says whether it can be had within the
        lock timeout), run a round that fails unless ``round_ok``; returns what it logged."""
        now = _check_time(now)
        _check_bool("lock_free", lock_free)
        _check_bool("round_ok", round_ok)
        if not self.alive:
            raise InvalidFieldError("iteration", now, "a pass of a thread that is still running (it gave up)")
        logs: list[str] = []
        if not lock_free:
            self.parked_at = "acquire"
            if self.stalled_since is None:
                self.stalled_since = now
            elif now - self.stalled_since > TIER_POLL_STALL_WARN_S:
                logs.append("stalled")
                self.stalled_since = None
            return logs
        self.stalled_since = None
        self.parked_at = "wait"
        self.rounds += 1
        if round_ok:
            self.failing_since = None
        else:
            if self.failing_since is None:
                self.failing_since = now
            if now - self.last_error_log >= TIER_POLL_ERROR_LOG_INTERVAL_S:
                self.last_error_log = now
                logs.append("round_failed")
        if self.failing_since is not None and now - self.failing_since >= TIER_POLL_GIVE_UP_AFTER_S:
            logs.append("gave_up")
            self.alive = False
        return logs

    def shutdown(self, now: float, lock_free: bool, round_ok: bool = True, stuck: bool = False,
                 slow: bool = False) -> tuple[str, list[str]]:
        """``shutdown()`` while the thread waits where :attr:`parked_at` says, or (``stuck``) while
        it is blocked inside a round that got the lock (a round that will succeed once unblocked:
        :meth:`stuck_round_ends`). Returns (``"tiers"``: the tiers and the primary are shut down;
        ``"raised"``: RuntimeError, nothing shut down; what was logged). A thread parked at the
        lock takes one more pass first (``lock_free``/``round_ok`` as in :meth:`iteration`); then it
        sees the stop request and exits. ``slow``: the thread, waiting after a round, wakes only
        after the join timed out (descheduled): the tiers are shut down under the manager lock."""
        now = _check_time(now)
        for name, flag in (("lock_free", lock_free), ("round_ok", round_ok), ("stuck", stuck), ("slow", slow)):
            _check_bool(name, flag)
        if not self.alive:
            return "tiers", []
        if slow and not stuck and self.parked_at == "wait":
            self.alive = False
            return "tiers", ["join_timeout"]
        if stuck:
            self.stalled_since = None
            self.parked_at = "wait"
            self.rounds += 1
            return "raised", ["join_timeout"]
        logs = self.iteration(now, lock_free, round_ok) if self.parked_at == "acquire" else []
        self.alive = False
        return "tiers", logs

    def stuck_round_ends(self) -> None:
        """The round a stuck thread was blocked in returns (successfully); the stop request set by
        the failed shutdown ends the thread."""
        if not self.alive:
            raise InvalidFieldError("stuck_round_ends", None, "a thread stuck in a round")
        self.failing_since = None
        self.alive = False

    def check_invariants(self) -> None:
        assert self.parked_at in ("wait", "acquire"), f"T6: parked at {self.parked_at!r}"
        assert self.stalled_since is None or self.parked_at == "acquire", "T6: a stall clock after a round"
        assert self.rounds >= 0 and self.last_error_log >= 0.0, \
            f"T6: negative rounds or error-log time ({self.rounds}, {self.last_error_log})"


__all__ = ["TIER_POLL_ERROR_LOG_INTERVAL_S", "TIER_POLL_GIVE_UP_AFTER_S", "TIER_POLL_STALL_WARN_S", "TierPollLoop"]
