"""How much prefill a step may carry: vLLM 0.33.0's local prefill cadence and adaptive long-prefill
threshold (``Scheduler.schedule``).

Both decide which requests run in a step and how many tokens each gets, so which KV blocks are
allocated when:

- ``long_prefill_token_threshold_adaptive``: a nonzero ``long_prefill_token_threshold`` is floored
  at a fair share of the step's input budget, ``max_num_batched_tokens // (running + waiting)``,
  so the cap never cuts a request below that share (it exists to stop one long prefill starving
  the others; with few requests there is little to starve).
- ``prefill_schedule_interval`` (N > 1, an engine without data parallelism): while at least one
  running request decodes, a step within N executed steps of the last prefill-carrying step
  *defers prefill*: running prefill chunks are skipped (the loop goes on to the decodes) and the
  waiting loop stops at the first request with more than one token left to compute after its
  prefix hit. A step carries prefill when it scheduled a running chunk or admitted a request
  with more than one token left (the same predicate as the gate: vLLM fixed a stamp on
  ``< num_prompt_tokens`` that let every full prefix hit restart the interval). Only steps that
  scheduled tokens count as executed. Capacity escape (vLLM #44558): a step that did not defer
  records whether requests it could have admitted were left waiting
  (``waiting > skipped ones``); while so, nothing is deferred, else a backed-up engine would cap
  prefill at about one budget per interval and grow its queue without bound.
"""

from __future__ import annotations

from typing import Iterable

from kvref.impl.request import Request
from kvref.impl.scheduler_types import SchedulerConfig


def adaptive_long_prefill_threshold(config: SchedulerConfig, threshold: int, num_eligible_reqs: int) -> int:
    """The step's long-prefill ``threshold`` (0 with one eligible request: "when it is the only
    request there is nobody to starve"), floored at the fair share when adaptive."""
    if threshold > 0 and config.long_prefill_token_threshold_adaptive:
        threshold = max(threshold, config.max_num_batched_tokens // num_eligible_reqs)
    return threshold


class PrefillCadence:
    """vLLM's ``local_prefill_interval``, ``last_prefill_step``, ``num_executed_steps`` and
    ``prefill_capacity_bound``, and the requests its waiting loop skipped (``deferred_waiting``)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.interval = config.prefill_schedule_interval
        self.last_prefill_step = -self.interval  # a full interval back: the first step is never gated
        self.num_executed_steps = 0  # steps that scheduled tokens (empty schedule() calls do not count)
        self.capacity_bound = False
        self.skipped_ids: set[str] = set()  # vLLM ``deferred_waiting`` (ids; counted while still waiting)

    def defer_prefills(self, running: Iterable[Request]) -> bool:
        """Whether this step holds prefill: within the interval while some running request decodes."""
        return (self.interval > 1 and not self.capacity_bound
                and (self.num_executed_steps + 1) - self.last_prefill_step < self.interval
                and any(not r.is_prefill_chunk for r in running))

    def note_skipped(self, request: Request) -> None:
        self.skipped_ids.add(request.request_id)

    def note_admitted(self, request: Request) -> None:
        self.skipped_ids.discard(request.request_id)

    def after_waiting_loop(self, deferred: bool, waiting: Iterable[Request]) -> None:
        """A step that did not defer records whether it left admissible requests waiting."""
        waiting_ids = {r.request_id for r in waiting}
        self.skipped_ids &= waiting_ids  # finished (aborted) ones left the set with the queue
        if not deferred:
            self.capacity_bound = len(waiting_ids) > len(self.skipped_ids)

    def after_schedule(self, num_scheduled_tokens: int, carried_prefill: bool) -> None:
        """Count an executed step, then restart the interval from a prefill-carrying one."""
        if num_scheduled_tokens > 0:
            self.num_executed_steps += 1
        if self.interval > 1 and carried_prefill:
            self.last_prefill_step = self.num_executed_steps

    def check_invariants(self) -> None:
        assert self.interval >= 1, f"Q10: prefill_schedule_interval {self.interval}"
        assert self.num_executed_steps >= 0, f"Q10: executed steps {self.num_executed_steps}"
        assert -self.interval <= self.last_prefill_step <= self.num_executed_steps, \
            f"Q10: last prefill step {self.last_prefill_step} outside [-{self.interval}, {self.num_executed_steps}]"
