"""The event-stream watcher (``kvref.models.kv_events.watch``) on streams from the reference.

A clean stream, produced by the reference KV cache manager with events on, must give no finding
and a shadow equal to the pool's own index after every batch. Each stream rule is then broken on
purpose (a batch dropped, duplicated, swapped; a removal of a hash never stored; a store on a
removed parent; a malformed event) and must be flagged; legitimate look-alikes (replay overlap, a
publisher restart, sliding-window parents, joining mid-stream) must not be.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvref.impl.reference.kv_cache_manager import KVCacheManager
from kvref.impl.reference.kv_events import event_to_plain, to_external_block_hash
from kvref.impl.request import Request, RequestStatus
from kvref.models.kv_events.watch import EventStreamWatcher
from kvref.spec.errors import InvalidFieldError

from tests.conftest import profile_examples
from tests.impl.reference.helpers import config, fa, swa


def _index(mgr: KVCacheManager) -> dict:
    """The pool's prefix-cache index as the shadow keys it: (medium, group, external hash) -> entries."""
    out: dict = {}
    pool = mgr.block_pool
    for key, _block in pool.cached_block_hash_to_block.items():  # noqa: PERF102 (one pair per block)
        k = ("GPU", int.from_bytes(key[-4:], "big"), to_external_block_hash(key[:-4], pool.int_block_hashes))
        out[k] = out.get(k, 0) + 1
    return out


def _workload(mgr: KVCacheManager, plan: list[tuple[int, int]]):
    """Batches of plain events, one per step (yielded right after the step, so the pool is still
    in that state), from requests built by ``plan`` ((prefix id, length)); each is admitted with
    its hit, decodes one token and finishes; every 5th step resets."""
    for step, (prefix, length) in enumerate(plan):
        r = Request(f"r{step}", [prefix] * 9 + list(range(length)))
        blocks, hit, _ = mgr.get_computed_blocks(r)
        out = mgr.allocate_slots(r, r.num_tokens - hit, hit, blocks if hit else None)
        if out is not None:
            r.num_computed_tokens, r.status = r.num_tokens, RequestStatus.RUNNING
            r.output_token_ids.append(7)
            if mgr.allocate_slots(r, 1) is not None:
                r.num_computed_tokens += 1
            mgr.free(r)
        if step % 7 == 6:
            mgr.reset_prefix_cache()
        yield [event_to_plain(e) for e in mgr.take_events()]


@pytest.mark.parametrize("specs", [[fa(4)], [fa(4), swa(4, 8)]], ids=["full", "full+swa"])
def test_clean_stream_has_no_finding_and_the_shadow_is_the_index(specs) -> None:
    mgr = KVCacheManager(config(specs, num_blocks=14, enable_kv_cache_events=True))
    w = EventStreamWatcher()
    plan = [(i % 3, 3 + 5 * i % 17) for i in range(23)]
    for seq, events in enumerate(_workload(mgr, plan)):
        assert w.feed(seq, float(seq), events, 0) == []
        w.check_invariants()
        assert w.shadow == _index(mgr), f"shadow != index after batch {seq}"
    s = w.summary()
    assert s["num_findings"] == 0 and s["events"]["BlockRemoved"] > 0 and s["events"]["AllBlocksCleared"] >= 3


@settings(max_examples=profile_examples(15, 60))
@given(plan=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 30)), min_size=6, max_size=20),
       fault=st.sampled_from(["drop", "duplicate", "swap"]), at=st.integers(1, 4))
def test_every_injected_stream_fault_is_flagged(plan, fault, at) -> None:
    mgr = KVCacheManager(config([fa(4)], num_blocks=16, enable_kv_cache_events=True))
    batches = list(enumerate(_workload(mgr, plan)))
    clean = EventStreamWatcher()
    for seq, events in batches:
        clean.feed(seq, 0.0, events, 0)
    assert clean.num_findings == 0 and clean.shadow == _index(mgr)
    if fault == "drop":
        del batches[at]
    elif fault == "duplicate":
        batches.insert(at + 1, batches[at])
    else:
        batches[at], batches[at + 1] = batches[at + 1], batches[at]
    w = EventStreamWatcher()
    for seq, events in batches:
        w.feed(seq, 0.0, events, 0)
        w.check_invariants()
    expected = {"drop": "lost-batches", "duplicate": "duplicate-batch", "swap": "reordered-batch"}[fault]
    assert w.findings_by_rule.get(expected, 0) >= 1, w.summary()
    # a lost or swapped batch leaves the shadow unsure: never a removed-never-stored guess
    assert "removed-never-stored" not in w.findings_by_rule or fault == "duplicate"


def _stored(hashes, parent=None, kind="full_attention", group=0, size=2):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": [1] * (size * len(hashes)), "block_size": size, "lora_id": None, "medium": "GPU",
            "lora_name": None, "extra_keys": [None] * len(hashes) or None, "group_idx": group,
            "kv_cache_spec_kind": kind}


def _removed(h, group=0):
    return {"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU", "group_idx": group}


def test_removal_of_a_hash_never_stored_or_already_removed() -> None:
    w = EventStreamWatcher()
    w.feed(0, 0.0, [_stored([1, 2]), _stored([1])])  # two entries under key 1 (no de-duplication)
    assert w.feed(1, 0.0, [_removed(1), _removed(1), _removed(2)]) == []
    (f,) = w.feed(2, 0.0, [_removed(1)])
    assert f.rule == "removed-never-stored" and "removed at sequence 1" in f.message
    (g,) = w.feed(3, 0.0, [_removed(99, group=1)])
    assert g.rule == "removed-never-stored" and "never stored" in g.message
    w.check_invariants()


def test_a_hash_may_be_stored_again_after_its_removal() -> None:
    w = EventStreamWatcher()
    for seq, events in enumerate([[_stored([5])], [_removed(5)], [_stored([5]), _stored([6], parent=5)],
                                  [_removed(6), _removed(5)]]):
        assert w.feed(seq, 0.0, events) == []
    assert w.shadow == {}


def test_store_on_a_removed_parent_only_in_full_attention_groups() -> None:
    w = EventStreamWatcher()
    w.feed(0, 0.0, [_stored([1]), _stored([1], kind="sliding_window", group=1)])
    w.feed(1, 0.0, [_removed(1), _removed(1, group=1)])
    assert w.feed(2, 0.0, [_stored([2], parent=1, kind="sliding_window", group=1)]) == []
    (f,) = w.feed(3, 0.0, [_stored([2], parent=1)])
    assert f.rule == "store-after-removed-parent" and f.event_index == 0
    assert w.feed(4, 0.0, [_stored([3], parent=77)]) == []  # a parent never seen: not a contradiction


def test_clear_resets_the_shadow_and_makes_it_sure_again() -> None:
    w = EventStreamWatcher()
    w.feed(0, 0.0, [_stored([1])])
    w.feed(2, 0.0, [_removed(42)])  # seq 1 lost: the removal of an unknown hash is not judged
    assert set(w.findings_by_rule) == {"lost-batches"} and w.unknown_removals == 1
    w.feed(3, 0.0, [{"type": "AllBlocksCleared"}])
    assert w.shadow == {} and w.summary()["shadow_sure"]
    (f,) = w.feed(4, 0.0, [_removed(1)])
    assert f.rule == "removed-never-stored"


def test_joining_mid_stream_judges_no_removal() -> None:
    w = EventStreamWatcher()
    assert w.feed(7, 0.0, [_removed(3)]) == [] and w.unknown_removals == 1 and w.first_seq == 7


def test_duplicates_reorders_replay_overlap_restart_and_rank() -> None:
    w = EventStreamWatcher()
    w.feed(0, 0.0, [_stored([1])], 0, source="replay")
    w.feed(1, 0.0, [_stored([2])], 0, source="replay")
    assert w.feed(1, 0.0, [_stored([2])], 0) == []  # the live copy of a replayed batch
    assert w.feed(0, 0.0, [_stored([1])], 0, source="replay") == []  # replay re-sends: by design
    assert w.feed(2, 0.0, [], 0) == []
    (dup,) = w.feed(2, 0.0, [], 0)
    assert dup.rule == "duplicate-batch" and "different" not in dup.message
    (dup2,) = w.feed(2, 1.0, [_stored([9])], 0)
    assert "different content" in dup2.message
    (lost,) = w.feed(5, 0.0, [], 0)
    assert lost.rule == "lost-batches" and "3..4" in lost.message
    (late,) = w.feed(4, 0.0, [], 0)
    assert late.rule == "reordered-batch"
    (rank,) = w.feed(6, 0.0, [], 1)
    assert rank.rule == "rank-changed"
    assert w.feed(0, 9.0, [_stored([5])], 1) == []  # sequence 0 with new content: a restarted publisher
    assert w.restarts == 1 and w.shadow == {("GPU", 0, 5): 1} and w.next_seq == 1
    w.check_invariants()


def test_malformed_and_undecodable() -> None:
    w = EventStreamWatcher()
    bad = _stored([1, 2])
    bad["token_ids"] = [1, 2, 3]
    short = _stored([1, 2])
    short["extra_keys"] = [None]
    found = w.feed(0, 0.0, [bad, short, {"type": "BlockRemoved", "block_hashes": [], "medium": "GPU"},
                            {"type": "Nope"}])
    assert [f.rule for f in found] == ["malformed-event"] * 4
    f = w.feed_undecodable(1, "payload is not msgpack")
    assert f.rule == "undecodable-batch" and w.next_seq == 2
    w.check_invariants()


def test_bad_input_names_the_field() -> None:
    w = EventStreamWatcher()
    with pytest.raises(InvalidFieldError, match="seq"):
        w.feed(-1, 0.0, [])
    with pytest.raises(InvalidFieldError, match="source"):
        w.feed(0, 0.0, [], source="carrier pigeon")
    with pytest.raises(InvalidFieldError, match="events"):
        w.feed(0, 0.0, "BlockStored")  # type: ignore[arg-type]
    with pytest.raises(InvalidFieldError, match="window"):
        EventStreamWatcher(window=0)


def test_findings_kept_are_bounded_but_all_counted() -> None:
    w = EventStreamWatcher(max_findings_kept=3)
    for seq in range(10):
        w.feed(seq, 0.0, [_removed(seq)])
    assert w.num_findings == 10 and len(w.findings) == 3
    w.check_invariants()


def test_remembered_losses_are_bounded_by_the_window() -> None:
    w = EventStreamWatcher(window=8)
    seq = 0
    for _ in range(20):
        w.feed(seq, 0.0, [])
        seq += 3  # two lost each time
    assert w.lost == 38 and len(w._lost) <= 8
    w.check_invariants()
