"""KV cache events of the reference against vLLM 0.33.0's own ``BlockPool`` / ``KVCacheManager``.

Hand traces reach every emission site vLLM has: stores (``cache_full_blocks``), eviction of a
reused cached block (``get_new_blocks``), connector eviction (``evict_blocks``), partial entries
and their promotion (``cache_partial_block`` + ``cache_full_blocks``), report-mode "full" hits
(``emit_cached_block_events``) and ``reset_prefix_cache``. After each call the two event queues
are taken and compared as plain dicts, exactly (hashes as ints and as bytes).
"""

from __future__ import annotations

import pytest
from kvref.impl.interface import PoolConfig
from kvref.impl.reference.adapter import ReferenceKVCacheManager
from kvref.impl.reference.block_hash import RequestBlockHasher
from kvref.impl.reference.block_pool import BlockPool
from kvref.impl.reference.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    event_to_plain,
    kv_cache_spec_kind,
    to_external_block_hash,
)
from kvref.impl.request import Request, RequestStatus
from kvref.spec.errors import InvalidFieldError

from tests.impl.reference.helpers import config, fa, mamba, swa
from tests.vllm_env import require_vllm

# ---------------------------------------------------------------- the reference alone


def test_events_are_off_by_default_and_queue_nothing() -> None:
    pool = BlockPool(8, True, 4)
    req = Request("r", list(range(8)))
    hashes = RequestBlockHasher(4).block_hashes(req)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(hashes, blocks, 0, 2, 4, 0)  # no request needed with events off
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert pool.take_events() == [] and pool.kv_event_queue == []
    pool.check_invariants()


def test_store_evict_reset_sequence_on_the_reference() -> None:
    pool = BlockPool(4, True, 2, enable_kv_cache_events=True, int_block_hashes=False)
    req = Request("r", [1, 2, 3, 4, 5])
    hashes = RequestBlockHasher(2).block_hashes(req)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(hashes, blocks, 0, 1, 2, 0, request=req)
    pool.cache_full_blocks(hashes, blocks, 1, 2, 2, 0, request=req)
    first, second = pool.take_events()
    assert first == BlockStored([hashes[0]], None, [1, 2], 2, None, "GPU", None, [None], 0)
    assert second.parent_block_hash == hashes[0] and second.token_ids == [3, 4]
    pool.free_blocks(reversed(blocks))
    assert pool.take_events() == []  # freeing a cached block removes nothing
    pool.get_new_blocks(3)  # pops the uncached block, then both cached ones: evicted in queue order
    assert [e.block_hashes for e in pool.take_events()] == [[hashes[1]], [hashes[0]]]
    pool.check_invariants()


def test_reset_emits_all_blocks_cleared_only_when_it_succeeds() -> None:
    pool = BlockPool(4, True, 2, enable_kv_cache_events=True)
    held = pool.get_new_blocks(1)
    assert not pool.reset_prefix_cache() and pool.take_events() == []
    pool.free_blocks(held)
    assert pool.reset_prefix_cache() and pool.take_events() == [AllBlocksCleared()]


def test_int_hashes_are_the_low_64_bits_big_endian() -> None:
    h = bytes(range(32))
    assert to_external_block_hash(h, True) == int.from_bytes(h[-8:], "big")
    assert to_external_block_hash(h, False) == h
    assert event_to_plain(BlockRemoved([7], "GPU", 1)) == {
        "type": "BlockRemoved", "block_hashes": [7], "medium": "GPU", "group_idx": 1,
        "locality": None, "ownership": None}


def test_spec_kinds_follow_vllm_names() -> None:
    assert kv_cache_spec_kind(fa(4)) == "full_attention"
    assert kv_cache_spec_kind(swa(4, 8)) == "sliding_window"
    assert kv_cache_spec_kind(mamba(4)) == "mamba"


def test_bad_input_names_the_field() -> None:
    with pytest.raises(InvalidFieldError, match="enable_kv_cache_events"):
        BlockPool(4, True, 2, enable_kv_cache_events="yes")  # type: ignore[arg-type]
    with pytest.raises(InvalidFieldError, match="int_block_hashes"):
        BlockPool(4, True, 2, int_block_hashes=1)  # type: ignore[arg-type]
    with pytest.raises(InvalidFieldError, match="enable_kv_cache_events"):
        config([fa(4)], enable_kv_cache_events=1)
    pool = BlockPool(4, True, 2, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(1)
    with pytest.raises(InvalidFieldError, match="request"):
        pool.cache_full_blocks([b"x" * 32], blocks, 0, 1, 2, 0)


# ---------------------------------------------------------------- against vLLM's BlockPool


class _PoolPair:
    """The reference pool and vLLM's, driven with the same calls; events compared after each."""

    def __init__(self, num_blocks: int, hbs: int) -> None:
        require_vllm()
        from kvref.impl.vllm.loader import load_vllm
        from vllm.v1.core.block_pool import BlockPool as VllmBlockPool

        self.v = load_vllm()
        self.hbs = hbs
        self.ref = BlockPool(num_blocks, True, hbs, enable_kv_cache_events=True)
        self.vpool = VllmBlockPool(num_blocks, True, hbs, enable_kv_cache_events=True)
        self.hasher = RequestBlockHasher(hbs)
        self.vhasher = self.v["utils"].get_request_block_hasher(hbs, self.v["sha256"])
        self.vreqs: dict[str, object] = {}

    def vreq(self, req: Request):
        if req.request_id not in self.vreqs:
            from kvref.impl.vllm.vrequest import vllm_request_from

            self.vreqs[req.request_id] = vllm_request_from(req, carry=frozenset({"cache_salt"}),
                                                           block_hasher=self.vhasher, max_tokens=4)
        return self.vreqs[req.request_id]

    def new(self, n: int) -> list[int]:
        ids = [b.block_id for b in self.ref.get_new_blocks(n)]
        assert ids == [b.block_id for b in self.vpool.get_new_blocks(n)]
        return ids

    def cache(self, req: Request, ids: list[int], start: int, end: int, block_size: int, group: int = 0,
              mask=None) -> None:
        self.ref.cache_full_blocks(self.hasher.block_hashes(req), [self.ref.blocks[i] for i in ids], start, end,
                                   block_size, group, mask, request=req)
        self.vpool.cache_full_blocks(self.vreq(req), [self.vpool.blocks[i] for i in ids], start, end,
                                     block_size, group, mask)

    def partial(self, req: Request, bid: int, num_tokens: int, block_size: int, replace: bool = False) -> None:
        self.ref.cache_partial_block(self.hasher.block_hashes(req), self.ref.blocks[bid], num_tokens, 0,
                                     block_size, replace, request=req)
        self.vpool.cache_partial_block(self.vreq(req), self.vpool.blocks[bid], num_tokens, 0, block_size, replace)

    def free(self, ids: list[int]) -> None:
        self.ref.free_blocks([self.ref.blocks[i] for i in ids])
        self.vpool.free_blocks([self.vpool.blocks[i] for i in ids])

    def compare(self) -> list[dict]:
        from kvref.impl.vllm.kv_events import vllm_event_to_plain

        mine = [event_to_plain(e) for e in self.ref.take_events()]
        theirs = [vllm_event_to_plain(e) for e in self.vpool.take_events()]
        assert mine == theirs
        self.ref.check_invariants()
        return mine


@pytest.mark.vllm
@pytest.mark.parametrize("int_hashes", ["1", "0"])
def test_pool_events_match_vllm_store_evict_connector_reset(monkeypatch, int_hashes: str) -> None:
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", int_hashes)
    p = _PoolPair(6, 2)
    a = Request("a", [1, 2, 3, 4, 5, 6, 7], cache_salt="s")
    b = Request("b", [9, 8, 7, 6, 5])
    ids_a = p.new(3)
    p.cache(a, ids_a, 0, 2, 2)
    p.cache(a, ids_a, 2, 3, 2)
    stored = p.compare()
    assert [e["type"] for e in stored] == ["BlockStored", "BlockStored"]
    assert stored[0]["extra_keys"] == [("s",), None] and stored[1]["extra_keys"] == [None]
    assert isinstance(stored[0]["block_hashes"][0], int if int_hashes == "1" else bytes)
    p.free(list(reversed(ids_a)))
    ids_b = p.new(4)  # 2 never-used blocks, then a's tail and middle are evicted
    assert [e["type"] for e in p.compare()] == ["BlockRemoved", "BlockRemoved"]
    p.cache(b, ids_b, 0, 2, 2)
    p.compare()
    victims = {ids_b[1], ids_a[0]}  # a connector invalidates an in-use and a free block
    p.ref.evict_blocks(victims)  # (vLLM walks the set: the same set gives the same order)
    p.vpool.evict_blocks(victims)
    assert len(p.compare()) == 2
    p.free(ids_b)
    assert p.ref.reset_prefix_cache() and p.vpool.reset_prefix_cache()
    assert p.compare() == [{"type": "AllBlocksCleared"}]


@pytest.mark.vllm
def test_pool_events_match_vllm_masked_and_null_blocks() -> None:
    """A range whose blocks are all masked still emits a BlockStored with no hashes."""
    p = _PoolPair(6, 2)
    a = Request("a", list(range(10)))
    ids = p.new(4)
    p.cache(a, ids, 0, 3, 2, mask=[False, True, False])
    p.cache(a, ids, 3, 4, 2, mask=[False])
    events = p.compare()
    assert events[0]["block_hashes"] and len(events[0]["block_hashes"]) == 1
    assert events[1]["block_hashes"] == [] and events[1]["extra_keys"] is None


@pytest.mark.vllm
def test_pool_events_match_vllm_partial_entries_and_promotion() -> None:
    """hash_block_size 2 < block_size 4: a partial entry, a re-key, its promotion to full."""
    p = _PoolPair(6, 2)
    a = Request("a", list(range(1, 12)))
    ids = p.new(2)
    p.partial(a, ids[0], 2, 4)
    p.partial(a, ids[0], 2, 4)  # already cached: no event
    p.partial(a, ids[1], 6, 4)
    assert [e["type"] for e in p.compare()] == ["BlockStored", "BlockStored"]
    p.cache(a, ids, 0, 2, 4)  # promotion: the partial keys are removed, then one store
    assert [e["type"] for e in p.compare()] == ["BlockRemoved", "BlockRemoved", "BlockStored"]
    p.partial(a, ids[1], 6, 4, replace=True)
    assert [e["type"] for e in p.compare()] == ["BlockRemoved", "BlockStored"]


@pytest.mark.vllm
def test_pool_events_match_vllm_report_mode_full_hits() -> None:
    p = _PoolPair(6, 2)
    a = Request("a", list(range(7)), cache_salt="x")
    p.ref.emit_cached_block_events(a, p.hasher.block_hashes(a), 3, 2, 0)
    p.vpool.emit_cached_block_events(p.vreq(a), 3, 2, 0)
    p.ref.emit_cached_block_events(a, p.hasher.block_hashes(a), 0, 2, 0)
    p.vpool.emit_cached_block_events(p.vreq(a), 0, 2, 0)
    (event,) = p.compare()
    assert event["parent_block_hash"] is None and len(event["block_hashes"]) == 3


# ---------------------------------------------------------------- against vLLM's KVCacheManager


def _managers(cfg: PoolConfig):
    require_vllm()
    from kvref.impl.vllm.kv_cache_manager import VllmKVCacheManager

    return ReferenceKVCacheManager(cfg), VllmKVCacheManager(cfg)


def _both(ref, vllm, fn) -> list[dict]:
    out = fn(ref), fn(vllm)
    assert out[0] == out[1]
    events = ref.take_kv_events()
    assert events == vllm.take_kv_events()
    ref.check_invariants()
    return events


@pytest.mark.vllm
@pytest.mark.parametrize("specs", [[fa(4)], [fa(4), swa(4, 8)]], ids=["full", "full+swa"])
def test_manager_events_match_vllm_with_spec_metadata(specs) -> None:
    cfg = config(specs, num_blocks=12, enable_kv_cache_events=True)
    ref, vllm = _managers(cfg)
    reqs = [Request(f"r{i}", [i % 2] * 17 + [i], cache_salt=None) for i in range(3)]
    seen: list[dict] = []
    for r in reqs:
        ids, n = ref.get_computed_blocks(r)
        assert (ids, n) == vllm.get_computed_blocks(r)
        seen += _both(ref, vllm, lambda m, r=r, n=n, ids=ids: m.allocate_slots(r, r.num_tokens - n, n,
                                                                              ids if n else None))
        r.num_computed_tokens = r.num_tokens
        r.status = RequestStatus.RUNNING
        r.output_token_ids.append(5)
        seen += _both(ref, vllm, lambda m, r=r: m.allocate_slots(r, 1))
        r.num_computed_tokens += 1
        seen += _both(ref, vllm, lambda m, r=r: m.free(r))
    big = Request("big", list(range(100, 124)))
    seen += _both(ref, vllm, lambda m: m.allocate_slots(big, 24))  # reuses cached blocks: evictions
    seen += _both(ref, vllm, lambda m: m.free(big))
    seen += _both(ref, vllm, lambda m: m.reset_prefix_cache())
    kinds = {e["type"] for e in seen}
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    stores = [e for e in seen if e["type"] == "BlockStored"]
    assert {e["kv_cache_spec_kind"] for e in stores} == {"full_attention", "sliding_window"} & {
        kv_cache_spec_kind(s) for s in specs}
    if len(specs) == 2:
        assert {e["kv_cache_spec_sliding_window"] for e in stores if e["group_idx"] == 1} == {8}


@pytest.mark.vllm
def test_manager_without_events_flag_emits_nothing() -> None:
    ref, vllm = _managers(config([fa(4)], num_blocks=8))
    r = Request("r", list(range(9)))
    _both(ref, vllm, lambda m: m.allocate_slots(r, 9))
    assert ref.take_kv_events() == [] == vllm.take_kv_events()


# ---------------------------------------------------------------- generated traces (the harness)


@pytest.mark.vllm
def test_generated_traces_compare_event_streams_through_stores_evictions_and_resets(tmp_path) -> None:
    """The conformance machine on small pools (evictions) compares the two event streams after
    every op; over a few seeded runs the streams went through all three event types."""
    require_vllm()
    from kvref.models.machines.kv_cache_manager import run_machine

    seen: dict[str, int] = {}
    resets = 0
    for seed in (7, 2, 11, 5):  # seeded runs until every event type went through (bounded)
        run = run_machine(("reference", "vllm"), 20, steps=40, min_steps=30, seed=seed, out_dir=str(tmp_path),
                          shrink=False, group_sets=("fa", "fa+swa", "fa+fa"), max_blocks=16)
        assert run.ok, run.failure
        for kind, n in run.stats.kv_events.items():
            seen[kind] = seen.get(kind, 0) + n
        resets += run.stats.resets
        if len(seen) == 3:
            break
    assert set(seen) == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}, seen
    assert resets == seen["AllBlocksCleared"]


@pytest.mark.vllm
def test_a_planted_difference_in_the_reference_events_is_caught(monkeypatch, tmp_path) -> None:
    """The reference's stores lose their parent hash: the state is unchanged (same blocks, same
    hashes), only the event stream differs, and conformance must say so."""
    require_vllm()
    from kvref.models.machines.kv_cache_manager import run_machine

    real = BlockPool._block_stored

    def without_parent(self, *args, **kwargs):
        event = real(self, *args, **kwargs)
        event.parent_block_hash = None
        return event

    monkeypatch.setattr(BlockPool, "_block_stored", without_parent)
    run = run_machine(("reference", "vllm"), 20, steps=40, min_steps=30, seed=3, out_dir=str(tmp_path),
                      shrink=False)
    assert not run.ok and run.signature.endswith(": KV cache events differ"), run.failure
    assert "parent_block_hash" in run.failure or "KV cache events differ at event" in run.failure


def test_a_bad_hash_format_variable_is_named(monkeypatch) -> None:
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "yes")
    BlockPool(4, True, 2)  # a pool without events never reads it
    with pytest.raises(InvalidFieldError, match="VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"):
        BlockPool(4, True, 2, enable_kv_cache_events=True)


@pytest.mark.vllm
def test_report_mode_full_hits_are_announced_like_vllm() -> None:
    """A request with ``kv_cache_report_mode == "full"`` (vLLM: SamplingParams.extra_args) gets a
    BlockStored per group for its prefix-cache hit from ``get_computed_blocks``, state unchanged."""
    ref, vllm = _managers(config([fa(4), swa(4, 8)], num_blocks=16, enable_kv_cache_events=True))
    first = Request("first", list(range(13)))
    _both(ref, vllm, lambda m: m.allocate_slots(first, 13))
    _both(ref, vllm, lambda m: m.free(first))
    again = Request("again", list(range(13)) + [99])
    again.kv_cache_report_mode = "full"  # type: ignore[attr-defined]
    vllm.vllm_request(again).kv_cache_report_mode = "full"
    events = _both(ref, vllm, lambda m: m.get_computed_blocks(again))
    assert [(e["type"], e["group_idx"], e["parent_block_hash"]) for e in events] == [
        ("BlockStored", 0, None), ("BlockStored", 1, None)]
    plain = Request("plain", list(range(13)) + [98])
    assert _both(ref, vllm, lambda m: m.get_computed_blocks(plain)) == []  # "incremental": no event


@pytest.mark.vllm
def test_scheduler_steps_publish_the_same_batches_as_vllms_scheduler() -> None:
    """The reference Scheduler and vLLM's own Scheduler in lock step: after every
    ``update_from_output`` the batch the reference scheduler publishes must equal the one vLLM's
    scheduler publishes (``VllmScheduler`` replaces its ``kv_event_publisher`` by a capture; vLLM
    publishes only non-empty batches). Small pool, shared prefixes: stores, hits, evictions, preemptions, then resets."""
    require_vllm()
    from kvref.impl.reference.scheduler import Scheduler
    from kvref.impl.scheduler_types import ModelOutput, SchedulerConfig
    from kvref.impl.vllm.scheduler import VllmEnv, VllmScheduler

    cfg = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=3)
    pool = config([fa(4)], num_blocks=12, max_model_len=64, enable_kv_cache_events=True,
                  max_in_flight_tokens=cfg.max_in_flight_tokens)
    theirs = VllmScheduler(pool, cfg, VllmEnv())  # events on in the pool: vLLM's publisher is captured
    ours = Scheduler(pool, cfg)
    seen: dict[str, int] = {}
    for round_ in range(3):
        for i in range(4):
            r = Request(f"q{round_}.{i}", [i % 2] * 9 + [round_, i] * 4, max_tokens=4, arrival_time=float(i))
            ours.add_request(r)
            theirs.add_request(Request(r.request_id, list(r.prompt_token_ids), max_tokens=4,
                                       arrival_time=float(i)))
        for step in range(60):  # bounded: a round ends in a few dozen steps
            if not ours.has_unfinished_requests():
                break
            a, b = ours.schedule(), theirs.schedule()
            assert [(x.request_id, x.num_scheduled_tokens) for x in a.scheduled] == \
                [(x.request_id, x.num_scheduled_tokens) for x in b.scheduled]
            sampled = ModelOutput({x.request_id: [7] for x in a.scheduled if not x.is_prefill_chunk})
            ours.update_from_output(a, sampled)
            theirs.update_from_output(b, sampled)
            mine = ours.take_published_kv_events()  # what the reference's update_from_output published
            assert len(mine) <= 1 and mine == theirs.take_published_kv_events(), f"round {round_} step {step}"
            for e in (mine[0] if mine else []):
                seen[e["type"]] = seen.get(e["type"], 0) + 1
        assert not theirs.has_unfinished_requests()
        assert ours.kv_cache_manager.reset_prefix_cache() and theirs.scheduler.kv_cache_manager.reset_prefix_cache()
        ours.update_from_output(ours.schedule(), ModelOutput())
        theirs.update_from_output(theirs.schedule(), ModelOutput())
        assert ours.take_published_kv_events() == theirs.take_published_kv_events() == [[{"type": "AllBlocksCleared"}]]
    assert set(seen) == {"BlockStored", "BlockRemoved"}, seen
