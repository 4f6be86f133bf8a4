"""The CPU offload tier's shared-region layout (reference, #22): files, pre-fault ranges, views."""

from __future__ import annotations

import pytest

from kvref.impl.reference.offload.shared_region_layout import (
    canonical_view_offsets,
    region_segments,
    worker_slot_ranges,
    worker_view_offsets,
)
from kvref.spec.errors import InvalidFieldError


def test_segments_split_whole_rows_and_never_below_the_minimum():
    assert region_segments("/p", 5, 100, 4, 100) == [("/p", 0, 200), ("/p.1", 200, 200), ("/p.2", 400, 100)]
    assert region_segments("/p", 5, 100, 4, 1000) == [("/p", 0, 500)], "too small to split"
    assert region_segments("/p", 0, 100, 2, 1) == [("/p", 0, 0)]


def test_slots_are_page_aligned_and_rotate_per_worker_when_split():
    # 2 workers of 3000-byte slots in 8192-byte rows, 4096-byte pages
    assert worker_slot_ranges(1, 2, 8192, 3000, 4096, False) == [(0, 8192), (8192, 8192)]
    assert worker_slot_ranges(0, 2, 8192, 3000, 4096, False) == [(0, 4096), (8192, 4096)]
    # split: worker 1 starts at row 1 * 2 // (8192 // 3000) = 1
    assert worker_slot_ranges(1, 2, 8192, 3000, 4096, True) == [(8192, 8192), (0, 8192)]


def test_views_pack_a_worker_slot_and_refuse_overflow_without_advancing():
    assert worker_view_offsets(1, 100, [40, 60, 10]) == [100, 140, None]
    assert worker_view_offsets(1, 100, [40, 70, 60]) == [100, None, 140]
    assert canonical_view_offsets(256, [200, 100, 56]) == [0, None, 200]


@pytest.mark.parametrize("call, field", [
    (lambda: region_segments("/p", -1, 100, 1, 1), "num_chunks"),
    (lambda: region_segments("/p", 1, 0, 1, 1), "row_stride"),
    (lambda: worker_slot_ranges(0, 1, 100, 0, 4096, False), "cpu_page_size"),
    (lambda: worker_view_offsets(0, 100, [1, -2]), "sizes"),
    (lambda: canonical_view_offsets(0, [1]), "row_stride"),
])
def test_bad_input_names_the_field(call, field):
    with pytest.raises(InvalidFieldError, match=field):
        call()
