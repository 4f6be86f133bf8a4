"""The reference's Mamba "align" chunk split equals vLLM 0.33.0's ``_mamba_block_aligned_split``
on generated requests and settings (block/hash sizes, fine-grained hits, prefill checkpoint blocks
and alignment, EAGLE block drop, hash lookahead, chunk limits, junctions)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvref.impl.reference.scheduler_mamba_split import MambaSplitConfig, mamba_block_aligned_split
from kvref.spec.errors import InvalidFieldError
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


@st.composite
def split_cases(draw):
    hbs = draw(st.sampled_from((1, 2, 4, 8)))
    bs = hbs * draw(st.sampled_from((1, 2, 4)))
    config = MambaSplitConfig(
        block_size=bs, hash_block_size=hbs, partial_cache_hit=bs > hbs and draw(st.booleans()),
        has_prefill_checkpoint_blocks=draw(st.booleans()),
        checkpoint_alignment=draw(st.sampled_from((None, 1, hbs, bs))),
        use_eagle_block_drop=draw(st.booleans()), num_hash_lookahead_tokens=draw(st.sampled_from((0, 0, 1, 3))),
        max_prefill_tokens=draw(st.integers(1, 4 * bs)), shared_prefix_checkpoint=draw(st.booleans()),
        scheduler_block_size=draw(st.sampled_from((None, bs, 2 * bs))))
    prompt = draw(st.integers(1, 12 * bs))
    outputs = draw(st.integers(0, 3))
    computed = draw(st.integers(0, prompt + outputs))
    local = draw(st.integers(0, max(0, prompt - computed)))
    external = draw(st.integers(0, max(0, prompt - computed - local)))
    new = draw(st.integers(1, 6 * bs))
    junction = draw(st.one_of(st.just(0), st.integers(0, prompt + outputs)))
    return config, (computed, prompt, prompt + outputs, new, local, external, junction)


@settings(max_examples=profile_examples(300, 2000), deadline=None)
@given(split_cases())
def test_split_matches_vllm(case):
    require_vllm()
    from kvref.impl.vllm.mamba_split import vllm_mamba_block_aligned_split

    config, args = case
    assert mamba_block_aligned_split(config, *args) == vllm_mamba_block_aligned_split(config, *args)


def test_split_stops_at_the_partial_tail_and_block_boundaries():
    """Hand figures: block 8, hash 2, prompt 21: the prompt boundary is 20 (floor((21-1)/2)*2)."""
    config = MambaSplitConfig(block_size=8, hash_block_size=2, partial_cache_hit=True)
    assert mamba_block_aligned_split(config, 0, 21, 21, 21) == 16   # last cacheable block end: 16
    assert mamba_block_aligned_split(config, 16, 21, 21, 5) == 4     # stops at the tail boundary 20
    assert mamba_block_aligned_split(config, 20, 21, 21, 1) == 1     # the last token
    assert mamba_block_aligned_split(config, 0, 21, 21, 11) == 8     # a non-final chunk ends on a block
    assert mamba_block_aligned_split(config, 3, 21, 21, 10) == 5     # mid-block start: next boundary 8
    assert mamba_block_aligned_split(config, 21, 21, 22, 1) == 1     # decode: unchanged


def test_split_refuses_bad_input():
    config = MambaSplitConfig(block_size=4, hash_block_size=2)
    with pytest.raises(InvalidFieldError, match="num_new_tokens"):
        mamba_block_aligned_split(config, 0, 4, 4, -1)
    with pytest.raises(InvalidFieldError, match="config"):
        mamba_block_aligned_split(None, 0, 4, 4, 1)
    with pytest.raises(InvalidFieldError, match="block_size"):
        MambaSplitConfig(block_size=0, hash_block_size=1)
