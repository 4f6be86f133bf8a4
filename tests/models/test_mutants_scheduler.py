"""Scheduler-policy mutants (kvref.models.mutants.catalogue_scheduler) and the campaign's scheduler
checks: ``scheduler-machine`` (reference alone) and ``scheduler-vllm`` (lock step with vLLM)."""

from __future__ import annotations

import pytest

from kvref import checks as registry
from kvref.check_context import CAMPAIGN, VerifyContext
from kvref.checks import MUTANT_CAMPAIGN, available_checks, check_named, run_mutant_campaign
from kvref.impl.reference.scheduler import Scheduler
from kvref.impl.reference.scheduler_queue import WaitingQueue
from kvref.models.mutants.catalogue import CATALOGUE, CI_SUBSET, all_mutants
from kvref.models.mutants.mutant import edit_source
from kvref.spec.errors import InvalidFieldError
from tests.vllm_env import require_vllm

SCHEDULER_MUTANTS = [m for m in all_mutants() if m.layer == "scheduler"]


def test_at_least_six_scheduler_mutants_apply_and_restore():
    assert len(SCHEDULER_MUTANTS) >= 6
    assert {m.name for m in SCHEDULER_MUTANTS} & set(CI_SUBSET)
    for m in SCHEDULER_MUTANTS:
        owner, attr = m.resolve()
        assert owner in (Scheduler, WaitingQueue), m.name
        original = vars(owner)[attr]
        with m.applied():  # building the mutant fails loudly if its snippet left the source
            assert vars(owner)[attr] is not original, m.name
        assert vars(owner)[attr] is original, m.name


def test_edit_source_changes_one_snippet_and_keeps_line_numbers():
    original = Scheduler._schedule_waiting
    faulty = edit_source(original, "len(self.running) < cfg.max_num_active_reqs",
                         "len(self.running) <= cfg.max_num_active_reqs")
    assert faulty is not original and faulty.__qualname__ == original.__qualname__
    assert faulty.__code__.co_firstlineno == original.__code__.co_firstlineno
    assert faulty.__code__.co_filename == original.__code__.co_filename
    assert faulty.__code__.co_code != original.__code__.co_code


@pytest.mark.parametrize("old, new, field", [
    ("no such snippet", "x", "old"),               # not in the source
    ("token_budget", "x", "old"),                  # more than once
    ("if not preempted:", "if True:\n    pass", "new"),  # a line added: line numbers would shift
    ("", "x", "old"),
])
def test_edit_source_rejects_bad_snippets(old, new, field):
    with pytest.raises(InvalidFieldError) as e:
        edit_source(Scheduler.schedule, old, new)
    assert e.value.field == field


def test_edit_source_rejects_non_functions():
    with pytest.raises(InvalidFieldError, match="func"):
        edit_source(len, "a", "b")

    def outer():
        x = 1
        return lambda: x

    with pytest.raises(InvalidFieldError, match="closure"):
        edit_source(outer(), "x", "y")


def test_a_mutant_changes_behaviour_and_the_clean_method_comes_back():
    from kvref.impl.interface import PoolConfig
    from kvref.impl.scheduler_types import SchedulerConfig
    from kvref.impl.request import Request
    from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    def first_step_tokens():
        cfg = SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=2)
        fa = KVCacheGroupSpec(("full",), FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8,
                                                           dtype="float16"))
        pool = PoolConfig(num_blocks=20, groups=(fa,), max_model_len=32, scheduler_block_size=4,
                          hash_block_size=4, max_in_flight_tokens=cfg.max_in_flight_tokens)
        s = Scheduler(pool, cfg)
        s.add_request(Request("a", list(range(20)), max_tokens=2))
        return s.schedule().total_num_scheduled_tokens

    assert first_step_tokens() == 8
    with CATALOGUE["sched.budget_off_by_one"].applied():
        assert first_step_tokens() == 7
    assert first_step_tokens() == 8


def test_scheduler_machine_kills_invariant_and_liveness_faults():
    """Reference alone (no vLLM): a broken max_num_seqs bound trips the scheduler's invariants.

    The victim choice without the arrival-time tie-break (which livelocks the liveness drain) needs
    equal priorities on a tight PRIORITY pool; the campaign's default machine reaches it too rarely
    since the storm generators changed its draws (the full campaign still kills it, by another
    check), so the directed machine below shows the liveness drain catching it."""
    ms = [CATALOGUE["sched.max_num_seqs_off_by_one"]]
    res = run_mutant_campaign(ms, checks=["spec-formulas", "pool-machine", "scheduler-machine"], budget=50,
                              all_checks=True)
    assert not res.baseline_failures
    by = {r.mutant.name: r for r in res.results}
    assert by["sched.max_num_seqs_off_by_one"].killed_by == "scheduler-machine"
    assert "max_num_seqs" in by["sched.max_num_seqs_off_by_one"].reason
    # the pool and spec checks never run scheduler code: they are not run on scheduler mutants
    assert all(set(r.per_check) == {"scheduler-machine"} for r in res.results)


def test_vllm_checks_are_skipped_gracefully_without_vllm(monkeypatch):
    monkeypatch.setattr(registry, "_vllm_missing", lambda: "vLLM not usable: (simulated)")
    checks = available_checks()
    assert "manager-vllm" not in checks and "scheduler-vllm" not in checks
    assert "scheduler-machine" in checks
    m = CATALOGUE["sched.budget_off_by_one"]
    res = run_mutant_campaign([m], checks=["scheduler-vllm", "spec-formulas"], budget=5)
    assert not res.baseline_failures
    assert res.checks == ["spec-formulas"] and "scheduler-vllm" in res.skipped_checks
    assert "skipped: scheduler-vllm" in res.summary()
    assert not res.results[0].killed  # nothing that can see the scheduler ran


def test_bad_check_lists_are_rejected():
    with pytest.raises(InvalidFieldError, match="checks"):
        run_mutant_campaign([], checks="scheduler-vllm")
    with pytest.raises(InvalidFieldError, match="checks"):
        run_mutant_campaign([], checks=["scheduler-vllm", 3])
    with pytest.raises(InvalidFieldError, match="names"):
        registry.unavailable_checks(["scheduler-vlm"])


def test_scheduler_checks_are_ordered_cheap_first():
    names = list(MUTANT_CAMPAIGN)
    assert names.index("scheduler-machine") < names.index("manager-machine") < names.index("scheduler-vllm")
    assert names.index("manager-vllm") < names.index("scheduler-vllm") < names.index("proofs")


@pytest.mark.vllm
def test_scheduler_vllm_kills_every_scheduler_mutant_and_passes_the_clean_reference():
    """Every scheduler-policy fault diverges from vLLM 0.33.0 on a generated trace (so none is an
    equivalent mutant), and the clean reference does not (the campaign's baseline)."""
    require_vllm()
    clean = check_named("scheduler-vllm").run(VerifyContext(profile=CAMPAIGN, budget=100, shrink=False))
    assert not clean.failing, clean.summary  # the clean reference agrees with vLLM
    # 150 traces: sched.chunks_without_chunked_prefill needs chunked prefill off *and* a prompt
    # longer than the remaining budget, which the machine's whole_prompts_compete rule aims at (one-
    # at-a-time arrivals reached it after the 100th trace, and not at all once the draws moved);
    # the same traces in every process: kvref.models.hypothesis_runs.reproducible
    res = run_mutant_campaign(SCHEDULER_MUTANTS, checks=["scheduler-vllm"], budget=150)
    assert not res.baseline_failures and res.checks == ["scheduler-vllm"]
    survivors = [r.mutant.name for r in res.survivors]
    assert not survivors, f"not killed by scheduler-vllm: {survivors}"
    assert all(r.killed_by == "scheduler-vllm" and r.reason for r in res.results)
    # most are invisible to every invariant: the comparison itself kills them
    divergences = [r for r in res.results if r.reason.startswith("Divergence")]
    assert len(divergences) >= len(res.results) // 2, [r.reason for r in res.results]



def test_reproducible_runs_ignore_the_modules_a_process_has_loaded():
    """Hypothesis mixes constants from loaded local modules into its draws; a derandomized run
    must not depend on them (a kill in a fresh process was a miss inside the full suite)."""
    from hypothesis.internal.conjecture import providers

    from kvref.models.hypothesis_runs.reproducible import same_inputs_in_every_process
    from kvref.models.machines.scheduler import run_scheduler_machine

    first = run_scheduler_machine(with_vllm=False, examples=15, reproducible=True, shrink=False)
    loaded = providers._get_local_constants()
    before = len(loaded)
    extra = [n for n in range(-5, 300) if n not in loaded.integers]  # as if more modules were loaded
    loaded.integers.update(extra)
    providers.CONSTANTS_CACHE.cache.clear()
    try:
        second = run_scheduler_machine(with_vllm=False, examples=15, reproducible=True, shrink=False)
    finally:
        for n in extra:
            loaded.integers.discard(n)
        providers.CONSTANTS_CACHE.cache.clear()
    assert len(loaded) == before
    assert (first.traces, first.ops, first.coverage) == (second.traces, second.ops, second.coverage)
    with same_inputs_in_every_process() as applied:
        assert applied and len(providers._get_local_constants()) == 0
    assert providers._get_local_constants() is loaded


def test_liveness_drain_catches_the_priority_victim_without_arrival_tiebreak(monkeypatch):
    """Equal priorities on tight PRIORITY pools: among equal priorities vLLM evicts the latest
    arrival; evicting the first running request instead makes two requests preempt each other
    for ever, which only the liveness drain (not any per-step invariant) can see."""
    from dataclasses import replace

    from hypothesis import HealthCheck, Phase, settings
    from hypothesis.stateful import run_state_machine_as_test

    from kvref.impl.reference.scheduler import Scheduler
    from kvref.impl.scheduler_types import PRIORITY
    from kvref.models.machines import scheduler as sm

    specs = sm.request_specs
    monkeypatch.setattr(sm, "request_specs", lambda i, m, **kw: specs(i, m, **kw).map(lambda s: replace(s, priority=0)))
    machine = sm.machine_with({"ref": lambda p, c: Scheduler(p, c)},
                              setups=sm.scheduler_setups(policy=PRIORITY, tight=True, consistent=True))
    s = settings(max_examples=200, stateful_step_count=45, deadline=None, database=None, derandomize=True,
                 suppress_health_check=list(HealthCheck), phases=[Phase.generate])
    from kvref.models.hypothesis_runs.reproducible import same_inputs_in_every_process

    # derandomized *and* independent of which modules the test process has loaded (Hypothesis mixes
    # their constants into its draws: inside the full suite the traces would differ)
    with same_inputs_in_every_process():
        run_state_machine_as_test(machine, _min_steps=31, settings=s)  # the reference: live
        with CATALOGUE["sched.priority_victim_no_arrival_tiebreak"].applied():
            with pytest.raises(AssertionError, match="liveness"):
                run_state_machine_as_test(machine, _min_steps=31, settings=s)
