"""SWA bounded replay in the reference scheduler (DeepSeek-V4.1; vLLM 0.33.0 ``Scheduler``
``_mark_prefix_replay`` and the dropped short hits, issue #22): the pure rules, a follow-up turn
admitted on a full-attention + bounded-replay pool, and a KV connector's hit on one (cut to whole
blocks, dropped or rewound unless the load carries the window)."""

from __future__ import annotations

import pytest

from kvref.impl.interface import PoolConfig
from kvref.impl.reference.scheduler import Scheduler
from kvref.impl.reference.scheduler_connector import ExternalHit
from kvref.impl.reference.scheduler_prefix_replay import (
    drop_short_hit,
    load_restores_window,
    mark_prefix_replay,
    prefix_replay_tokens,
    replay_admission,
    slots_past_hit,
    trim_external_hit,
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


@pytest.mark.parametrize("window, hit, loaded, want", [
    (6, 16, False, (6, 10)),   # rewound by the window, replayed from hit - window
    (6, 4, False, (4, 0)),     # after an async load there is no drop: the whole hit is replayed
    (6, 16, True, (0, 0)),     # the load carried the window: nothing replayed, replay_start 0
    (6, 0, False, (0, 0)),
])
def test_mark_prefix_replay(window, hit, loaded, want):
    assert mark_prefix_replay(window, hit, loaded) == want


def test_a_load_restores_the_window_only_with_every_replay_group():
    assert load_restores_window((1,), (0, 1))
    assert not load_restores_window((1,), (0,))        # a hash-addressed store: prefix-cacheable groups only
    assert not load_restores_window((1, 2), (0, 1))
    assert not load_restores_window((), (0, 1))         # no replay group: nothing to restore


@pytest.mark.parametrize("ext, is_async, loaded, want", [
    (9, True, False, (8, True)),    # cut to whole blocks of 4
    (3, True, False, (0, False)),   # nothing left: no async load
    (9, True, True, (9, True)),     # the load carries the window: as it is
    (0, False, True, (0, False)),
])
def test_an_external_hit_without_the_window_is_cut_to_whole_blocks(ext, is_async, loaded, want):
    assert trim_external_hit(4, ext, is_async, loaded) == want


def test_the_replay_rules_refuse_bad_input():
    with pytest.raises(InvalidFieldError, match="window"):
        mark_prefix_replay(0, 4, False)
    with pytest.raises(InvalidFieldError, match="window_loaded"):
        mark_prefix_replay(4, 4, 1)
    with pytest.raises(InvalidFieldError, match="loaded_group_ids"):
        load_restores_window((1,), [0, 1])
    with pytest.raises(InvalidFieldError, match="num_external"):
        trim_external_hit(4, -1, False, False)


def _connector_turn(hit, window: int = 6) -> tuple[int, int, int, list]:
    """A 16-token prompt (plus one more token) whose store holds ``hit``: after the first schedule
    (and, for an async load, its landing and the next schedule), the first admitted step's
    (scheduled tokens, computed tokens, replay_start) and the connector's allocations."""
    from kvref.impl.reference.scheduler_connector import ExternalHit, KVConnectorOutput, ScriptedConnector

    conn = ScriptedConnector()
    s = Scheduler(_pool(window), SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=2), connector=conn)
    conn.set_hit("a", hit)
    s.add_request(Request("a", list(range(17)), max_tokens=2))
    out = s.schedule()
    if hit.load_async and "a" in conn.pending_loads:
        assert not out.scheduled
        s.update_from_output(out, ModelOutput({}), KVConnectorOutput(finished_recving=("a",)))
        out = s.schedule()
    (a,) = out.scheduled
    allocs = [c[3] for c in conn.calls if c[0] == "update_state_after_alloc"]
    return a.num_scheduled_tokens, a.num_computed_tokens, s.requests["a"].replay_start, allocs


@pytest.mark.parametrize("hit, want", [
    # a hash-addressed store (no window): 15 external tokens cut to 12, rewound by the window
    (ExternalHit(num_tokens=15), (11, 6, 6, [12])),
    (ExternalHit(num_tokens=15, load_async=True), (11, 6, 6, [12, 0])),  # replayed once landed
    # a P/D transfer carrying the window: taken whole, nothing replayed
    (ExternalHit(num_tokens=15, loads_all_groups=True), (2, 15, 0, [15])),
    (ExternalHit(num_tokens=17, load_async=True, loads_all_groups=True), (1, 16, 0, [17, 0])),
    # no longer than the window once cut: dropped, the load with it
    (ExternalHit(num_tokens=7, load_async=True), (17, 0, 0, [0])),
])
def test_a_connector_hit_on_a_replay_pool(hit, want):
    assert _connector_turn(hit) == want
