"""The HiSparse rules of kvref.spec.hisparse and the reference HiSparse pool (issue #23), without vLLM."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvref.impl.reference.hisparse_pool import HiSparsePool
from kvref.spec.errors import InvalidFieldError
from kvref.spec.hisparse import (
    HiSparseHotSpec,
    HiSparsePoolConfig,
    HiSparseResidentSpec,
    hot_blocks_to_allocate,
    hot_needs_region,
    needs_hot_transition,
    resident_blocks_to_allocate,
    resident_max_admission_blocks,
    source_admission_count,
    transition_watermark,
)

CONFIG = HiSparsePoolConfig(block_size=2, num_gpu_blocks=12, host_num_blocks=8, blocks_per_request=2,
                            num_resident_groups=1, max_model_len=16, max_in_flight_tokens=4)


def test_resident_cap_bounds_the_gate_not_the_step():
    assert resident_max_admission_blocks(2, 4, 16) == 2
    assert resident_blocks_to_allocate(2, 16, 0, 0, 0, True, True, 2) == 2
    assert resident_blocks_to_allocate(2, 16, 0, 0, 0, True, False, 2) == 8
    # host-hit pages are placeholders, not allocations
    assert resident_blocks_to_allocate(2, 16, 6, 6, 0, True, False, 2) == 5


def test_resident_import_keeps_only_the_tail_writable():
    # 7 imported tokens = 4 pages: one writable tail block, then pages 5..6 for 12 tokens
    assert resident_blocks_to_allocate(2, 12, 7, 0, 0, False, True, 1) == 1 + 2
    assert resident_blocks_to_allocate(2, 12, 7, 0, 4, True, False, 1) == 2


def test_hot_region_rules():
    assert not hot_needs_region(0, 0, False, False)
    assert hot_needs_region(5, 0, False, False)  # import
    assert hot_needs_region(4, 4, False, False)  # resumes a host prefix
    assert not hot_needs_region(4, 4, True, False)  # running: keeps its answer
    assert hot_needs_region(0, 0, True, True)
    assert hot_blocks_to_allocate(3, 1) == 2 and hot_blocks_to_allocate(3, 3) == 0


def test_source_sentinel_and_transition():
    assert source_admission_count(3, 3, 10) == 0
    assert source_admission_count(4, 3, 10) == 11
    assert transition_watermark([2, 3], 40) == 5 and transition_watermark([1], 100) == 10
    assert needs_hot_transition(1, 2, False) and needs_hot_transition(9, 2, True)
    assert not needs_hot_transition(2, 2, False)


@pytest.mark.parametrize("call", [
    lambda: resident_blocks_to_allocate(0, 1, 0, 0, 0, True, False, 1),
    lambda: resident_blocks_to_allocate(2, 1, 0, 0, 0, "yes", False, 1),
    lambda: hot_needs_region(-1, 0, False, False),
    lambda: hot_needs_region(0, 0, 1, False),
    lambda: hot_blocks_to_allocate(0, 0),
    lambda: source_admission_count(1, 1, 0),
    lambda: transition_watermark("12", 4),
    lambda: transition_watermark([0], 4),
    lambda: needs_hot_transition(1, 1, None),
    lambda: resident_max_admission_blocks(1, 0, 4),
    lambda: HiSparseHotSpec(block_size=2, page_size=8, blocks_per_request=0),
    lambda: HiSparseResidentSpec(block_size=2, page_size=-1),
    lambda: HiSparsePoolConfig(2, 1, 8, 2, 1, 16, 4),
    lambda: HiSparsePool("not a config"),
])
def test_bad_input_names_the_field(call):
    with pytest.raises(InvalidFieldError):
        call()


def test_pool_tracks_blocks_and_frees_everything():
    pool = HiSparsePool(CONFIG)
    assert pool.get_num_blocks_to_allocate("a", 4, 0, 0, False) == [0, 2, 2, 0]
    assert pool.allocate("a", 4, 0, 0) == [[1, 2], [1, 2], [3, 4], []]
    pool.update_residency("a")  # 2 resident pages fill the window of 4 tokens: ask for a hot region
    assert pool.observe()["hot_required"] == [["a"]]
    assert pool.get_num_blocks_to_allocate("a", 5, 4, 4, False) == [0, 1, 1, 2]
    assert pool.allocate("a", 5, 4, 4)[3] == [7, 8]
    pool.check_invariants()
    pool.free("a")
    pool.check_invariants()
    state = pool.observe()
    assert state["gpu_free"] == 11 and state["host_free"] == 7 and state["tables"] == [{}, {}, {}, {}]


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 16))
def test_host_hit_pages_are_null_placeholders(num_hit_tokens):
    pool = HiSparsePool(HiSparsePoolConfig(block_size=2, num_gpu_blocks=24, host_num_blocks=10, blocks_per_request=2,
                                           num_resident_groups=1, max_model_len=16, max_in_flight_tokens=4))
    pool.allocate("a", 16, num_hit_tokens, 0)
    pool.check_invariants()
    row = pool.observe()["tables"][2]["a"]
    pages = -(-num_hit_tokens // 2)
    assert row[:pages] == [0] * pages and all(b > 0 for b in row[pages:])
    assert pool.observe()["hot_required"] == [["a"]]


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 40), st.integers(0, 40), st.integers(1, 40))
def test_proof_encoding_of_the_source_sentinel_matches_the_spec(required, host_free, num_gpu_blocks):
    """T9's encoding (kvref.proofs.formulas) is the spec's function, so the theorem is about it."""
    from kvref.proofs.formulas import REFERENCE
    from kvref.proofs.ops import PyOps

    assert REFERENCE.hisparse_source_admission(PyOps, required, host_free, num_gpu_blocks) == \
        source_admission_count(required, host_free, num_gpu_blocks)
