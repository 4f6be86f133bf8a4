"""Stop rules in the scheduler: EOS tokens, ``min_tokens`` and repetition detection (issue #22;
:mod:`kvref.impl.reference.scheduler_stop`). Part of ``conform-scheduler``.

:class:`StopMachine` is :class:`~kvref.models.machines.scheduler.SchedulerMachine` on the main
machine's startup-consistent setups (no speculative decoding) with arrivals that carry an EOS token
(or none), a ``min_tokens`` up to their ``max_tokens`` and, for most, a repetition detector. The
model samples from three tokens only (:class:`FewTokenModel`), so EOS tokens are sampled, and the
output repeats an n-gram within a few steps, often before ``min_tokens`` lets the detector finish
the request. Every finish frees the request's KV blocks inside ``update_from_output``; after every
operation the main machine's comparison runs (outputs, queues, request states with their finish
reasons, block ids, free queue, KV events) against vLLM's own ``check_stop``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from kvref.impl.reference.scheduler_stop import ends_in_repetition
from kvref.impl.request import RepetitionDetectionParams, Request
from kvref.impl.scheduler_types import ModelOutput, SchedulerOutput
from kvref.models.machines.counted_lockstep import run_counted
from kvref.models.machines.scheduler import (
    COVERAGE,
    MAX_REQUESTS,
    FakeModel,
    Lockstep,
    RequestSpec,
    SchedulerMachine,
    SchedulerRun,
    fake_token,
    request_specs,
    run_lockstep_machine,
    scheduler_setups,
)

#: the tokens :class:`FewTokenModel` samples
FEW_TOKENS = (41, 42, 43)


class FewTokenModel(FakeModel):
    """:class:`FakeModel` over :data:`FEW_TOKENS`: outputs repeat n-grams and hit EOS ids soon;
    ``salt`` (drawn per trace) varies what a request id samples from trace to trace."""

    salt: int = 0

    def output(self, out: SchedulerOutput, accept=None) -> ModelOutput:
        sampled = {}
        for s in out.scheduled:
            if not s.is_prefill_chunk:  # one token per sampling step (no speculative decoding here)
                k = self.num_sampled.get(s.request_id, 0)
                self.num_sampled[s.request_id] = k + 1
                token = fake_token(f"{self.salt}/{s.request_id}", k)
                sampled[s.request_id] = [FEW_TOKENS[token % len(FEW_TOKENS)]]
        return ModelOutput(sampled)


@dataclass(frozen=True)
class StopRequestSpec(RequestSpec):
    """A :class:`RequestSpec` with the stop rules of ``check_stop``."""

    eos_token_id: int | None = None
    min_tokens: int = 0
    #: ``(max_pattern_size, min_pattern_size, min_count)`` or None
    repetition: tuple[int, int, int] | None = None

    def make(self) -> Request:
        rd = None if self.repetition is None else RepetitionDetectionParams(*self.repetition)
        return Request(self.request_id, list(self.prompt), max_tokens=self.max_tokens, priority=self.priority,
                       arrival_time=self.arrival_time, stop_token_ids=self.stop_token_ids,
                       eos_token_id=self.eos_token_id, min_tokens=self.min_tokens, repetition_detection=rd)


@st.composite
def repetition_params(draw):
    """Detectors vLLM accepts, the disabled ones (``max_pattern_size`` 0) among them."""
    max_size = draw(st.sampled_from((0, 1, 1, 1, 2, 2, 3)))
    min_size = draw(st.integers(0, max_size))
    return max_size, min_size, draw(st.integers(2, 3)) if max_size else draw(st.sampled_from((0, 2)))


class StopLockstep(Lockstep):
    """:class:`Lockstep` with :class:`FewTokenModel`, tallying how each request finished."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.model = FewTokenModel()

    def complete(self, seed: int | None = None) -> None:
        before = self.last_snapshot.requests if self.last_snapshot is not None else {}
        super().complete(seed)
        after = self.last_snapshot.requests
        for rid, state in after.items():
            was = before.get(rid)
            spec = self.specs[rid]
            if was is None or not isinstance(spec, StopRequestSpec):
                continue
            outputs = list(state.output_token_ids)
            if state.finish_reason == "stop" and was.finish_reason is None and outputs \
                    and outputs[-1] == spec.eos_token_id:
                COVERAGE["stop_eos"] += 1
            if state.finish_reason == "repetition" and was.finish_reason is None and spec.min_tokens \
                    and len(outputs) == spec.min_tokens:
                COVERAGE["repetition_at_min_tokens"] += 1  # the first output min_tokens lets it finish
            if state.finish_reason is None and spec.repetition is not None and outputs \
                    and len(outputs) < spec.min_tokens and len(outputs) > len(was.output_token_ids) \
                    and ends_in_repetition(outputs, RepetitionDetectionParams(*spec.repetition)):
                COVERAGE["repetition_held_by_min_tokens"] += 1


class StopMachine(SchedulerMachine):
    """The scheduler machine with EOS tokens, ``min_tokens`` and repetition detectors."""

    driver_class: type = StopLockstep
    #: ``name -> (pool, config) -> target``
    factories: dict[str, Callable] = {}

    @initialize(setup=scheduler_setups(consistent=True, spec=False), salt=st.integers(0, 255))
    def init(self, setup, salt):
        pool, config = setup
        self.driver = self.driver_class(pool, config, self.factories)
        self.driver.model.salt = salt
        self.num_added = 0

    @precondition(lambda self: self.num_added < MAX_REQUESTS)
    @rule(data=st.data())
    def add_request(self, data):
        # mostly short prompts: decoding (where every stop rule lives) starts within a few steps
        longest = self.driver.pool.max_model_len
        spec = data.draw(request_specs(self.num_added, data.draw(st.sampled_from((min(longest, 12), longest)))))
        # EOS for about a third (one of the three sampled tokens finishes a request soon), a
        # min_tokens for most (small ones often, so repetitions meet it), a detector for most
        # room for several outputs, so a rule other than max_tokens has a chance to finish it first
        max_tokens = data.draw(st.integers(3, 16))
        spec = StopRequestSpec(**{**spec.__dict__, "max_tokens": max_tokens},
                               eos_token_id=data.draw(st.sampled_from((None, None, None, None) + FEW_TOKENS[:2])),
                               min_tokens=data.draw(st.sampled_from((0, 2, 3)) | st.integers(0, max_tokens)),
                               repetition=data.draw(st.none() | repetition_params() | repetition_params()))
        self.num_added += 1
        COVERAGE["stop_rule_arrivals"] += 1
        self.driver.add(spec)

    def whole_prompts_compete(self) -> None:
        """Not a rule here: its arrivals would carry no stop rules (the main machine runs it)."""

    def abort(self) -> None:
        """Not a rule here: aborts (the main machine's) would end most requests before a stop rule."""


def run_stop_machine(examples: int, reproducible: bool = False, shrink: bool = True,
                     seed: int | None = None) -> SchedulerRun:
    """The reference scheduler in lock step with vLLM 0.33.0's on :class:`StopMachine` traces (at
    least 30 operations each; liveness drained at teardown)."""
    from kvref.impl.reference.scheduler import Scheduler
    from kvref.impl.vllm.scheduler import VllmEnv, VllmScheduler

    env = VllmEnv()
    factories = {"vllm": lambda p, c: VllmScheduler(p, c, env), "ref": lambda p, c: Scheduler(p, c)}

    def machine_for(counting: type):
        return type("StopRun", (StopMachine,), {"driver_class": counting, "factories": factories})

    return SchedulerRun(**run_counted(
        machine_for, StopLockstep,
        lambda machine: run_lockstep_machine(machine, max(1, examples), steps=45, min_steps=31, seed=seed,
                                             reproducible=reproducible, shrink=shrink), COVERAGE))
