"""Streaming-input sessions inside whole scheduler steps (issue #22;
:mod:`kvref.impl.reference.scheduler_sessions`). Part of ``conform-scheduler``.

:class:`SessionMachine` is :class:`~kvref.models.machines.scheduler.SchedulerMachine` (FCFS,
startup-consistent setups, no speculative decoding, pause states) whose arrivals are mostly
``resumable`` sessions, with a rule that sends a live session its next input chunk (or the
finishing ``None``) through ``add_request`` with the same id. A session whose turn stops keeps its
KV blocks: it waits for input in vLLM's ``kv_holding_waiting`` (skipped by the waiting loop, still
holding a model-runner slot, left out of the unfinished count, counted as deferred), or resumes on
its own blocks once an update arrives. After every operation the main machine's comparison runs
(outputs, queues including ``kv_holding_waiting``, request states, block ids, free queue, KV
events) plus the counts the engine polls and ``make_stats``
(:class:`~kvref.models.machines.scheduler_pause.PauseDriving`), and, with ``include_finished_set``
on, the ids each update reports freed since the previous one; ``finish_requests(None)`` aborts all. At teardown every live session is
sent the finishing update and the engine runs until all are finished (or, on a pool the waiting
sessions filled, until the KV-holding session at the head waits for blocks nobody frees).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from kvref.impl.request import Request
from kvref.impl.scheduler_types import FCFS
from kvref.models.machines.counted_lockstep import run_counted
from kvref.models.machines.scheduler import (
    COVERAGE,
    MAX_REQUESTS,
    Lockstep,
    RequestSpec,
    SchedulerMachine,
    SchedulerRun,
    _diverge,
    fake_token,
    request_specs,
    run_lockstep_machine,
    scheduler_setups,
)
from kvref.models.machines.scheduler_pause import PAUSE_DRAWS, PauseDriving

#: schedule calls the teardown allows the finishing sessions (far above what they need)
TEARDOWN_STEPS = 400


@dataclass(frozen=True)
class SessionRequestSpec(RequestSpec):
    """A :class:`RequestSpec` that may open a streaming session."""

    resumable: bool = False

    def make(self) -> Request:
        return Request(self.request_id, list(self.prompt), max_tokens=self.max_tokens, priority=self.priority,
                       arrival_time=self.arrival_time, stop_token_ids=self.stop_token_ids, resumable=self.resumable)


class SessionLockstep(PauseDriving, Lockstep):
    """:class:`Lockstep` with session updates and the polled counts compared."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        #: session id -> the most tokens it may reach with the updates sent so far
        self.worst_length: dict[str, int] = {}

    def _ref(self):
        return self.targets.get("ref")

    def add(self, spec: RequestSpec) -> None:
        if getattr(spec, "resumable", False):
            self.worst_length[spec.request_id] = len(spec.prompt) + spec.max_tokens
        super().add(spec)

    def live_sessions(self) -> list[str]:
        snap = self.last_snapshot
        return [rid for rid in self.worst_length
                if snap is not None and rid in snap.requests and snap.requests[rid].status != "finished"]

    def update(self, request_id: str, prompt: tuple[int, ...] | None, max_tokens: int, arrival_time: float) -> None:
        """``add_request`` with a live session's id: the next chunk, or (``prompt`` None) its end."""
        ref = self._ref()
        waiting = ref is not None and request_id in ref.sessions.state.waiting_for_input
        if prompt is None:
            COVERAGE["session_finish_while_waiting" if waiting else "session_finish_queued"] += 1
        else:
            COVERAGE["session_update_applied_at_once" if waiting else "session_update_queued"] += 1
            self.worst_length[request_id] += len(prompt) + max_tokens
        for t in self.targets.values():
            t.add_request(Request(request_id, list(prompt or (0,)), max_tokens=max_tokens,
                                  arrival_time=arrival_time, resumable=prompt is not None))
        self.num_steps += 1
        self.compare(f"update {request_id}")

    def _check_whole_prompts(self, out) -> None:
        """The main machine's rule, for non-session requests (a session's prompt grows with its
        updates; the comparison with vLLM covers them)."""
        super()._check_whole_prompts(replace(out, scheduled=tuple(
            s for s in out.scheduled if s.request_id not in self.worst_length)))

    def schedule(self):
        ref = self._ref()
        blocked = len(ref.sessions.state.waiting_for_input) if ref is not None else 0
        out = super().schedule()
        COVERAGE["session_steps_with_one_waiting_for_input"] += bool(blocked)
        for s in out.scheduled:
            if s.kind == "new" and s.request_id in self.worst_length and s.num_computed_tokens:
                COVERAGE["session_resumed_on_its_blocks"] += 1
        return out

    def abort_all(self) -> None:
        """``finish_requests(None)``: every live request aborted (sessions waiting for input too)."""
        for t in self.targets.values():
            t.finish_requests(None)
        self.num_steps += 1
        COVERAGE["session_abort_all"] += 1
        self.compare("finish_requests(None)")

    def complete(self, seed: int | None = None) -> None:
        before = self.last_snapshot
        super().complete(seed)
        # include_finished_set: the ids freed since the previous update (aborts between them too)
        (n0, f0), *rest = ((name, t.finished_requests) for name, t in self.targets.items())
        for name, f in rest:
            if f != f0:
                _diverge(f"update_from_output (step {self.num_steps}): finished_requests differ: {n0} {sorted(f0 or ())}, "
                         f"{name} {sorted(f or ())}", "update_from_output: finished_requests differ")
        COVERAGE["finished_set_reported"] += bool(f0)
        after = self.last_snapshot
        for rid in self.worst_length:
            b, a = before.requests.get(rid), after.requests.get(rid)
            if b is not None and a is not None and b.status == "running" and a.status == "waiting":
                COVERAGE["session_turn_stopped_kept"] += 1
                COVERAGE["session_stopped_with_placeholders"] += b.num_output_placeholders > 1
                COVERAGE["session_kept_kv_blocks"] += rid in after.kv_holding_waiting


class SessionMachine(SchedulerMachine):
    """The scheduler machine with streaming sessions, their updates and pause states."""

    driver_class: type = SessionLockstep
    #: ``name -> (pool, config) -> target``
    factories: dict[str, Callable] = {}

    @initialize(setup=scheduler_setups(consistent=True, spec=False, policy=FCFS), seqs=st.integers(2, 4))
    def init(self, setup, seqs):
        pool, config = setup
        # room for more than the sessions waiting for input, so the waiting loop meets them
        config = replace(config, max_num_seqs=max(config.max_num_seqs, seqs))
        self.driver = self.driver_class(replace(pool, log_stats=True), config, self.factories)  # make_stats compared
        self.num_added = 0

    @precondition(lambda self: self.num_added < MAX_REQUESTS)
    @rule(data=st.data())
    def add_request(self, data):
        longest = self.driver.pool.max_model_len
        # short prompts and turns, so sessions stop (and take updates) within the trace
        spec = data.draw(request_specs(self.num_added, min(longest, 12)))
        # a stop token the fake model samples early: under async scheduling the turn then stops with
        # an output placeholder in flight, which _handle_stopped_request must drop
        stop = data.draw(st.sampled_from((spec.stop_token_ids, (fake_token(spec.request_id, 0),),
                                          (fake_token(spec.request_id, 1),))))
        spec = SessionRequestSpec(**{**spec.__dict__, "max_tokens": min(spec.max_tokens, 4), "stop_token_ids": stop},
                                  resumable=data.draw(st.sampled_from((True, True, True, False))))
        self.num_added += 1
        COVERAGE["session_arrivals"] += spec.resumable
        self.driver.add(spec)

    @precondition(lambda self: self.driver.live_sessions())
    @rule(data=st.data())
    def update_session(self, data):
        rid = data.draw(st.sampled_from(self.driver.live_sessions()))
        if data.draw(st.integers(0, 5)) == 0:
            self.driver.update(rid, None, 1, 0.0)
            return
        prompt = tuple(data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=4)))
        max_tokens = data.draw(st.integers(1, 3))
        if self.driver.worst_length[rid] + len(prompt) + max_tokens >= self.driver.pool.max_model_len:
            return  # the session would outgrow the model: the engine's input processor refuses that
        self.driver.update(rid, prompt, max_tokens, float(data.draw(st.integers(0, 50))))

    def _waiting_at_block_end(self) -> list[str]:
        """Sessions waiting for input whose dropped final token ends a hash block: an update must
        take that block's hash with it (vLLM trims ``block_hashes`` at ``keep_end // hash_block_size``)."""
        ref = self.driver.targets.get("ref")
        if ref is None:
            return []
        hbs = self.driver.pool.hash_block_size
        return [rid for rid in sorted(ref.sessions.state.waiting_for_input)
                if ref.requests[rid].num_tokens % hbs == 0
                and self.driver.worst_length[rid] + hbs + 1 < self.driver.pool.max_model_len]

    @precondition(lambda self: self._waiting_at_block_end())
    @rule(data=st.data())
    def update_at_block_end(self, data):
        """The update refills the block its session's dropped token ended, so that block is
        computed and cached again under the hash of its new tokens."""
        rid = data.draw(st.sampled_from(self._waiting_at_block_end()))
        hbs = self.driver.pool.hash_block_size
        COVERAGE["session_update_drops_a_full_blocks_hash"] += 1
        self.driver.update(rid, tuple(data.draw(st.lists(st.integers(1, 40), min_size=hbs, max_size=hbs))), 1,
                           float(data.draw(st.integers(0, 50))))

    @rule(state=st.sampled_from(PAUSE_DRAWS))
    def set_pause_state(self, state):
        self.driver.set_pause_state(state)

    @precondition(lambda self: self.num_added >= 3)
    @rule(data=st.data())
    def abort_all(self, data):
        if data.draw(st.integers(0, 7)) == 0:  # rarely: it ends every session of the trace
            self.driver.abort_all()

    def whole_prompts_compete(self) -> None:
        """Not a rule here: its long prompts leave no room for session updates (the main machine runs it)."""

    def teardown(self):
        """Finish every live session (the finishing update), resume, and run the engine until all
        requests are finished; every step is compared."""
        driver = getattr(self, "driver", None)
        if driver is None:
            return
        from kvref.models.machines.scheduler_pause import PauseState

        if driver.pause_state != PauseState.UNPAUSED:
            driver.set_pause_state(PauseState.UNPAUSED)
        for rid in driver.live_sessions():
            driver.update(rid, None, 1, 0.0)
        for _ in range(TEARDOWN_STEPS):
            if not (driver.unfinished() or driver.num_in_flight()):
                COVERAGE["session_teardown_drained"] += 1
                return
            driver.engine_step()
        # Sessions keep their KV blocks while they wait, and the waiting loop preempts nobody: on a
        # full pool a KV-holding session at the head can wait forever for blocks other sessions
        # hold (vLLM 0.33.0 as well; both sides stayed equal at every step above)
        snap = driver.last_snapshot
        assert snap.kv_holding_waiting and not snap.running, \
            f"liveness: not drained in {TEARDOWN_STEPS} steps without a KV-holding session at the head: " \
            f"waiting={snap.waiting} running={snap.running} kv_holding_waiting={snap.kv_holding_waiting}"
        COVERAGE["session_teardown_kv_held_by_sessions"] += 1


def run_session_machine(examples: int, reproducible: bool = False, shrink: bool = True,
                        seed: int | None = None) -> SchedulerRun:
    """The reference scheduler in lock step with vLLM 0.33.0's on :class:`SessionMachine` traces
    (at least 30 operations each)."""
    from kvref.impl.reference.scheduler import Scheduler
    from kvref.impl.vllm.scheduler import VllmEnv, VllmScheduler

    env = VllmEnv()
    factories = {"vllm": lambda p, c: VllmScheduler(p, c, env, include_finished_set=True),
                 "ref": lambda p, c: Scheduler(p, c, record_prefix_cache_stats=True, include_finished_set=True)}

    def machine_for(counting: type):
        return type("SessionRun", (SessionMachine,), {"driver_class": counting, "factories": factories})

    return SchedulerRun(**run_counted(
        machine_for, SessionLockstep,
        lambda machine: run_lockstep_machine(machine, max(1, examples), steps=45, min_steps=31, seed=seed,
                                             reproducible=reproducible, shrink=shrink), COVERAGE))
