"""LoRA requests in the scheduler: vLLM's ``max_loras`` admission rule (issue #22;
:mod:`kvref.impl.reference.scheduler_lora`). Part of ``conform-scheduler``.

:class:`LoraMachine` is :class:`~kvref.models.machines.scheduler.SchedulerMachine` on setups with
LoRA on (``max_loras`` 1 or 2, room for two to four requests at once) and arrivals that carry one of
three adapters (or none). While the running requests already use ``max_loras`` adapters, a waiting
request with another one is skipped and requeued, and the requests behind it (same adapter, or
none) are admitted past it; the adapters' names enter the block hashes, so prefix hits stay within
an adapter. After every operation the main machine's comparison runs (outputs, queues, request
states, block ids, free queue, KV events); liveness is drained at teardown as in the main machine.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from kvref.impl.reference.scheduler_lora import exceeds_max_loras, running_loras
from kvref.impl.request import LoRARequest, Request
from kvref.models.machines.counted_lockstep import run_counted
from kvref.models.machines.scheduler import (
    COVERAGE,
    MAX_REQUESTS,
    Lockstep,
    RequestSpec,
    SchedulerMachine,
    SchedulerRun,
    request_specs,
    run_lockstep_machine,
    scheduler_setups,
)

#: the adapters arrivals draw from (int id -> name)
ADAPTERS = {1: "sql", 2: "chat", 3: "code"}


@dataclass(frozen=True)
class LoraRequestSpec(RequestSpec):
    """A :class:`RequestSpec` with a LoRA adapter id (0: none)."""

    lora_int_id: int = 0

    def make(self) -> Request:
        lora = None if not self.lora_int_id else LoRARequest(ADAPTERS[self.lora_int_id], self.lora_int_id,
                                                             f"/adapters/{ADAPTERS[self.lora_int_id]}")
        return Request(self.request_id, list(self.prompt), max_tokens=self.max_tokens, priority=self.priority,
                       arrival_time=self.arrival_time, stop_token_ids=self.stop_token_ids, lora_request=lora)


@st.composite
def lora_setups(draw):
    """``(pool, config, max_loras)``: the main machine's startup-consistent setups (no speculative
    decoding) with two to four requests at once."""
    pool, cfg = draw(scheduler_setups(consistent=True, spec=False))
    cfg = replace(cfg, max_num_seqs=max(cfg.max_num_seqs, draw(st.integers(2, 4))))
    return pool, cfg, draw(st.sampled_from((1, 1, 2)))


class LoraLockstep(Lockstep):
    """:class:`Lockstep` that tallies the waiting requests the adapter limit holds back, and the
    admissions past them."""

    def schedule(self):
        ref = self.targets.get("ref")
        held = []
        if ref is not None and ref.max_loras is not None:
            loras = running_loras(ref.running)
            for r in ref.waiting:
                if exceeds_max_loras(r, loras, ref.max_loras):
                    held.append(r.request_id)
                elif r.lora_request is not None:
                    loras.add(r.lora_request.lora_int_id)
        out = super().schedule()
        if held:
            COVERAGE["lora_held_waiting"] += len(held)
            admitted = {s.request_id for s in out.scheduled if s.kind != "running"}
            order = [r for r in self.specs]
            COVERAGE["lora_admitted_past_held"] += sum(
                1 for a in admitted if any(order.index(h) < order.index(a) for h in held))
        return out


class LoraMachine(SchedulerMachine):
    """The scheduler machine with LoRA arrivals under ``max_loras``."""

    driver_class: type = LoraLockstep
    #: max_loras -> ``name -> (pool, config) -> target``
    factories_for: Callable = None

    @initialize(setup=lora_setups())
    def init(self, setup):
        pool, config, max_loras = setup
        self.driver = self.driver_class(pool, config, type(self).factories_for(max_loras))
        self.num_added = 0

    @precondition(lambda self: self.num_added < MAX_REQUESTS)
    @rule(data=st.data())
    def add_request(self, data):
        spec = data.draw(request_specs(self.num_added, self.driver.pool.max_model_len))
        spec = LoraRequestSpec(**spec.__dict__, lora_int_id=data.draw(st.sampled_from((0, 1, 1, 2, 2, 3))))
        self.num_added += 1
        COVERAGE["lora_arrivals"] += bool(spec.lora_int_id)
        self.driver.add(spec)


def run_lora_machine(examples: int, reproducible: bool = False, shrink: bool = True,
                     seed: int | None = None) -> SchedulerRun:
    """The reference scheduler in lock step with vLLM 0.33.0's on :class:`LoraMachine` traces (at
    least 30 operations each; liveness drained at teardown)."""
    from kvref.impl.reference.scheduler import Scheduler
    from kvref.impl.vllm.scheduler import VllmEnv, VllmScheduler

    env = VllmEnv()

    def factories_for(max_loras: int) -> dict[str, Callable]:
        return {"vllm": lambda p, c: VllmScheduler(p, c, env, max_loras=max_loras),
                "ref": lambda p, c: Scheduler(p, c, max_loras=max_loras)}

    def machine_for(counting: type):
        return type("LoraRun", (LoraMachine,), {"driver_class": counting,
                                                "factories_for": staticmethod(factories_for)})

    return SchedulerRun(**run_counted(
        machine_for, LoraLockstep,
        lambda machine: run_lockstep_machine(machine, max(1, examples), steps=45, min_steps=31, seed=seed,
                                             reproducible=reproducible, shrink=shrink), COVERAGE))
