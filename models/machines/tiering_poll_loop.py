"""vLLM 0.33.0's tier-poll thread against the reference's :class:`TierPollLoop`, pass by pass.

The tiering traces (:mod:`kvref.models.machines.tiering`) park vLLM's tier-poll thread and run its
rounds themselves, so the loop around the rounds (what happens when a round fails, when the
manager lock cannot be had, when the thread gives up, and what ``shutdown`` does with a thread
that will not stop) never runs there. Each program here builds vLLM's tiering manager with kvref's
``PolledTier`` (which opts into the thread) through ``TieringOffloadingSpec`` and drives vLLM's own
thread one pass at a time (:mod:`kvref.impl.vllm.tiering_poll`): passes whose round fails (the
tier's serving raises) or that find the lock held by another thread, time passing (the stall
warning, the error-log interval, the give-up after 30 s of failures), engine steps (the tier is
still served per step after the thread gave up), and a shutdown with the thread waiting, waiting
at the lock, or stuck inside a round holding the lock (shutdown raises, shuts nothing down, and
succeeds once the round returns).

Compared after every operation: what the thread logged (stall warnings, failed rounds, give-up,
join timeout), where it waits (after a round, at the lock, or exited), how many rounds served the
tier, and at shutdown whether it raised and which tiers it reached.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import threading

from kvref.impl.reference.offload.tiering.clock import VirtualClock
from kvref.impl.reference.offload.tiering.poll_loop import TierPollLoop
from kvref.spec.errors import InvalidFieldError

POLLED = {"type": "PolledTier", "module_path": "kvref.impl.vllm.tiering_tiers"}
PATHS = ("stalled", "round_failed", "gave_up", "join_timeout", "shutdown_at_lock", "shutdown_stuck", "shutdown_slow",
         "step_after_give_up", "failure_recovered")


class PollLoopDivergence(AssertionError):
    """vLLM's tier-poll thread and the reference's loop disagree."""


def random_program(rng: random.Random, n_ops: int) -> list[tuple]:
    ops: list[tuple] = []
    contended = fail = False
    for _ in range(n_ops):
        r = rng.random()
        if r < 0.15:
            contended = not contended
        elif r < 0.3:
            fail = not fail
        kind = rng.choices(("pass", "advance", "step_end"), (6, 3, 1))[0]
        if kind == "pass":
            ops.append(("pass", contended, fail))
        elif kind == "advance":
            ops.append(("advance", rng.choice((0.0, 0.3, 0.5, 1.0, 5.0, 12.0, 31.0))))
        else:
            ops.append(("step_end",))
    ops.append(("shutdown", rng.choice(("parked", "parked", "stuck", "slow")), rng.random() < 0.5,
                rng.random() < 0.3))
    return ops


class PollLoopWorld:
    def __init__(self, tiering, gate, capture, clock: VirtualClock, counts: dict) -> None:
        self.tiering, self.gate, self.capture, self.clock, self.counts = tiering, gate, capture, clock, counts
        self.tier = tiering.tiers[0]
        self.ref = TierPollLoop()
        self.serve_base = self.tier.serve_calls
        self.steps = 0
        self.closed = False

    def hit(self, path: str) -> None:
        self.counts[path] = self.counts.get(path, 0) + 1

    def compare(self, what: str, ref_logs: list[str], where: str) -> None:
        self.ref.check_invariants()
        logs = self.capture.take()
        ref_where = self.ref.parked_at if self.ref.alive else "exited"
        served, ref_served = self.tier.serve_calls - self.serve_base, self.ref.rounds + self.steps
        if logs != ref_logs or where != ref_where or served != ref_served:
            raise PollLoopDivergence(
                f"{what}: the tier-poll thread logged {logs}, waits at {where!r}, served the tier {served} times; "
                f"the reference: logged {ref_logs}, waits at {ref_where!r}, served {ref_served} times")
        for e in logs:
            self.hit(e)

    def apply(self, op: tuple) -> None:
        name = op[0]
        if name == "advance":
            self.clock.advance(op[1])
            self.compare(repr(op), [], self._where())
        elif name == "pass":
            if not self.ref.alive:
                self.compare(repr(op) + " (skipped: the thread has returned)", [], self._where())
                return
            _, contended, fail = op
            failing_before = self.ref.failing_since is not None
            self.gate.contended = contended
            self.tier.fail_serve = fail
            try:
                where = self.gate.step(repr(op))
            finally:
                self.tier.fail_serve = False
            logs = self.ref.iteration(self.clock.monotonic(), not contended, not fail)
            if failing_before and not contended and not fail:
                self.hit("failure_recovered")
            self.compare(repr(op), logs, where)
        elif name == "step_end":
            from kvref.impl.vllm.tiering import schedule_end_context

            m = self.tiering.manager
            if self.gate.contended:  # the thread that holds the lock is this one
                m.on_schedule_end(schedule_end_context())
            else:
                with m.lock:
                    m.on_schedule_end(schedule_end_context())
            self.steps += 1
            if not self.ref.alive:
                self.hit("step_after_give_up")
            self.compare(repr(op), [], self._where())
        else:
            raise InvalidFieldError("op", op, "a tier-poll program operation")

    def _where(self) -> str:
        return self.gate.wait_parked("reading where the thread waits")

    def shutdown(self, kind: str, contended: bool, fail: bool) -> None:
        """vLLM's ``manager.shutdown()``; ``kind``: "parked" (the thread waits where it is) or
        "stuck" (first let it into a round that blocks, holding the lock)."""
        from kvref.impl.vllm.tiering import WAIT_S, TierTimeout
        from kvref.impl.vllm.tiering_poll import stuck_join_timeout

        m, calls = self.tiering.manager, self.tiering.shutdown_calls
        stuck = kind == "stuck" and self.ref.alive
        slow = kind == "slow" and self.ref.alive and self.ref.parked_at == "wait"
        release = threading.Event()
        if stuck:
            entered = threading.Event()
            self.gate.contended = False
            self.tier.hang = (entered, release)
            with self.gate.cv:
                self.gate.granted += 1
                self.gate.cv.notify_all()
            if not entered.wait(WAIT_S):
                raise TierTimeout("the tier-poll thread did not enter the round it was to be stuck in")
            self.hit("shutdown_stuck")
        elif slow:
            self.gate.slow = True
            self.hit("shutdown_slow")
        else:
            self.gate.contended = contended and self.ref.parked_at == "acquire"
            self.tier.fail_serve = fail
            if self.ref.alive and self.ref.parked_at == "acquire":
                self.hit("shutdown_at_lock")
        want, ref_logs = self.ref.shutdown(self.clock.monotonic(), not self.gate.contended, not fail, stuck, slow)
        self.tiering._flat.release()  # the harness's view of the primary buffer (VllmTiering.shutdown does so too)
        try:
            with stuck_join_timeout() if stuck or slow else contextlib.nullcontext():
                m.shutdown()
            got = "tiers"
        except RuntimeError:
            got = "raised"
        finally:
            release.set()
            self.gate.wake()
        self.tier.fail_serve = False
        self.gate.contended = False
        reached = list(calls)
        if stuck:
            self.gate.thread.join(WAIT_S)
            self.ref.stuck_round_ends()
        if slow:
            self.gate.thread.join(WAIT_S)
        where = "exited" if not self.gate.thread.is_alive() else "running"
        logs = self.capture.take()
        served, ref_served = self.tier.serve_calls - self.serve_base, self.ref.rounds + self.steps
        if (got, reached, logs, where, served) != (want, [0, "primary"] if want == "tiers" else [], ref_logs,
                                                   "exited", ref_served):
            raise PollLoopDivergence(
                f"shutdown ({kind}): vLLM {got}, reached {reached}, logged {logs}, thread {where}, served the tier "
                f"{served} times; the reference: {want}, logged {ref_logs}, served {ref_served} times")
        for e in logs:
            self.hit(e)
        if got == "raised":  # once the round has returned, shutdown goes through
            m.shutdown()
            if calls != [0, "primary"]:
                raise PollLoopDivergence(f"shutdown after the stuck round returned reached {calls}, "
                                         "the reference: [0, 'primary']")
        self.closed = True


def run_program(ops: list[tuple], counts: dict) -> None:
    from kvref.impl.vllm.tiering import WAIT_S, TierTimeout, build_vllm_tiering, virtual_time
    from kvref.impl.vllm.tiering_poll import drive_poll_loop

    clock = VirtualClock()
    with virtual_time(clock):
        tiering = build_vllm_tiering(2, [dict(POLLED)], clock, enable_events=False)
        world = None
        try:
            with drive_poll_loop(tiering, WAIT_S, TierTimeout) as (gate, capture):
                world = PollLoopWorld(tiering, gate, capture, clock, counts)
                for op in ops[:-1]:
                    world.apply(op)
                world.shutdown(*ops[-1][1:])
        finally:
            if world is None or not world.closed:  # a divergence: release what the program holds
                with contextlib.suppress(Exception):
                    tiering.shutdown()
            shutil.rmtree(tiering.root, ignore_errors=True)


def run_programs(seed: int, n: int, n_ops: tuple[int, int] = (10, 40)) -> dict:
    """``n`` generated programs (seeded by ``seed``); returns op and path counts."""
    rng = random.Random(f"conform-tiering-poll-loop-{seed}")
    counts: dict = {"poll_programs": 0, "poll_ops": 0}
    for _ in range(n):
        ops = random_program(rng, rng.randint(*n_ops))
        run_program(ops, counts)
        counts["poll_programs"] += 1
        counts["poll_ops"] += len(ops)
    return counts


__all__ = ["PATHS", "PollLoopDivergence", "PollLoopWorld", "random_program", "run_program", "run_programs"]
