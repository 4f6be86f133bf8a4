"""The reference canonical page mapping under context parallelism (#22), checked against properties
that do not restate its arithmetic: whichever ranks a block elects as writers place every canonical
byte exactly once, each rank's map is a permutation into the canonical page, and a rank's local
token lands on the canonical token its CP shard owns."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvref.impl.reference.offload.canonical_mapping import (
    AttentionPage,
    ContextParallel,
    attention_mapping,
    mla_mapping,
    recognized_order,
)
from kvref.spec.errors import InvalidFieldError
from tests.conftest import profile_examples


@st.composite
def _layers(draw):
    tp = draw(st.sampled_from([1, 2, 4]))
    total = draw(st.sampled_from([1, 2, 4, 8]))
    heads = max(1, total // tp)
    bs = draw(st.sampled_from([1, 2, 4]))
    cp = ContextParallel(draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2])),
                         draw(st.sampled_from([1, 2, 4])))
    page = AttentionPage(draw(st.sampled_from(["split", "packed"])), draw(st.sampled_from(["NHD", "HND"])), bs,
                         heads, draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2])))
    return page, total, tp, cp


def _tiles(maps) -> bool:
    """Every block's writers together place each canonical byte exactly once."""
    size = maps[0].canonical_page_size_bytes
    for block in range(maps[0].num_writers):
        placed = sorted(b for m in maps if m.writer_index == block % m.num_writers for b in m.byte_map)
        if placed != list(range(size)):
            return False
    return True


@settings(max_examples=profile_examples(60, 300), deadline=None)
@given(_layers())
def test_attention_writers_tile_the_canonical_page(layer):
    page, total, tp, cp = layer
    maps = [attention_mapping(page, total, tp, r, cp=cp) for r in range(tp * cp.pcp)]
    assert len({m.canonical_page_size_bytes for m in maps}) == 1 and len({m.num_writers for m in maps}) == 1
    for m in maps:
        assert sorted(m.byte_map) == sorted(set(m.byte_map)) and len(m.byte_map) == page.page_size_bytes
    assert _tiles(maps)
    certified = maps[0].canonical_page_size_bytes != tp * cp.pcp * page.page_size_bytes or maps[0].parallelism_agnostic
    if certified:  # not the fallback: the canonical block holds block_size * cp tokens of every head
        assert maps[0].parallelism_agnostic == (cp.size == 1)


@settings(max_examples=profile_examples(40, 200), deadline=None)
@given(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]), st.sampled_from([1, 2]),
       st.sampled_from([1, 2, 4]))
def test_mla_writers_tile_the_canonical_page(tp, bs, dcp, pcp, interleave):
    cp = ContextParallel(dcp, pcp, interleave)
    maps = [mla_mapping(bs * 3, tp, r, cp, bs) for r in range(tp * pcp)]
    assert _tiles(maps)


def test_cp_token_placement():
    """Rank 1 of two DCP ranks with interleave 2 holds tokens 2-3 and 6-7 of an 8-token block."""
    cp = ContextParallel(dcp=2, pcp=1, interleave=2)
    assert [cp.canonical_token(t, 1) for t in range(4)] == [2, 3, 6, 7]
    assert cp.cp_rank(1, 2) == 1 and ContextParallel(2, 2, 1).cp_rank(3, 2) == 3  # pcp rank 1, dcp rank 1
    assert not cp.tiles(1) and cp.tiles(4) and ContextParallel().tiles(1)
    page = AttentionPage("split", "NHD", 4, 1, 1, 1)
    m = attention_mapping(page, 1, 2, 1, cp=cp)  # one head replicated on both TP ranks, each its tokens
    assert (m.num_writers, m.writer_index, m.canonical_page_size_bytes) == (1, 0, 16)
    assert m.byte_map[:4] == (2, 3, 6, 7) and m.byte_map[4:] == (10, 11, 14, 15)  # K half, then V half


def test_uncertifiable_cp_falls_back():
    """DCP over heads that are not replicated, or a block that is not whole interleave chunks, gets
    the rank-private fallback."""
    page = AttentionPage("packed", "HND", 2, 2, 1, 1)
    for cp, total in ((ContextParallel(dcp=2), 4), (ContextParallel(pcp=2, interleave=4), 2)):
        m = attention_mapping(page, total, 2, 1, cp=cp)
        assert not m.parallelism_agnostic and m.byte_map[0] == page.page_size_bytes


def test_recognized_order_from_strides():
    assert recognized_order("split", 2, 2, 3, (12, 6, 3, 1)) == "NHD"
    assert recognized_order("split", 2, 2, 3, (12, 3, 6, 1)) == "HND"
    assert recognized_order("packed", 2, 2, 3, (6, 12, 1)) == "NHD"
    assert recognized_order("packed", 2, 2, 3, (12, 6, 1)) == "HND"
    assert recognized_order("split", 2, 2, 3, (13, 6, 3, 1)) is None  # padded halves
    with pytest.raises(InvalidFieldError, match="strides"):
        recognized_order("split", 2, 2, 3, [12, 6, 3, 1])
