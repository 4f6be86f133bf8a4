"""SimpleCPUOffloadScheduler reference: state machine, historic variants, PR 42903, bad input."""

from __future__ import annotations

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from kvref.impl.reference.offload.keys import OffloadStateError
from kvref.impl.reference.offload.simple_cpu_offload_scheduler import (
    SimpleCPUOffloadScheduler,
    SimpleOffloadStep,
)
from kvref.models.offload.simple_cpu_world import (
    OffloadInvariantError,
    SimpleOffloadConfig,
    SimpleOffloadWorld,
    make_simple_offload_machine,
)
from kvref.spec.errors import InvalidFieldError, KVRefError
from kvref.models.offload.traces import FA_ONLY, PR42903, pre_fix_41289_trace, run_pr42903
from kvref.models.mutants.catalogue import CATALOGUE
from tests.conftest import profile_examples

FA_ONLY_2W = SimpleOffloadConfig(block_size=4, num_gpu_blocks=12, num_cpu_blocks=24, world_size=2)
HYBRID = SimpleOffloadConfig(block_size=4, num_gpu_blocks=12, num_cpu_blocks=8, sliding_window=4)
#: vLLM before #41289, patched in at runtime (the reference itself stays 0.33.0)
PRE_41289 = CATALOGUE["offload.in_flight_not_deduped"]
LAZY = SimpleOffloadConfig(block_size=4, num_gpu_blocks=12, num_cpu_blocks=24, lazy=True, max_num_batched_tokens=8)


def _run(cfg, variant="reference", n=None, shrink=True, derandomize=False):
    machine = make_simple_offload_machine(cfg, "reference", variant)
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if shrink else [])
    # a run that must find a rare trace draws the same examples every time (the ci profile is random)
    fixed = dict(derandomize=True, database=None) if derandomize else {}
    run_state_machine_as_test(machine, settings=settings(max_examples=n or profile_examples(25, 150),
                                                         stateful_step_count=25, deadline=None, phases=phases,
                                                         report_multiple_bugs=False, **fixed))


@pytest.mark.parametrize("cfg", [FA_ONLY, FA_ONLY_2W, LAZY], ids=["eager", "eager-2-workers", "lazy"])
def test_state_machine_holds_on_the_reference(cfg):
    _run(cfg)


def test_state_machine_holds_on_hybrid_with_the_pr42903_fix():
    _run(HYBRID, "fix_42903")


def test_state_machine_finds_the_pre_41289_duplicate_store():
    """Before vLLM #41289 only the current step's selections were deduplicated: a request that
    hits the GPU prefix cache while the first request's store is still in flight stores the same
    GPU blocks again. The machine must find that on the variant."""
    with PRE_41289.applied(), pytest.raises(OffloadInvariantError, match="two in-flight stores"):
        _run(FA_ONLY, n=profile_examples(200, 300), shrink=False, derandomize=True)


def test_pre_41289_duplicate_directed():
    pre_fix_41289_trace(SimpleOffloadWorld(FA_ONLY, "reference"))  # 0.33.0: skipped as IN_FLIGHT
    with PRE_41289.applied(), pytest.raises(OffloadInvariantError, match="two in-flight stores"):
        pre_fix_41289_trace(SimpleOffloadWorld(FA_ONLY, "reference"))


def test_pr42903_same_block_stored_twice_within_one_scan():
    w = run_pr42903(SimpleOffloadWorld(PR42903, "reference", check_no_double_store=False))
    assert w.metas[2][3:6] == (1, [7, 5, 6, 5], [1, 2, 3, 4])
    assert w.duplicate_stores == [(1, 5)]
    # Nothing leaks: both store refs are dropped at completion, both CPU copies hold block 5's content.
    w.complete_store(0)
    assert w.b.gpu_pool.blocks[5].ref_cnt == 0 and not w.stores
    assert w.cpu_content[2] == w.cpu_content[4]
    w.b.check_invariants()


def test_pr42903_fix_variant_stores_each_block_once():
    w = run_pr42903(SimpleOffloadWorld(PR42903, "reference", "fix_42903"))
    assert w.metas[2][3:5] == (1, [7, 5, 6])
    assert w.duplicate_stores == []


# --- bad input ---------------------------------------------------------------------------------


def test_bad_construction_is_rejected():
    groups = FA_ONLY.kvref_groups()
    with pytest.raises(InvalidFieldError, match="num_cpu_blocks"):
        SimpleCPUOffloadScheduler(groups, 0, 256, 4, 4)
    with pytest.raises(InvalidFieldError, match="world_size"):
        SimpleCPUOffloadScheduler(groups, 4, 256, 4, 4, world_size=0)
    with pytest.raises(InvalidFieldError, match="full-attention"):
        SimpleCPUOffloadScheduler(HYBRID.kvref_groups()[1:], 4, 256, 4, 4)


def _snapshot(w):
    c = w.b.conn
    return (w.observe(), dict(c._store_event_pending_counts), sorted(c._store_event_to_blocks),
            sorted(c._reqs_to_load), sorted(c._reqs_to_store))


def test_bad_completions_are_rejected_and_change_nothing():
    w = SimpleOffloadWorld(FA_ONLY_2W, "reference")
    w.add_request(list(range(100, 113)))
    w.step(16)
    w.step(16)  # store event 0 issued
    conn = w.b.conn
    before = _snapshot(w)
    for recv, events, what in [((), {7: 1}, "never issued"), ((), {0: 3}, "more than"),
                               (("nobody",), {}, "no load in flight"), ((), {0: 0}, "completed_store_events"),
                               (("r0",), {}, "no load in flight")]:
        with pytest.raises(KVRefError, match=what):
            conn.update_connector_output(recv, events)
        assert _snapshot(w) == before
    conn.update_connector_output((), {0: 1})
    conn.update_connector_output((), {0: 1})  # second worker: event 0 completes
    before = _snapshot(w)
    with pytest.raises(OffloadStateError, match="already completed"):
        conn.update_connector_output((), {0: 1})
    assert _snapshot(w) == before
    conn.check_invariants()


def test_request_finishing_twice_is_rejected():
    w = SimpleOffloadWorld(FA_ONLY, "reference")
    w.add_request(list(range(100, 113)))
    w.step(16)
    req = w.reqs["r0"].req
    w.abort(0)
    before = _snapshot(w)
    with pytest.raises(OffloadStateError, match="already finished"):
        w.b.conn.request_finished(req, w.b.table("r0"))
    with pytest.raises(OffloadStateError, match="already finished"):
        w.b.conn.get_num_new_matched_tokens(req, 0)
    assert _snapshot(w) == before


def test_bad_step_and_block_ids_are_rejected():
    w = SimpleOffloadWorld(FA_ONLY, "reference")
    conn = w.b.conn
    with pytest.raises(InvalidFieldError, match="step"):
        conn.build_connector_meta({"scheduled": []})
    rid = w.add_request(list(range(100, 113)))
    with pytest.raises(InvalidFieldError, match="block_ids"):
        conn.update_state_after_alloc(w.reqs[rid].req, ([1], [2]), 0)
    with pytest.raises(InvalidFieldError, match="num_external_tokens"):
        conn.update_state_after_alloc(w.reqs[rid].req, ([1],), -4)
    assert conn.build_connector_meta(SimpleOffloadStep()).store_event == -1


def test_pre_41289_lives_only_in_the_mutant_catalogue():
    """One mechanism for historic variants: the reference has no pre-#41289 switch or subclass;
    the runtime mutant patches the behaviour in and restores the clean method afterwards."""
    import inspect

    import kvref.impl.reference.offload as offload

    assert "in_flight_dedup" not in inspect.signature(SimpleCPUOffloadScheduler).parameters
    assert not [n for n in dir(offload) if "41289" in n]
    clean = SimpleCPUOffloadScheduler.__dict__["_prepare_eager_store_specs"]
    with PRE_41289.applied():
        assert SimpleCPUOffloadScheduler.__dict__["_prepare_eager_store_specs"] is not clean
    assert SimpleCPUOffloadScheduler.__dict__["_prepare_eager_store_specs"] is clean
