"""Structured output in vLLM 0.33.0's scheduler in lock step with the reference's
(models/machines/scheduler_structured_output.py, issues #22/#28): the runs agree and reach every
grammar outcome (waits, compile errors, drafts cut, sampled tokens rejected); a planted fault in a
copy of the reference's behaviour (admitting a request whose grammar still compiles, keeping the
drafts the grammar refuses, ignoring a rejection) or in vLLM's own code makes them diverge."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvref.impl.reference.scheduler_structured_output import StructuredOutputState
from kvref.models.machines.scheduler_structured_output import run_structured_output_machine

#: six traces of this seed reach every outcome (about 1 s a run once vLLM is loaded)
SEED = 0
EXAMPLES = 6


def test_lock_step_agrees_and_reaches_every_grammar_outcome():
    run = run_structured_output_machine(EXAMPLES, seed=SEED, shrink=False)
    assert run.ok, run.failure
    c = run.coverage
    assert c["so_admitted_after_grammar"] > 0 and c["so_admitted_past_pending_grammar"] > 0
    assert c["so_failed_grammar_finished"] > 0 and c["so_rejected_sampled"] > 0 and c["so_draft_limits"] > 0


def test_planted_fault_admits_pending_grammar_diverges(monkeypatch):
    """A reference that schedules a request whose grammar still compiles (vLLM skips it)."""
    def ready(self, request):
        self.waiting_for_grammar.discard(request.request_id)
        return True

    monkeypatch.setattr(StructuredOutputState, "ready_to_schedule", ready)
    run = run_structured_output_machine(EXAMPLES, seed=SEED, shrink=False)
    assert not run.ok and run.signature is not None


def test_planted_fault_keeps_refused_drafts_diverges(monkeypatch):
    """A reference that keeps the drafts the grammar refuses (more lookahead slots, other stats)."""
    monkeypatch.setattr(StructuredOutputState, "validate", lambda self, request, drafts: list(drafts))
    run = run_structured_output_machine(EXAMPLES, seed=SEED, shrink=False)
    assert not run.ok and run.signature is not None


def test_planted_fault_not_deferred_at_arrival_diverges(monkeypatch):
    """A reference that counts a request waiting for its grammar as deferred only once the waiting
    loop skipped it (vLLM defers it at arrival): the metrics' skipped and waiting counts differ."""
    from kvref.impl.reference.scheduler import Scheduler

    add = Scheduler.add_request

    def add_request(self, request):
        add(self, request)
        self.cadence.skipped_ids.discard(request.request_id)

    monkeypatch.setattr(Scheduler, "add_request", add_request)
    run = run_structured_output_machine(EXAMPLES, seed=SEED, shrink=False)
    assert not run.ok and "make_stats" in (run.signature or ""), run.failure


def test_planted_vllm_fault_ignores_rejected_tokens_diverges(monkeypatch):
    """vLLM itself ignoring the grammar's rejection (the request runs on, its blocks kept)."""
    from kvref.impl.vllm.structured_output import ScriptedStructuredOutputManager

    monkeypatch.setattr(ScriptedStructuredOutputManager, "accept_tokens", lambda self, request, ids: True)
    run = run_structured_output_machine(EXAMPLES, seed=SEED, shrink=False)
    assert not run.ok and run.signature is not None



@pytest.mark.parametrize("fault_id", ("sched.grammar_pending_scheduled", "sched.grammar_error_not_recorded",
                                      "sched.grammar_rejection_ignored"))
def test_planted_vllm_source_fault_is_a_divergence(fault_id):
    """The catalogue's structured-output faults in vLLM's own scheduler source (kvref's mutant
    campaign plants them the same way)."""
    from tests.vllm_faults import planted_vllm_fault

    with planted_vllm_fault(fault_id, ("v1/core/sched/scheduler.py",)):
        run = run_structured_output_machine(EXAMPLES, seed=SEED, shrink=False)
    assert not run.ok and ("Divergence" in run.failure or "scheduler.py" in run.failure), run.failure
