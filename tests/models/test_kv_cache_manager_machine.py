"""The KV-cache-manager state machine and harness on the reference alone (no vLLM needed)."""

from __future__ import annotations

import argparse
import os

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from kvref.cli import replay as cli_replay
from kvref.impl.interface import PoolConfig, make_manager
from kvref.models.conformance import differential
from kvref.models.conformance.differential import Divergence, Harness
from kvref.models.machines.kv_cache_manager import kv_cache_manager_machine
from kvref.models.conformance.trace import Op, Trace
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from tests.conftest import profile_examples


def _pool(num_blocks: int = 8) -> PoolConfig:
    fa = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float16")
    return PoolConfig(num_blocks=num_blocks, groups=(KVCacheGroupSpec(("l",), fa),), max_model_len=32,
                      scheduler_block_size=4, hash_block_size=4)


def _admit(rid: str, **kw) -> Op:
    args = dict(rid=rid, chunk=64, full_sequence_must_fit=True, reserved_blocks=0, in_flight=False, token=1)
    args.update(kw)
    return Op("admit", args)


OPS = [Op("add", dict(rid="a", prompt=list(range(10)), max_tokens=2, cache_salt=None)), _admit("a"),
       Op("add", dict(rid="b", prompt=list(range(10)), max_tokens=4, cache_salt=None)), _admit("b", in_flight=True),
       Op("process", dict(rid="b")), Op("step", dict(rid="b", chunk=1, lookahead=0, in_flight=False, token=3)),
       Op("preempt", dict(rid="b")), Op("new_step", {}), _admit("b"), Op("finish", dict(rid="a"))]


def test_reference_alone_machine_runs_long_traces():
    machine = kv_cache_manager_machine(("reference",))
    run_state_machine_as_test(machine, _min_steps=31, settings=settings(max_examples=profile_examples(20, 80),
                                                                        stateful_step_count=40))
    assert machine.stats.runs_with_at_least(30) >= profile_examples(20, 80)
    assert machine.stats.prefix_hits > 0 and machine.stats.admission_rejections > 0


def test_harness_follows_the_scheduler_bookkeeping():
    h = Harness(_pool(), ["reference"])
    for op in OPS[:4]:
        h.apply(op)
    b = h.reqs["b"].request
    # b hit a's 2 cached blocks (8 tokens), scheduled the remaining 2, which are still in flight
    assert (b.num_computed_tokens, b.num_in_flight_tokens, b.num_output_placeholders) == (10, 2, 1)
    h.apply(OPS[4])
    assert (b.num_in_flight_tokens, b.num_output_placeholders, b.output_token_ids) == (0, 0, [1])
    for op in OPS[5:]:
        h.apply(op)
    assert h.num_prefix_hits == 2 and h.num_preemptions == 1  # b, and b again after its preemption
    assert h.reqs["a"].request.is_finished and not h.reqs["a"].holds_blocks
    # an op whose precondition fails is skipped, not an error: saved traces stay replayable
    assert h.apply(Op("step", dict(rid="nobody", chunk=1, lookahead=0, in_flight=False, token=0))).skipped
    assert h.apply(OPS[0]).skipped  # "a" exists already


def test_a_leaking_manager_breaks_the_protocol_invariant():
    pool = _pool()
    ref = make_manager("reference", pool)

    class Leaky:
        def __getattr__(self, name):
            return getattr(ref, name)

        def get_block_ids(self, request_id):  # forgets to report the table of "b"
            return ((),) if request_id == "b" else ref.get_block_ids(request_id)

    h = Harness(pool, {"leaky": Leaky()})
    with pytest.raises(Divergence, match="blocks leaked"):
        for op in OPS:
            h.apply(op)


def test_replay_entry_points(tmp_path, capsys):
    path = Trace(_pool(), OPS).save(tmp_path / "t.json")
    assert differential.replay(Trace.load(path), ("reference",)).ok
    assert differential.main([str(path), "--kinds", "reference"]) == 0
    assert "OK" in capsys.readouterr().out
    ns = argparse.Namespace(trace=str(path), kinds="reference", verbose=True)
    assert cli_replay.run(ns) == 0
    assert "#  9 finish(rid='a')" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--kinds"):
        cli_replay.run(argparse.Namespace(trace=str(path), kinds="nonsense", verbose=False))
    # a divergence makes replay fail: a manager that loses a block from its free queue
    ref = make_manager("reference", _pool())

    class Lossy:
        def __getattr__(self, name):
            return getattr(ref, name)

        def free_block_queue(self):
            return ref.free_block_queue()[1:]

    h = Harness(_pool(), {"lossy": Lossy()})
    with pytest.raises(Divergence, match="free queue length"):
        h.apply(OPS[0])
        h.apply(OPS[1])


def test_reference_and_torch_agree_through_the_same_machine():
    """The machine is parameterised by implementations: the torch one runs through it unchanged
    (it refuses Mamba "align" and EAGLE pools, which the machine then skips as examples)."""
    pytest.importorskip("torch")
    machine = kv_cache_manager_machine(("reference", "torch"), eagle=False,
                                       group_sets=("fa", "fa+fa", "fa+swa", "fa+chunked", "fa+swa+swa", "swa",
                                                   "fa+mamba"))
    run_state_machine_as_test(machine, _min_steps=31, settings=settings(max_examples=profile_examples(10, 40),
                                                                        stateful_step_count=40))
    assert machine.stats.runs_with_at_least(30) >= profile_examples(10, 40)
    assert machine.stats.unsupported_pools == 0


def test_run_machine_is_seeded_and_saves_a_replayable_failing_trace(tmp_path):
    from kvref.impl.interface import register_manager
    from kvref.models.machines.kv_cache_manager import run_machine

    a = run_machine(("reference",), 4, seed=7)
    b = run_machine(("reference",), 4, seed=7)
    assert a.ok and a.stats.steps == b.stats.steps and a.stats.group_sets == b.stats.group_sets

    class Stale:
        """The reference, but its free-block count lags one block behind after the first free."""

        def __init__(self, pool_config):
            self.ref = make_manager("reference", pool_config)
            self.freed = False

        def __getattr__(self, name):
            return getattr(self.ref, name)

        def free(self, request):
            self.freed = True
            self.ref.free(request)

        def get_num_free_blocks(self):
            return self.ref.get_num_free_blocks() - int(self.freed)

    register_manager("test-stale-free-count", Stale)
    run = run_machine(("reference", "test-stale-free-count"), 30, seed=1, out_dir=str(tmp_path))
    assert not run.ok
    assert "free queue length" in run.failure or "num_free_blocks differs" in run.failure
    assert "KVREF_TRACE_DIR" not in os.environ or os.environ["KVREF_TRACE_DIR"] != str(tmp_path)
    assert run.trace_path is not None and run.trace_path.startswith(str(tmp_path))
    trace = Trace.load(run.trace_path)
    assert not differential.replay(trace, ("reference", "test-stale-free-count")).ok
    assert differential.replay(trace, ("reference",)).ok
