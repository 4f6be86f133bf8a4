"""The OffloadingConnector's KV cache events: placeholder and self-describing payloads (reference).

conform-offload compares these events with vLLM's ``OffloadingEventsTracker`` on generated traces;
these tests pin the rules with directed traces.
"""

from __future__ import annotations

import pytest

from kvref.impl.reference.kv_events import to_external_block_hash, use_int_block_hashes
from kvref.impl.reference.offload.cpu_offloading_manager import OffloadingEvent
from kvref.impl.reference.offload.keys import make_offload_key
from kvref.impl.reference.offload.offload_event_tracker import (
    EventGroupSpec,
    OffloadingEventsTracker,
    event_group_specs,
)
from kvref.models.offload.offloading_connector_world import OffloadingConfig, OffloadingWorld
from kvref.spec.errors import InvalidFieldError

H = [bytes([i + 1]) * 32 for i in range(4)]


def _run(cfg, prompts):
    w = OffloadingWorld(cfg, "reference")
    for p in prompts:
        w.add_request(p)
        for _ in range(4):
            w.step(8)
        while w.jobs:
            w.complete(0, cfg.num_workers)
        w.step(8)
    return w


def _ext(h):
    return to_external_block_hash(h, use_int_block_hashes())


def test_self_describing_store_carries_the_chunk_and_eviction_fans_out():
    """Two blocks per chunk: a stored chunk names both block hashes, its parent (the hash before
    it), its 8 tokens and the GPU block size; evicting it removes both hashes."""
    cfg = OffloadingConfig(blocks_per_chunk=2, num_cpu_chunks=2, kv_events="self_describing")
    first = list(range(100, 117))
    w = _run(cfg, [first, list(range(300, 317))])
    hashes = w.b.block_hashes(w.reqs["r0"].req)
    stored = [e for e in w.kv_events if e["type"] == "BlockStored"]
    assert stored[0]["token_ids"] == first[:8] and stored[0]["parent_block_hash"] is None
    assert stored[0]["block_hashes"] == [_ext(hashes[0]), _ext(hashes[1])] and stored[0]["block_size"] == 4
    assert stored[1]["token_ids"] == first[8:16] and stored[1]["parent_block_hash"] == _ext(hashes[1])
    assert stored[0]["kv_cache_spec_kind"] == "full_attention"
    removed = [e for e in w.kv_events if e["type"] == "BlockRemoved"]
    assert all(len(e["block_hashes"]) == 2 for e in removed)
    assert sorted(h for e in removed for h in e["block_hashes"]) == sorted(_ext(h) for h in hashes[:4])
    assert not w.b.conn.events_tracker.pending.keys() & {make_offload_key(hashes[1], 0), make_offload_key(hashes[3], 0)}


def test_windowed_groups_publish_placeholders_with_their_classification():
    """A sliding-window group is never snapshotted: its stored events stay placeholders (one offload
    hash, no tokens), carrying the group's kind and window only when self-describing is on."""
    prompt = list(range(100, 117))
    for mode, kind, window in (("self_describing", "sliding_window", 8), ("placeholder", None, None)):
        w = _run(OffloadingConfig(sliding_window=8, num_gpu_blocks=24, num_cpu_chunks=32, kv_events=mode), [prompt])
        swa = [e for e in w.kv_events if e["type"] == "BlockStored" and e["group_idx"] == 1]
        assert swa and all(e["token_ids"] == [] and e["block_size"] == 0 for e in swa)
        assert {(e["kv_cache_spec_kind"], e["kv_cache_spec_sliding_window"]) for e in swa} == {(kind, window)}
        fa = [e for e in w.kv_events if e["type"] == "BlockStored" and e["group_idx"] == 0]
        assert all((e["token_ids"] != []) == (mode == "self_describing") for e in fa) and fa


def test_events_off_publishes_nothing():
    w = _run(OffloadingConfig(num_cpu_chunks=8), [list(range(100, 117))])
    assert w.kv_events == [] and w.b.take_kv_events() == []


def test_a_key_evicted_and_reoffered_in_one_batch_loses_its_snapshot():
    """vLLM 0.33.0: the re-offer's snapshot keeps the old residency, the removal then empties it and
    the end of the batch forgets the snapshot, so the key's next stored event is a placeholder."""
    t = OffloadingEventsTracker(True, True, event_group_specs_full())
    key = make_offload_key(H[1], 0)
    t.record_store(key, t.snapshot(H, list(range(16)), 0, False, 4, 1, 1))
    t.record_store(key, t.snapshot(H, list(range(16)), 0, False, 4, 1, 1))
    out = t.take_events([OffloadingEvent([key], removed=True), OffloadingEvent([key], removed=False)])
    assert out[0].block_hashes == [_ext(H[1])] and out[1].token_ids == [4, 5, 6, 7]
    assert key not in t.pending
    assert t.take_events([OffloadingEvent([key], removed=False)])[0].token_ids == []


def test_a_failed_store_releases_the_snapshot_silently():
    t = OffloadingEventsTracker(True, True, event_group_specs_full())
    key = make_offload_key(H[0], 0)
    t.record_store(key, t.snapshot(H, list(range(16)), 0, False, 4, 1, 0))
    assert t.take_events([OffloadingEvent([key], removed=True, metadata_only=True)]) == []
    assert not t.pending


def event_group_specs_full():
    from tests.hardening.api_targets import FULL

    return event_group_specs([FULL])


def test_bad_input_is_rejected_by_name():
    t = OffloadingEventsTracker(True, True, {0: EventGroupSpec("full_attention", None)})
    with pytest.raises(InvalidFieldError, match="meta"):
        t.record_store(make_offload_key(H[2], 0), t.snapshot(H, list(range(16)), 0, False, 4, 1, 1))
    with pytest.raises(InvalidFieldError, match="chunk_idx"):
        t.snapshot(H, list(range(16)), 0, False, 4, 2, 2)
    with pytest.raises(InvalidFieldError, match="events"):
        t.take_events([("not", "an event")])
    with pytest.raises(InvalidFieldError, match="group_specs"):
        OffloadingEventsTracker(True, True, {0: ("full_attention", None)})
