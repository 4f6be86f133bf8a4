"""Mutants of the scheduler policy: who is preempted, where they go, what the budget admits.

Registered into :data:`kvref.models.mutants.registry.CATALOGUE` with ``layer="scheduler"``. Each
one is a one-line change to :mod:`kvref.impl.reference.scheduler` (through
:func:`~kvref.models.mutants.mutant.edit_source`, so the fault sits in the real method) or to the waiting
queue, and each changes what vLLM 0.33.0's ``Scheduler`` would do on some trace — most without
breaking any safety invariant, so only the lock-step comparison with vLLM (the campaign's
``scheduler-vllm`` check) sees them. ``docs/mutants.md`` lists which check kills each.

Not here because it is equivalent: dropping the skip of a waiting request whose stale async output
is still in flight. With two batches in flight (no pipeline parallelism) the output of the step
before a preemption is always settled before the next schedule, so the skip never fires.
"""

from __future__ import annotations

from kvref.models.mutants.mutant import edit_source
from kvref.models.mutants.registry import mutant

_R = "kvref.impl.reference"
_SCHED = f"{_R}.scheduler:Scheduler"
_QUEUE = f"{_R}.scheduler_queue:WaitingQueue"


def _edit(old: str, new: str):
    """``make`` for a mutant that replaces one snippet of the target method's source."""
    return lambda original: edit_source(original, old, new)


def _register(name: str, target: str, description: str, old: str, new: str) -> None:
    mutant(name, target, description, layer="scheduler")(_edit(old, new))


# ---- preemption: the victim and where it goes ---------------------------------------------------

_register(
    "sched.fcfs_victim_oldest", f"{_SCHED}.schedule",
    "FCFS preemption evicts the oldest running request (running[0]) instead of the newest: the "
    "request that has made the most progress is recomputed",
    "victim = self.running.pop()", "victim = self.running.pop(0)")

_register(
    "sched.priority_victim_no_arrival_tiebreak", f"{_SCHED}.schedule",
    "PRIORITY preemption compares priorities only: among equal priorities the first running "
    "request is evicted instead of the latest arrival",
    "key=lambda r: (r.priority, r.arrival_time))", "key=lambda r: r.priority)")


_register(
    "sched.priority_victim_smallest_key", f"{_SCHED}.schedule",
    "PRIORITY preemption evicts the most important running request (min instead of max key)",
    "victim = max(self.running,", "victim = min(self.running,")


@mutant("sched.preempted_to_back", f"{_QUEUE}.prepend_request",
        "FCFS: a preempted request is appended to the back of the waiting queue instead of going "
        "back to its head (later arrivals overtake it)", layer="scheduler")
def _preempted_to_back(original):
    def prepend_request(self, request):
        if self.policy == "priority":
            original(self, request)
        else:
            self._fcfs.append(request)
    return prepend_request


_register(
    "sched.preempt_keeps_computed", f"{_SCHED}._preempt_request",
    "recompute preemption frees the blocks but does not reset num_computed_tokens",
    "request.num_computed_tokens = 0\n", "pass\n")

_register(
    "sched.admits_after_preemption", f"{_SCHED}.schedule",
    "waiting requests are admitted in a step that preempted (vLLM skips the waiting loop then, "
    "so a freed block is not handed straight to a newcomer)",
    "if not preempted and self.pause_state", "if self.pause_state")


# ---- the token budget and the admission gates ---------------------------------------------------

_register(
    "sched.no_head_of_line", f"{_SCHED}._schedule_waiting",
    "a waiting request that does not fit is skipped and the ones behind it are tried (vLLM stops "
    "the waiting loop at the first that does not fit: head-of-line blocking)",
    "break  # head-of-line: the requests behind it are not tried this step",
    "skipped.append(self.waiting.pop_request()); continue")


_register(
    "sched.budget_off_by_one", f"{_SCHED}.schedule",
    "the step's token budget is one short (the smaller of max_num_scheduled_tokens and max_num_batched_tokens, less 1)",
    "token_budget = cfg.step_token_budget\n", "token_budget = cfg.step_token_budget - 1\n")

_register(
    "sched.running_not_charged", f"{_SCHED}.schedule",
    "tokens scheduled for running requests are not taken off the budget (the waiting loop sees "
    "the whole budget)",
    "token_budget -= num_new\n        req_index += 1", "pass\n        req_index += 1")

_register(
    "sched.max_num_seqs_off_by_one", f"{_SCHED}._schedule_waiting",
    "admission stops at max_num_seqs (or max_num_active_seqs) + 1 running requests",
    "len(self.running) < cfg.max_num_active_reqs", "len(self.running) <= cfg.max_num_active_reqs")

_register(
    "sched.chunks_without_chunked_prefill", f"{_SCHED}._schedule_waiting",
    "with chunked prefill off, a prompt that does not fit the remaining budget is cut into a "
    "chunk instead of stopping the waiting loop",
    "if not cfg.enable_chunked_prefill and num_new > token_budget:",
    "if False and num_new > token_budget:")

_register(
    "sched.full_isl_gate_not_passed", f"{_SCHED}._schedule_waiting",
    "the scheduler never asks for the full-sequence admission gate (scheduler_reserve_full_isl "
    "ignored): a request is admitted whose whole sequence may not fit",
    "full_sequence_must_fit=cfg.scheduler_reserve_full_isl", "full_sequence_must_fit=False")

_register(
    "sched.long_prefill_when_alone", f"{_SCHED}.schedule",
    "long_prefill_token_threshold also cuts the prefill of a request that is alone (nobody to "
    "protect; vLLM lets it use the whole budget)",
    "cfg.long_prefill_token_threshold if num_eligible > 1 else 0", "cfg.long_prefill_token_threshold")


# ---- async scheduling: placeholders and in-flight tokens ----------------------------------------

_register(
    "sched.no_max_model_len_clamp", f"{_SCHED}.schedule",
    "a running request's tokens are not clamped to max_model_len - 1 - num_computed_tokens (no "
    "room kept for the sampled token)",
    "request.num_computed_tokens - NUM_SAMPLED_TOKENS_PER_STEP)", "request.num_computed_tokens)")


_register(
    "sched.async_max_tokens_skip_off_by_one", f"{_SCHED}.schedule",
    "async: a request whose in-flight step already reaches max_tokens is skipped one step late "
    "(an extra decode step is scheduled)",
    "+ request.max_tokens):", "+ request.max_tokens + 1):")


_register(
    "sched.placeholders_ignored", f"{_SCHED}.schedule",
    "async: a running request's output placeholders are not counted as tokens to compute, so it "
    "is not scheduled again until its in-flight output arrives (the pipeline stalls)",
    "num_new = (request.num_tokens + spec.num_spec(request) + request.num_output_placeholders",
    "num_new = (request.num_tokens + spec.num_spec(request)")

_register(
    "sched.in_flight_not_settled", f"{_SCHED}.update_from_output",
    "a settled step's tokens are not taken off num_in_flight_tokens (the sliding-window frees "
    "then lag further and further behind)",
    "request.num_in_flight_tokens -= s.num_scheduled_tokens", "pass")


# ---- finishing ----------------------------------------------------------------------------------

_register(
    "sched.finished_stay_running", f"{_SCHED}.update_from_output",
    "requests that stopped are freed but not removed from the running list",
    "self.running = [r for r in self.running if id(r) not in gone]", "pass")
