"""The block-pool state machine: kvref's BlockPool (and vLLM's) beside the plain model."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from kvref.models.hypothesis_runs.reproducible import same_inputs_in_every_process
from kvref.models.machines.block_pool import PoolModel, make_block_pool_machine
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm


def _derandomized(machine, examples: int) -> dict:
    """The coverage assertions below hold for the machine's generators, not for a lucky draw:
    random runs of 40 examples reach no eviction in about half the runs (measured), so these run
    derandomized, with the same inputs in every process, and then check what was reached."""
    with same_inputs_in_every_process():
        run_state_machine_as_test(machine, settings=settings(max_examples=examples, stateful_step_count=40,
                                                             derandomize=True, database=None))
    return machine.coverage


def test_reference_block_pool_agrees_with_the_model():
    machine = make_block_pool_machine("reference")
    run_state_machine_as_test(machine, settings=settings(max_examples=profile_examples(60, 300),
                                                         stateful_step_count=40))
    c = _derandomized(make_block_pool_machine("reference"), 150)
    assert c.get("hits", 0) and c.get("null_slots", 0), c  # prefix hits and skipped (null) slots reached


def test_small_pool_runs_out_of_blocks_and_evicts():
    machine = make_block_pool_machine("reference", num_blocks=4)
    run_state_machine_as_test(machine, settings=settings(max_examples=profile_examples(40, 150),
                                                         stateful_step_count=40))
    c = _derandomized(make_block_pool_machine("reference", num_blocks=4), 150)
    assert c.get("exhausted", 0) and c.get("evictions", 0), c  # what the test's name promises


@pytest.mark.vllm
def test_reference_and_vllm_block_pools_agree_with_the_model():
    require_vllm()
    machine = make_block_pool_machine("reference", "vllm")
    run_state_machine_as_test(machine, settings=settings(max_examples=profile_examples(40, 200),
                                                         stateful_step_count=40))


def test_model_orders_the_free_queue_like_vllm_0_33():
    """Uncached blocks go to the front (LIFO), cached ones to the back (LRU), in the given order."""
    m = PoolModel(6)
    a = m.get_new_blocks(4)
    assert a == [1, 2, 3, 4] and m.free == [5]
    m.cache([b"x" * 32, b"y" * 32], a, 0, 2)  # blocks 1 and 2 cached
    m.free_blocks(list(reversed(a)))
    assert m.free == [4, 3, 5, 2, 1]


def test_unknown_target_is_rejected():
    with pytest.raises(ValueError, match="targets"):
        make_block_pool_machine("torch-nonexistent")
