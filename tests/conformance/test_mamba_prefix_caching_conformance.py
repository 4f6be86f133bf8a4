"""Mamba "align" prefix caching on FA + Mamba pools against vLLM 0.33.0's own classes (issue #23):
fine-grained partial hits (a Mamba block of 2-4 hash blocks), the prompt's partial tail, its
copy-on-write on a hit, the hand-over of a published tail to a fresh copy (``move_block_hashes``),
prefill checkpoint blocks, and the scheduler's chunk split that makes chunks reach them."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from kvref.impl.interface import PoolConfig
from kvref.models.conformance.differential import Harness
from kvref.models.conformance.trace import Op
from kvref.models.machines.kv_cache_manager import kv_cache_manager_machine
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


def _pool(checkpoint_alignment: int | None = None) -> PoolConfig:
    fa = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float32")
    mamba = MambaSpec(block_size=4, shapes=((2, 3),), dtypes=("float16",), mamba_cache_mode="align",
                      num_prefill_checkpoint_blocks=int(checkpoint_alignment is not None),
                      prefill_checkpoint_alignment=checkpoint_alignment)
    return PoolConfig(num_blocks=40, groups=(KVCacheGroupSpec(("attn",), fa), KVCacheGroupSpec(("ssm",), mamba)),
                      max_model_len=64, scheduler_block_size=4, hash_block_size=2)


def _admit(rid: str, chunk: int) -> Op:
    return Op("admit", dict(rid=rid, chunk=chunk, full_sequence_must_fit=False, reserved_blocks=0,
                            in_flight=False, token=1))


def _step(rid: str, chunk: int) -> Op:
    return Op("step", dict(rid=rid, chunk=chunk, lookahead=0, in_flight=False, token=1))


def test_partial_tail_hand_over_and_copy_on_write_match_vllm():
    """Prompt of 11 tokens, blocks of 4, hashes of 2: the reusable boundary is 10, inside block 2.
    r0 stops there (the scheduler's split), publishes the partial tail in both groups, and hands
    the Mamba entry over to a copy before its next step overwrites the state; r1 (same prompt)
    hits 10 tokens and takes private copies of both shared tails. Every op is compared with vLLM."""
    require_vllm()
    h = Harness(_pool(), ["reference", "vllm"])
    prompt = list(range(11))
    ops = [Op("add", dict(rid="r0", prompt=prompt, max_tokens=5, cache_salt=None)), _admit("r0", 8),
           Op("new_step", {}), _step("r0", 2), Op("new_step", {}), _step("r0", 1), Op("new_step", {}),
           Op("add", dict(rid="r1", prompt=prompt, max_tokens=5, cache_salt=None)), _admit("r1", 1)]
    results = [h.apply(op) for op in ops]
    assert h.managers["reference"].get_block_ids("r0") == ((1, 2, 4), (0, 0, 5))
    hit_ids, hit_len, new_ids = results[-1].value
    assert hit_len == 10 and hit_ids == ((1, 2, 4), (0, 0, 6))  # the Mamba hit is the handed-over copy 6
    assert new_ids == ((7,), (8,))  # private copies of both shared partial tails
    assert h.num_cow_copies == 3  # r0's hand-over + r1's two copy-on-writes
    for op in (Op("finish", dict(rid="r0")), Op("finish", dict(rid="r1"))):
        h.apply(op)
    assert h.managers["reference"].get_num_free_blocks() == 39


def test_prefill_checkpoint_block_matches_vllm():
    """With a checkpoint alignment of 1 a 10-token chunk exports the boundary state from inside the
    chunk into a reserved block; the next request hits it."""
    require_vllm()
    h = Harness(_pool(checkpoint_alignment=1), ["reference", "vllm"])
    prompt = list(range(11))
    for op in [Op("add", dict(rid="r0", prompt=prompt, max_tokens=5, cache_salt=None)), _admit("r0", 10),
               Op("new_step", {}), _step("r0", 1), Op("new_step", {}),
               Op("add", dict(rid="r1", prompt=prompt, max_tokens=5, cache_salt=None)), _admit("r1", 1)]:
        h.apply(op)
    assert h.managers["reference"].get_block_ids("r1")[1][-1] != 0
    assert h.num_prefix_hits >= 1


def test_generated_mamba_align_traces_match_vllm():
    """Generated traces on FA + Mamba "align" pools (fine-grained and block-sized Mamba blocks,
    prefill checkpoints), chunks clipped by the scheduler's split: every op compared with vLLM;
    the runs must publish partial tails and run copy-on-write copies."""
    require_vllm()
    machine = kv_cache_manager_machine(("reference", "vllm"), group_sets=("fa+mamba_fine", "fa+mamba_align"))
    # derandomized: the same traces every run, so the reach assertions below cannot flake
    run_state_machine_as_test(machine, settings=settings(max_examples=profile_examples(40, 150), derandomize=True,
                                                         stateful_step_count=40, deadline=None))
    stats = machine.stats
    assert stats.partial_entries > 0
    assert stats.cow_copies > 0
