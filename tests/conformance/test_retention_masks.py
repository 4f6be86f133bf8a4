"""Each manager's publication mask vs vLLM 0.33.0's ``reachable_block_mask`` (#22), over the inputs
an engine run never passes: no alignment, a sub-block alignment, DCP-wide blocks and the offloading
connector's ``final_segment_end_block`` (models/conformance/retention_masks.py; also run by
``kvref verify --against vllm`` in conform-kv-manager)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings

from kvref.impl.reference.sliding_window_manager import SlidingWindowManager
from kvref.models.conformance.retention_masks import MaskCase, agree_mask, any_mask_cases, reference_mask
from kvref.spec.errors import InvalidFieldError
from kvref.spec.kv_cache_interface import SlidingWindowSpec
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


def test_generated_masks_match_vllm_and_reach_every_input_class():
    """Derandomized, so the reach assertions hold under every profile."""
    require_vllm()
    from kvref.impl.vllm.retention_masks import vllm_reachable_block_mask

    seen: Counter = Counter()

    @given(any_mask_cases())
    @settings(max_examples=profile_examples(300, 600), derandomize=True, database=None, deadline=None)
    def run(case):
        theirs = vllm_reachable_block_mask(case.kind, *case.arguments(), case.dcp_world_size,
                                           case.final_segment_end_block)
        if case.kind == "sliding_window" and theirs is not None and case.final_segment_end_block is not None:
            seen["final segment"] += 1
        if case.kind == "sliding_window" and case.dcp_world_size > 1 and theirs is not None:
            seen["dcp"] += 1
        if case.alignment_tokens is None:
            seen["no alignment"] += 1
        if case.alignment_tokens is not None and case.alignment_tokens % (case.spec.block_size * case.dcp_world_size):
            seen["sub-block"] += 1
        agree_mask(case, vllm_reachable_block_mask)

    run()
    assert set(seen) == {"final segment", "dcp", "no alignment", "sub-block"}, seen


def test_final_partial_segment_keeps_its_tail():
    """Window 3 on 1-token blocks (a hit needs 2 blocks), segments of 4 blocks: the dense tails are
    blocks 2-3 and 6-7; a request ending at block 10 (a partial segment 8-9) keeps 8-9 too; with
    EAGLE (3-block runs shifted by one) the final tail is not added (vLLM keeps it only without EAGLE)."""
    swa = SlidingWindowSpec(block_size=1, num_kv_heads=1, head_size=1, dtype="float16", sliding_window=3)
    kept = SlidingWindowManager.reachable_block_mask(0, 10, 4, swa, False, None, (), final_segment_end_block=10)
    assert [i for i, k in enumerate(kept) if k] == [2, 3, 6, 7, 8, 9]
    eagle = SlidingWindowManager.reachable_block_mask(0, 10, 4, swa, True, None, (), final_segment_end_block=10)
    assert [i for i, k in enumerate(eagle) if k] == [2, 3, 4, 6, 7, 8]  # the shifted dense tails, no block 9
    on_boundary = SlidingWindowManager.reachable_block_mask(0, 8, 4, swa, False, None, (), final_segment_end_block=8)
    assert [i for i, k in enumerate(on_boundary) if k] == [2, 3, 6, 7]


def test_dcp_counts_in_wide_blocks():
    """With DCP 2 a block holds 2 tokens per rank-block: alignment 4 on 1-token blocks is 2 wide
    blocks a segment, so a window needing one wide block keeps every other block."""
    swa = SlidingWindowSpec(block_size=1, num_kv_heads=1, head_size=1, dtype="float16", sliding_window=2)
    case = MaskCase("sliding_window", swa, 0, 6, 4, False, None, (), 2, None)
    assert reference_mask(case) == [False, True] * 3
    # a sub-block alignment under DCP (3 is no multiple of the wide block 2): every block kept
    assert reference_mask(MaskCase("sliding_window", swa, 0, 6, 3, False, None, (), 2, None)) is None


def test_adapter_refuses_an_unknown_manager_kind():
    require_vllm()
    from kvref.impl.vllm.retention_masks import vllm_reachable_block_mask

    swa = SlidingWindowSpec(block_size=1, num_kv_heads=1, head_size=1, dtype="float16", sliding_window=2)
    with pytest.raises(InvalidFieldError, match="kind"):
        vllm_reachable_block_mask("cross", 0, 1, 1, swa, False, None, (), 1, None)
