"""Structured-output requests in the scheduler: a part of ``conform-scheduler`` (issues #22, #28).

:class:`StructuredOutputMachine` is the scheduler machine (speculative decoding in half the setups)
with arrivals that use structured output half the time, and rules that script their grammars: one
compiles (or, one time in five, fails), the grammar accepts only a drawn prefix of a request's
drafts, or it rejects a request's next sampled tokens. The reference scheduler
(:mod:`kvref.impl.reference.scheduler_structured_output`) and vLLM 0.33.0's ``Scheduler`` ask the
same :class:`~kvref.impl.reference.scheduler_structured_output.ScriptedGrammarOracle` (vLLM through
:mod:`kvref.impl.vllm.structured_output`), so after every operation the main machine's comparison
(outputs, queues, request states, block ids, free queue, KV events, spec-decode stats) and the
requests waiting for their grammar (``SchedulerSnapshot.waiting_for_grammar``) must agree: a
request skipped while its grammar compiles, one finished as an error (its grammar failed: it never
held a block; its tokens rejected: its blocks freed), drafts cut to the grammar's prefix (fewer
lookahead slots; in an in-flight step padded and counted as invalid). At teardown every grammar
still compiling is made ready and liveness is drained as in the main machine.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Callable

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from kvref.impl.reference.scheduler_structured_output import ScriptedGrammarOracle
from kvref.impl.request import Request
from kvref.models.machines.counted_lockstep import run_counted
from kvref.models.machines.scheduler import (
    COVERAGE,
    MAX_REQUESTS,
    Lockstep,
    RequestSpec,
    SchedulerMachine,
    SchedulerRun,
    _diverge,
    machine_with,
    request_specs,
    run_lockstep_machine,
    scheduler_setups,
)

#: what the structured-output rules reached, summed over a run
SO_COVERAGE: Counter = Counter()


@dataclass(frozen=True)
class StructuredRequestSpec(RequestSpec):
    """A :class:`RequestSpec` that may use structured output."""

    use_structured_output: bool = False

    def make(self) -> Request:
        return Request(self.request_id, list(self.prompt), max_tokens=self.max_tokens, priority=self.priority,
                       arrival_time=self.arrival_time, stop_token_ids=self.stop_token_ids,
                       use_structured_output=self.use_structured_output)


class StructuredOutputLockstep(Lockstep):
    """:class:`Lockstep` whose targets share one scripted grammar oracle (factories take
    ``(pool, config, oracle)``), tallying what the grammars did."""

    def __init__(self, pool, config, factories: dict[str, Callable], kv_events: bool = True) -> None:
        self.oracle = ScriptedGrammarOracle()
        # log_stats: make_stats compared (a request waiting for its grammar is deferred from arrival:
        # vLLM's num_skipped_waiting_reqs counts it)
        super().__init__(replace(pool, log_stats=True),
                         config, {name: (lambda p, c, f=f: f(p, c, self.oracle)) for name, f in factories.items()},
                         kv_events)
        self.structured_ids: list[str] = []

    def compare(self, what: str) -> None:
        super().compare(what)
        stats = {name: t.make_stats() for name, t in self.targets.items()}
        (n0, s0), *rest = stats.items()
        for name, st_ in rest:
            if st_ != s0:
                keys = sorted(k for k in s0 if s0.get(k) != (st_ or {}).get(k))
                _diverge(f"after {what} (step {self.num_steps}): make_stats {', '.join(keys)} differ\n"
                         f"  {n0}: {s0}\n  {name}: {st_}", f"after {what}: make_stats {', '.join(keys)} differ")
        SO_COVERAGE["so_deferred_counted"] += bool(s0 and s0.get("num_skipped_waiting_reqs"))

    def add(self, spec: RequestSpec) -> None:
        if getattr(spec, "use_structured_output", False):
            self.structured_ids.append(spec.request_id)
            SO_COVERAGE["so_arrivals"] += 1
        super().add(spec)

    def pending(self) -> list[str]:
        """Structured-output requests still waiting for their grammar (the last snapshot's)."""
        return list(self.last_snapshot.waiting_for_grammar) if self.last_snapshot is not None else []

    def live_structured(self) -> list[str]:
        states = self.last_snapshot.requests if self.last_snapshot is not None else {}
        return [r for r in self.structured_ids if r in states and states[r].status != "finished"]

    def schedule(self):
        waiting_before = set(self.pending())
        out = super().schedule()
        admitted = {s.request_id for s in out.scheduled if s.kind == "new"}
        still = set(self.last_snapshot.waiting_for_grammar)
        SO_COVERAGE["so_admitted_after_grammar"] += len(admitted & waiting_before)
        SO_COVERAGE["so_admitted_past_pending_grammar"] += len(admitted - waiting_before) if still else 0
        return out

    def complete(self, seed: int | None = None) -> None:
        before = self.last_snapshot.requests if self.last_snapshot is not None else {}
        super().complete(seed)
        for rid, s in self.last_snapshot.requests.items():
            b = before.get(rid)
            if s.finish_reason == "error" and b is not None and b.finish_reason is None:
                SO_COVERAGE["so_rejected_sampled" if b.num_computed_tokens else "so_failed_grammar_finished"] += 1


class StructuredOutputMachine(SchedulerMachine):
    """The scheduler machine with structured-output arrivals and grammar rules."""

    @precondition(lambda self: self.num_added < MAX_REQUESTS)
    @rule(data=st.data())
    def add_request(self, data):
        spec = data.draw(request_specs(self.num_added, self.driver.pool.max_model_len))
        spec = StructuredRequestSpec(**spec.__dict__, use_structured_output=data.draw(st.booleans()))
        self.num_added += 1
        self.driver.add(spec)

    @precondition(lambda self: bool(self.driver.pending()))
    @rule(data=st.data())
    def grammar_compiles(self, data):
        """A pending grammar finishes compiling: ready, or (one time in five) a compile error."""
        rid = data.draw(st.sampled_from(self.driver.pending()))
        state = data.draw(st.sampled_from(("ready", "ready", "ready", "ready", "error")))
        self.driver.oracle.set_state(rid, state)
        SO_COVERAGE[f"so_grammar_{state}"] += 1

    @precondition(lambda self: self.driver.config.num_speculative_tokens > 0 and bool(self.driver.live_structured()))
    @rule(data=st.data())
    def grammar_cuts_drafts(self, data):
        """From now on the grammar accepts only the first few drafts of a request."""
        rid = data.draw(st.sampled_from(self.driver.live_structured()))
        k = data.draw(st.integers(0, self.driver.config.num_speculative_tokens - 1))
        self.driver.oracle.limit_drafts(rid, k)
        SO_COVERAGE["so_draft_limits"] += 1

    @precondition(lambda self: bool(self.driver.live_structured()))
    @rule(data=st.data())
    def grammar_rejects_sampled(self, data):
        """The grammar rejects the request's next sampled tokens (vLLM: "Unexpected: grammar
        rejected tokens"): rare, one draw in four of this rule."""
        if data.draw(st.integers(0, 3)):
            return
        rid = data.draw(st.sampled_from(self.driver.live_structured()))
        self.driver.oracle.reject_sampled(rid)
        SO_COVERAGE["so_rejections_scripted"] += 1

    def teardown(self):
        driver = getattr(self, "driver", None)
        if driver is not None:
            for rid in driver.pending():  # every grammar compiles eventually
                driver.oracle.set_state(rid, "ready")
        super().teardown()


def run_structured_output_machine(examples: int, reproducible: bool = False, shrink: bool = True,
                                  seed: int | None = None) -> SchedulerRun:
    """The reference scheduler in lock step with vLLM 0.33.0's on :class:`StructuredOutputMachine`
    traces (at least 30 operations each; liveness drained at teardown)."""
    from kvref.impl.reference.scheduler import Scheduler
    from kvref.impl.vllm.scheduler import VllmEnv, VllmScheduler

    env = VllmEnv()
    factories: dict[str, Callable] = {
        "vllm": lambda p, c, o: VllmScheduler(p, c, env, grammar_oracle=o),
        "ref": lambda p, c, o: Scheduler(p, c, grammar_oracle=o, record_prefix_cache_stats=True)}
    base = machine_with(factories, setups=scheduler_setups(spec=None), name="StructuredOutputBase", spec=True)
    return SchedulerRun(**run_counted(
        lambda counting: type("StructuredOutputRun", (StructuredOutputMachine, base), {"driver_class": counting}),
        StructuredOutputLockstep,
        lambda machine: run_lockstep_machine(machine, max(1, examples), steps=45, min_steps=31, seed=seed,
                                             reproducible=reproducible, shrink=shrink), COVERAGE, SO_COVERAGE))
