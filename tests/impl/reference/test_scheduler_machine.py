"""The reference scheduler alone under the trace machine: invariants after every operation and
liveness at teardown (no vLLM needed). Also: the machine notices a broken scheduler."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

from kvref.impl.reference.scheduler import Scheduler
from kvref.impl.reference.scheduler_liveness import startup_consistent
from kvref.models.machines.scheduler import Lockstep, RequestSpec, machine_with, request_specs, scheduler_setups
from tests.conftest import profile_examples


def test_reference_machine_invariants_and_liveness():
    machine = machine_with({"ref": lambda p, c: Scheduler(p, c)}, name="ReferenceSchedulerMachine")
    run_state_machine_as_test(machine, _min_steps=31,
                              settings=settings(max_examples=profile_examples(30, 150), stateful_step_count=45))


@settings(max_examples=profile_examples(20, 100))
@given(setup=scheduler_setups(consistent=False), data=st.data())
def test_a_request_over_the_pool_blocks_the_queue_forever(setup, data):
    """Head-of-line (vLLM #39734): with the full-sequence gate on and a pool that cannot hold the
    head request's prompt, nothing behind it is ever admitted."""
    pool, cfg = setup
    assume(cfg.scheduler_reserve_full_isl and cfg.enable_chunked_prefill)
    d = Lockstep(pool, cfg, {"ref": lambda p, c: Scheduler(p, c)})
    head = RequestSpec("r0", tuple(range(pool.max_model_len - 1)), 1, 0, 0.0)
    d.add(head)
    s = d.targets["ref"]
    # this inconsistent pool may still hold this prompt (only max_model_len tokens would not)
    fits = s.kv_cache_manager.allocate_slots(d.requests["ref"]["r0"], 1, full_sequence_must_fit=True,
                                             has_scheduled_reqs=False)
    s.kv_cache_manager.free(d.requests["ref"]["r0"])
    assume(fits is None)
    for i in range(1, 4):
        d.add(data.draw(request_specs(i, pool.max_model_len)))
    for _ in range(30):
        d.engine_step()
    snap = d.snapshots()["ref"]
    assert snap.waiting[0] == "r0" and snap.running == () and len(snap.waiting) == 4
    assert not startup_consistent(pool, cfg)


def test_the_liveness_check_fires_on_the_head_of_line_hang():
    """The drain check is not vacuous: on the #39734 setup (startup-inconsistent) it reports the
    hang, naming the stuck queues."""
    from kvref.impl.interface import PoolConfig
    from kvref.impl.scheduler_types import SchedulerConfig
    from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    cfg = SchedulerConfig(max_num_batched_tokens=16)
    fa = KVCacheGroupSpec(("full",), FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16"))
    pool = PoolConfig(num_blocks=8, groups=(fa,), max_model_len=64, scheduler_block_size=4, hash_block_size=4,
                      max_in_flight_tokens=cfg.max_in_flight_tokens)
    d = Lockstep(pool, cfg, {"ref": lambda p, c: Scheduler(p, c)})
    d.add(RequestSpec("big", tuple(range(40)), 2, 0, 0.0))
    d.add(RequestSpec("small", (1,), 2, 0, 1.0))
    with pytest.raises(AssertionError, match=r"liveness: .*waiting=\('big', 'small'\) running=\(\)"):
        d.drain()


def test_runner_outside_pytest_reports_traces_and_failures(monkeypatch):
    """``run_scheduler_machine`` (for ``kvref verify``): counts traces of >= 30 ops, and turns a
    broken scheduler into ok=False with the reason."""
    from kvref.models.machines.scheduler import run_scheduler_machine

    run = run_scheduler_machine(with_vllm=False, examples=5, reproducible=True)
    assert run.ok and run.traces >= 5 and run.ops >= 150 and "generated traces" in run.summary

    def broken(self):
        raise AssertionError("planted")

    monkeypatch.setattr(Scheduler, "check_invariants", broken)
    bad = run_scheduler_machine(with_vllm=False, examples=5, reproducible=True, shrink=False)
    assert not bad.ok and "planted" in bad.failure


def test_the_machine_sees_a_prompt_cut_without_chunked_prefill():
    """The policy check is not vacuous: with chunked prefill off a second prompt that does not fit
    beside the first waits whole on the reference, and the mutant that cuts it is reported."""
    from kvref.impl.interface import PoolConfig
    from kvref.impl.scheduler_types import SchedulerConfig
    from kvref.models.mutants.catalogue import CATALOGUE
    from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    cfg = SchedulerConfig(max_num_batched_tokens=16, enable_chunked_prefill=False)
    fa = KVCacheGroupSpec(("full",), FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16"))
    pool = PoolConfig(num_blocks=20, groups=(fa,), max_model_len=16, scheduler_block_size=4, hash_block_size=4,
                      max_in_flight_tokens=cfg.max_in_flight_tokens)

    def run() -> tuple:
        d = Lockstep(pool, cfg, {"ref": lambda p, c: Scheduler(p, c)})
        d.add(RequestSpec("a", tuple(range(10)), 2, 0, 0.0))
        d.add(RequestSpec("b", tuple(range(100, 110)), 2, 0, 1.0))
        return tuple((s.request_id, s.num_scheduled_tokens) for s in d.schedule().scheduled)

    assert run() == (("a", 10),)  # b waits whole: 10 tokens do not fit the 6 left
    with CATALOGUE["sched.chunks_without_chunked_prefill"].applied():
        with pytest.raises(AssertionError, match="chunked prefill is off, but b left the waiting queue"):
            run()
