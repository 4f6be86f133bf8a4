"""SWA bounded replay in the reference scheduler (DeepSeek-V4.1; vLLM 0.33.0 ``Scheduler``
``_mark_prefix_replay`` and the dropped short hits, issue #22): the pure rules, and a follow-up
turn admitted on a full-attention + bounded-replay pool."""

from __future__ import annotations

import pytest

from kvref.impl.interface import PoolConfig
from kvref.impl.reference.scheduler import Scheduler
from kvref.impl.reference.scheduler_prefix_replay import (
    drop_short_hit,
    prefix_replay_tokens,
    replay_admission,
    slots_past_hit,
)
from kvref.impl.request import Request
from kvref.impl.scheduler_types import ModelOutput, SchedulerConfig
from kvref.spec.errors import InvalidFieldError
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowMLASpec


@pytest.mark.parametrize("window, hit, kept, computed, replayed", [
    (6, 16, True, 10, 6),    # a hit longer than the window: rewound by it
    (6, 7, True, 1, 6),
    (6, 6, False, 0, 0),     # no longer than the window: dropped (it would be recomputed in full)
    (6, 1, False, 0, 0),
    (6, 0, False, 0, 0),
    (0, 16, True, 16, 0),    # no replay group: the hit as it is
])
def test_a_hit_is_dropped_or_rewound_by_the_window(window, hit, kept, computed, replayed):
    a = replay_admission(window, hit)
    assert (a.hit_kept, a.num_computed_tokens, a.num_replay_tokens) == (kept, computed, replayed)
    assert a.replay_start == a.num_computed_tokens  # vLLM replay_start = hit - replayed
    assert drop_short_hit(window, hit) == (bool(window) and 0 < hit <= window)


def test_a_chunk_inside_the_replayed_range_asks_no_slot():
    assert slots_past_hit(10, 6) == 4
    assert slots_past_hit(4, 6) == 0
    assert slots_past_hit(6, 0) == 6


def _pool(window: int | None, bounded_replay: bool = True, num_blocks: int = 40, **extra) -> PoolConfig:
    groups = [KVCacheGroupSpec(("full",), FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8,
                                                            dtype="float16"))]
    if window is not None:
        groups.append(KVCacheGroupSpec(("swa",), SlidingWindowMLASpec(
            block_size=4, num_kv_heads=1, head_size=16, dtype="float16", sliding_window=window,
            bounded_replay=bounded_replay)))
    for name, w in extra.items():
        groups.append(KVCacheGroupSpec((name,), SlidingWindowMLASpec(
            block_size=4, num_kv_heads=1, head_size=16, dtype="float16", sliding_window=w, bounded_replay=True)))
    return PoolConfig(num_blocks=num_blocks, groups=tuple(groups), max_model_len=64, scheduler_block_size=4,
                      hash_block_size=4, max_in_flight_tokens=32, enable_caching=True)


def test_the_pool_has_one_replay_window():
    assert prefix_replay_tokens(_pool(6)) == 6
    assert prefix_replay_tokens(_pool(6, bounded_replay=False)) == 0
    assert prefix_replay_tokens(_pool(None)) == 0
    assert prefix_replay_tokens(_pool(6, other=6)) == 6
    with pytest.raises(InvalidFieldError, match="one replay window"):
        prefix_replay_tokens(_pool(6, other=8))


def _follow_up(window: int | None, bounded_replay: bool = True) -> tuple[int, int, int]:
    """A 16-token turn runs to its end; the same prompt plus 4 tokens then arrives: its first
    step's (scheduled tokens, computed tokens, replay_start)."""
    s = Scheduler(_pool(window, bounded_replay), SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=2))
    s.add_request(Request("a", list(range(16)), max_tokens=1))
    out = s.schedule()
    s.update_from_output(out, ModelOutput({"a": [99]}))
    s.add_request(Request("b", list(range(16)) + [1, 2, 3, 4], max_tokens=1))
    out = s.schedule()
    (b,) = out.scheduled
    return b.num_scheduled_tokens, b.num_computed_tokens, s.requests["b"].replay_start


@pytest.mark.parametrize("window, want", [
    (6, (10, 10, 10)),    # the 16-token hit, rewound by 6: 10 computed, 10 scheduled (6 replayed + 4)
    (15, (19, 1, 1)),     # rewound by 15
    (16, (20, 0, 0)),     # a hit no longer than the window is dropped
])
def test_a_follow_up_replays_the_window(window, want):
    assert _follow_up(window) == want


def test_without_bounded_replay_the_window_is_prefix_cached():
    assert _follow_up(6, bounded_replay=False) == (4, 16, 0)


def test_a_connector_on_a_replay_pool_is_refused():
    from kvref.impl.reference.scheduler_connector import ScriptedConnector

    with pytest.raises(InvalidFieldError, match="connector"):
        Scheduler(_pool(6), SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=2),
                  connector=ScriptedConnector())
