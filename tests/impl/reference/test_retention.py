"""Sparse prefix-cache retention in the reference (issue #23), by hand: which sliding-window and
Mamba blocks stay published at each ``prefix_cache_retention_interval``, the replay boundaries,
``prefill_end`` under interval 0, and the values vLLM's coordinator rejects."""

from __future__ import annotations

import pytest

from kvref.impl.interface import PoolConfig, make_manager
from kvref.impl.reference.mamba_manager import MambaManager
from kvref.impl.reference.sliding_window_manager import SlidingWindowManager
from kvref.impl.request import Request
from kvref.spec.errors import InvalidFieldError
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec, SlidingWindowSpec
from kvref.spec.prefix_cache_retention import replay_boundaries, validate_prefix_cache_retention_interval

SWA = SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float16", sliding_window=5)
FA = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float16")
MAMBA = MambaSpec(block_size=4, shapes=((2, 3),), dtypes=("float16",), mamba_cache_mode="align")


def _pool(*specs, retention=None, sbs: int = 4) -> PoolConfig:
    return PoolConfig(num_blocks=40, groups=tuple(KVCacheGroupSpec((f"l{i}",), s) for i, s in enumerate(specs)),
                      max_model_len=64, scheduler_block_size=sbs, hash_block_size=4,
                      prefix_cache_retention_interval=retention)


@pytest.mark.parametrize("retention, cached", [
    (None, [0, 1, 2, 3, 4]),  # dense: a one-block window can hit at every block
    (0, [3]),                 # only the tail ending at the replay boundary 19 -> 16
    (8, [1, 3]),              # one tail per two-block segment (the replay tail is block 3 too)
])
def test_sliding_window_publishes_only_retained_tails(retention, cached):
    m = make_manager("reference", _pool(SWA, retention=retention))
    r = Request("r0", list(range(20)), max_tokens=4)
    ids = m.allocate_slots(r, 20)
    published = sorted(ids[0].index(b) for (_g, b) in m.cached_blocks())
    assert published == cached
    # a resend still hits up to the replay boundary whatever the interval
    again = Request("r1", list(range(20)), max_tokens=4)
    assert m.get_computed_blocks(again)[1] == 16


def test_masks_by_hand():
    # window 5 over blocks of 4 needs one block; segments of 2 blocks keep odd blocks
    assert SlidingWindowManager.reachable_block_mask(0, 5, 4, SWA, False, 8, [19]) == [False, True, False, True, False]
    # boundary 11 -> 8 keeps block 1; EAGLE also keeps the peeked block past it (2)
    assert SlidingWindowManager.reachable_block_mask(0, 6, 4, SWA, False, 0, [11]) == [False, True] + [False] * 4
    assert SlidingWindowManager.reachable_block_mask(0, 6, 4, SWA, True, 0, [11]) == \
        [False, True, True, False, False, False]
    assert SlidingWindowManager.reachable_block_mask(0, 5, 4, SWA, False, None, [19]) is None  # dense: all
    # Mamba: the state block ending each 16-token segment (3, 7) and at the boundary 37 -> 36 (8)
    assert [i for i, kept in enumerate(MambaManager.reachable_block_mask(0, 10, 4, MAMBA, False, 16, [37]))
            if kept] == [3, 7, 8]
    assert MambaManager.reachable_block_mask(0, 10, 4, MAMBA, False, None, [37]) is None
    assert MambaManager.reachable_block_mask(0, 10, 4, MAMBA, False, 4, [37]) is None  # one block a segment
    # a window start past the first segment: the mask is relative to start_block
    assert MambaManager.reachable_block_mask(5, 9, 4, MAMBA, False, 16, []) == [False, False, True, False]


def test_replay_boundaries():
    assert replay_boundaries(20, 4, use_eagle=False) == (19,)
    assert replay_boundaries(20, 4, use_eagle=True) == (12, 16)  # block-aligned: resend and extension differ
    assert replay_boundaries(22, 4, use_eagle=True) == (16,)
    assert replay_boundaries(3, 4, use_eagle=True) == (0,)


def test_mamba_checkpoint_block_only_on_the_prefill_end_chunk_under_interval_0():
    """Under interval 0 the coordinator hands ``prefill_end`` down: a chunk that stops before it
    reserves no prefill-checkpoint block; under other intervals every chunk may reserve one."""
    spec = MambaSpec(block_size=4, shapes=((2, 3),), dtypes=("float16",), mamba_cache_mode="align",
                     num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1)
    need = {}
    for retention in (0, 8):
        m = make_manager("reference", _pool(FA, spec, retention=retention))
        coordinator = m.manager.coordinator
        empty = ([], [])
        # a 10-token chunk of a 30-token prompt: its checkpoint (8) is inside the chunk
        need[retention] = coordinator.get_num_blocks_to_allocate("r0", 10, empty, 0, 0, 0, 10, prefill_end=30)
    assert need[8] == need[0] + 1


@pytest.mark.parametrize("groups, retention, ok", [
    ((FA,), 0, True), ((FA,), None, True),
    ((FA,), 4, False),            # no sliding-window or Mamba group: retention would do nothing
    ((FA, SWA), 8, True), ((FA, SWA), 6, False), ((FA, SWA), -4, False),
    ((FA, MAMBA), 0, True), ((FA, MAMBA), 12, True),
])
def test_validation_like_vllm(groups, retention, ok):
    group_specs = tuple(KVCacheGroupSpec((f"l{i}",), s) for i, s in enumerate(groups))
    if ok:
        validate_prefix_cache_retention_interval(retention, 4, group_specs)
        _pool(*groups, retention=retention)
        return
    with pytest.raises(InvalidFieldError) as info:
        _pool(*groups, retention=retention)
    assert info.value.field == "prefix_cache_retention_interval" and info.value.value == retention


@pytest.mark.parametrize("bad", [True, "8", 8.0, [8]])
def test_retention_of_the_wrong_type_is_rejected(bad):
    with pytest.raises(InvalidFieldError) as info:
        _pool(FA, SWA, retention=bad)
    assert info.value.field == "prefix_cache_retention_interval"


def test_torch_refuses_sparse_retention():
    pytest.importorskip("torch")
    with pytest.raises(InvalidFieldError) as info:
        make_manager("torch", _pool(FA, SWA, retention=0))
    assert info.value.field == "prefix_cache_retention_interval"
