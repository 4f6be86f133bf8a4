"""The R-SWA, circular-buffer and attention-sink managers against vLLM 0.33.0's own classes
(issue #23): generated traces on FA + R-SWA and FA + ring pools compared op by op, the gap freeing
of R-SWA by hand, and the sink manager vLLM 0.33.0 cannot build through its coordinator."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from kvref.impl.interface import PoolConfig, make_manager
from kvref.impl.request import Request, RequestStatus
from kvref.models.conformance.differential import Harness
from kvref.models.conformance.trace import Op
from kvref.models.machines.kv_cache_manager import kv_cache_manager_machine
from kvref.spec.errors import InvalidFieldError
from kvref.spec.kv_cache_interface import (
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    RSWASpec,
    SinkFullAttentionSpec,
)
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

COMMON = dict(block_size=4, num_kv_heads=1, head_size=1, dtype="float32")


def _pool(*specs, num_blocks: int = 40) -> PoolConfig:
    return PoolConfig(num_blocks=num_blocks, groups=tuple(KVCacheGroupSpec((f"l{i}",), s) for i, s in enumerate(specs)),
                      max_model_len=64, scheduler_block_size=4, hash_block_size=4)


def test_rswa_frees_the_gap_between_prompt_and_window_like_vllm():
    """Prompt 6 tokens, window 4, blocks of 4: once 17 tokens are processed the decode window
    starts at 13, so block 2 (tokens 8-11) lies wholly in the gap and is freed in both
    implementations; the prompt's blocks 0-1 stay."""
    require_vllm()
    h = Harness(_pool(FullAttentionSpec(**COMMON), RSWASpec(**COMMON, rswa_window=4)), ["reference", "vllm"])
    h.apply(Op("add", dict(rid="r0", prompt=list(range(6)), max_tokens=20, cache_salt=None)))
    h.apply(Op("admit", dict(rid="r0", chunk=6, full_sequence_must_fit=False, reserved_blocks=0, in_flight=False,
                             token=1)))
    for _ in range(12):
        h.apply(Op("step", dict(rid="r0", chunk=1, lookahead=0, in_flight=False, token=1)))
    full, rswa = h.managers["reference"].get_block_ids("r0")
    assert len(full) == len(rswa) == 5 and 0 not in full
    assert rswa[0] != 0 and rswa[1] != 0 and rswa[2] == 0  # the gap block, nulled
    assert h.num_null_slots > 0


def test_ring_claims_one_block_per_request_like_vllm():
    require_vllm()
    h = Harness(_pool(FullAttentionSpec(**COMMON), CircularBufferSpec(**COMMON)), ["reference", "vllm"])
    h.apply(Op("add", dict(rid="r0", prompt=list(range(13)), max_tokens=4, cache_salt=None)))
    h.apply(Op("admit", dict(rid="r0", chunk=13, full_sequence_must_fit=True, reserved_blocks=0, in_flight=False,
                             token=1)))
    h.apply(Op("step", dict(rid="r0", chunk=1, lookahead=0, in_flight=False, token=1)))
    full, ring = h.managers["reference"].get_block_ids("r0")
    assert len(full) == 4 and len(ring) == 1
    h.apply(Op("add", dict(rid="r1", prompt=list(range(13)), max_tokens=4, cache_salt=None)))
    res = h.apply(Op("admit", dict(rid="r1", chunk=1, full_sequence_must_fit=False, reserved_blocks=0,
                                   in_flight=False, token=1)))
    hit, num_hit, _ = res.value
    assert num_hit == 12 and hit[1] == ()  # the ring is never part of a hit


def test_generated_rswa_traces_match_vllm():
    """Derandomized: the same traces every run, so the reach assertion (a gap was freed, which
    needs a request decoding past prompt + window) cannot flake; every op is compared anyway."""
    require_vllm()
    machine = kv_cache_manager_machine(("reference", "vllm"), group_sets=("fa+rswa",))
    run_state_machine_as_test(machine, settings=settings(max_examples=profile_examples(40, 120), derandomize=True,
                                                         stateful_step_count=40, deadline=None))
    assert set(machine.stats.group_sets) == {"FullAttention+RSWA"}
    assert machine.stats.null_slots > 0  # R-SWA gaps were freed


def test_generated_ring_traces_match_vllm():
    require_vllm()
    machine = kv_cache_manager_machine(("reference", "vllm"), group_sets=("fa+ring",))
    run_state_machine_as_test(machine, settings=settings(max_examples=profile_examples(15, 60),
                                                         stateful_step_count=40, deadline=None))
    assert set(machine.stats.group_sets) == {"FullAttention+CircularBuffer"}
    assert machine.stats.admissions > 0


def test_vllm_0_33_cannot_build_the_sink_manager_through_its_coordinator():
    """vLLM 0.33.0's SinkFullAttentionManager.__init__ lacks ``needs_kv_cache_zeroing``, which its
    get_manager_for_kv_cache_spec passes. If a later vLLM builds it, this fails: then compare the
    sink manager in the generated traces too."""
    require_vllm()
    with pytest.raises(TypeError, match="needs_kv_cache_zeroing"):
        make_manager("vllm", _pool(SinkFullAttentionSpec(**COMMON, sink_len=4)))


def test_reference_sink_manager_is_full_attention_with_a_checked_sink():
    """Same ops, same answers as a full-attention pool (the reference alone: see above)."""
    def run(spec):
        m = make_manager("reference", _pool(spec))
        a = Request("a", list(range(10)), max_tokens=2)
        out = [m.allocate_slots(a, 10)]
        a.num_computed_tokens, a.status = 10, RequestStatus.RUNNING
        b = Request("b", list(range(9)), max_tokens=2)
        hit, n = m.get_computed_blocks(b)
        out += [hit, n, m.allocate_slots(b, 9 - n, n, hit), m.free_block_queue()]
        m.check_invariants()
        return out

    assert run(SinkFullAttentionSpec(**COMMON, sink_len=8)) == run(FullAttentionSpec(**COMMON))
    with pytest.raises(InvalidFieldError, match="sink_len"):
        make_manager("reference", _pool(SinkFullAttentionSpec(**COMMON, sink_len=6)))
