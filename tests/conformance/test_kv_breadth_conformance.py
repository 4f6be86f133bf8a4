"""Issue #23: block-hash inputs, hash functions, stats and connector views against vLLM 0.33.0.

Every test compares the reference with vLLM's own code on generated inputs:

* request block hashes (multimodal items, LoRA, prompt embeds, cache salt, hash lookahead) for
  each of vLLM's four hash functions and NONE_HASH seeds, byte for byte, as output tokens arrive;
* ``resolve_block_hashes`` on fine lists and on views (the reference re-wrapped a view);
* ``free`` while a connector holds the ``get_blocks()`` view (the reference reversed it in place);
* the state machine with every issue-#23 input drawn, on the group sets without Mamba (whose
  prefix caching another part of the issue models), comparing hashes, events, stats, usage and
  connector views after every op.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

from kvref.impl.interface import PoolConfig, make_manager
from kvref.impl.reference import block_hash as bh
from kvref.impl.reference.block_pool import BlockPoolCore
from kvref.impl.reference.single_type_manager import SingleTypeKVCacheManager
from kvref.impl.request import LoRARequest, MultiModalFeatureSpec, PlaceholderRange, Request, RequestStatus
from kvref.models.conformance.differential import Divergence, Harness
from kvref.models.conformance.trace import Op
from kvref.models.machines.kv_cache_manager import kv_cache_manager_machine
from kvref.models.strategies.hash_inputs import hashing_settings, request_hash_inputs
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

#: the group sets whose managers this part of issue #23 owns (Mamba prefix caching is modelled by
#: another part, and its own conformance test covers it)
NON_MAMBA_GROUP_SETS = ("fa", "fa+fa", "fa+swa", "fa+chunked", "fa+swa+swa", "swa")


@pytest.fixture(scope="module")
def vllm_adapter():
    require_vllm()
    import kvref.impl.vllm.kv_cache_manager as adapter  # noqa: PLC0415 - imports vLLM once per module

    return adapter


def _pool(block_size: int = 4, num_blocks: int = 32, max_model_len: int = 96, swa: bool = False,
          **hashing) -> PoolConfig:
    fa = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype="float16")
    groups = [KVCacheGroupSpec(("full",), fa)]
    if swa:
        groups.append(KVCacheGroupSpec(("swa",), SlidingWindowSpec(
            block_size=block_size, num_kv_heads=1, head_size=8, dtype="float16", sliding_window=2 * block_size)))
    return PoolConfig(num_blocks=num_blocks, groups=tuple(groups), max_model_len=max_model_len,
                      scheduler_block_size=block_size, hash_block_size=block_size, **hashing)


def _request(rid: str, prompt: list[int], extras: dict) -> Request:
    """A request from the ``add`` op fields ``request_hash_inputs`` draws."""
    return Request(rid, prompt, cache_salt=extras.get("cache_salt"),
                   mm_features=tuple(MultiModalFeatureSpec(i, PlaceholderRange(o, n)) for i, o, n in extras.get("mm", ())),
                   lora_request=LoRARequest(*extras["lora"]) if extras.get("lora") else None,
                   prompt_embeds=tuple(bytes.fromhex(r) for r in extras["embeds"]) if extras.get("embeds") else None,
                   session_id=extras.get("session_id"), skip_reading_prefix_cache=extras.get("skip_reading", False))


@st.composite
def _hash_cases(draw):
    hashing = draw(hashing_settings())
    hashing["use_eagle"] = False
    bs = draw(st.sampled_from((1, 2, 4, 16)))
    prompt = draw(st.lists(st.integers(0, 5), min_size=1, max_size=48))
    extras = draw(request_hash_inputs(prompt))
    extras["cache_salt"] = draw(st.sampled_from((None, None, "salt")))
    outputs = draw(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=5), max_size=4))
    return hashing, bs, prompt, extras, outputs


@settings(max_examples=profile_examples(40, 150), deadline=None)
@given(case=_hash_cases())
def test_request_block_hashes_are_vllms(vllm_adapter, case):
    """The reference's chained hashes equal vLLM's ``Request.block_hashes`` byte for byte, for
    every hash function, seed and lookahead, with every extra-key input, as tokens are appended."""
    hashing, bs, prompt, extras, outputs = case
    pool = _pool(block_size=bs, max_model_len=128, **hashing)
    ref, vllm = make_manager("reference", pool), make_manager("vllm", pool)
    req = _request("r", prompt, extras)
    for chunk in [[]] + outputs:
        req.output_token_ids.extend(chunk)
        ours, theirs = ref.request_block_hashes(req), vllm.request_block_hashes(req)
        assert ours == theirs
        assert len(ours) == max(0, req.num_tokens - hashing["num_hash_lookahead_tokens"]) // bs


def test_extra_inputs_change_exactly_the_blocks_they_touch(vllm_adapter):
    """A multimodal item spanning blocks 1-2 keys both (with its offset relative to each), a LoRA
    adapter every block, a salt only the first; vLLM agrees on every hash."""
    pool = _pool(block_size=4)
    plain = Request("p", list(range(16)))
    mm = Request("m", list(range(16)), mm_features=(MultiModalFeatureSpec("img", PlaceholderRange(6, 4)),))
    assert bh.generate_block_hash_extra_keys(mm, 4, 8) == (("mm", "img", 2),)
    assert bh.generate_block_hash_extra_keys(mm, 8, 12) == (("mm", "img", -2),)
    salted = Request("s", list(range(16)), cache_salt="x")
    lora = Request("l", list(range(16)), lora_request=LoRARequest("a", 1, "/a"))
    repointed = Request("l2", list(range(16)), lora_request=LoRARequest("a", 1, "/a-v2"))
    ref, vllm = make_manager("reference", pool), make_manager("vllm", pool)
    hashes = {r.request_id: ref.request_block_hashes(r) for r in (plain, mm, salted, lora, repointed)}
    for r in (plain, mm, salted, lora, repointed):
        assert hashes[r.request_id] == vllm.request_block_hashes(r)
    # chained: the first block that differs makes every later hash differ
    assert hashes["m"][0] == hashes["p"][0] and hashes["m"][1] != hashes["p"][1]
    assert all(a != b for a, b in zip(hashes["s"], hashes["p"]))
    assert all(a != b for a, b in zip(hashes["l"], hashes["l2"]))  # the path is hashed, not only the name


def test_none_hash_seed_rule_is_vllms(vllm_adapter, monkeypatch):
    """NONE_HASH's seed: PYTHONHASHSEED if set, else fixed for the SHA-256 functions, random per
    initialisation for xxhash (vLLM #12621); a reference told vLLM's random seed agrees with it."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert bh.resolve_none_hash_seed(bh.sha256_cbor) == bh.DEFAULT_NONE_HASH_SEED
    a, b = bh.resolve_none_hash_seed(bh.xxhash), bh.resolve_none_hash_seed(bh.xxhash_cbor)
    assert a != b and len(a) == len(b) == 64
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    assert bh.resolve_none_hash_seed(bh.xxhash) == "7"
    monkeypatch.delenv("PYTHONHASHSEED")
    theirs = make_manager("vllm", _pool(prefix_caching_hash_algo="xxhash"))
    assert len(theirs.none_hash_seed) == 64 and theirs.none_hash_seed != bh.DEFAULT_NONE_HASH_SEED
    ours = make_manager("reference", _pool(prefix_caching_hash_algo="xxhash", none_hash_seed=theirs.none_hash_seed))
    stranger = make_manager("reference", _pool(prefix_caching_hash_algo="xxhash"))
    req = Request("r", list(range(12)))
    assert ours.request_block_hashes(req) == theirs.request_block_hashes(req)
    assert stranger.request_block_hashes(req) != theirs.request_block_hashes(req)
    assert os.environ.get("PYTHONHASHSEED") is None  # the adapter restored the environment


@settings(max_examples=profile_examples(40, 150), deadline=None)
@given(hbs=st.sampled_from((1, 2, 4)), k=st.sampled_from((1, 2, 4)), n=st.integers(0, 24), as_view=st.booleans())
def test_resolve_block_hashes_is_vllms(vllm_adapter, hbs, k, n, as_view):
    """A group's view of the fine hashes, for fine lists and for lists that already are a view
    at the group's block size (vLLM returns those unchanged; the reference wrapped them again,
    scaling them twice, before issue #23)."""
    fine = [bytes([i]) * 4 for i in range(n)]
    block_size = hbs * k
    given_hashes = bh.BlockHashListWithBlockSize(fine, hbs, block_size) if as_view and k > 1 else fine
    ours = list(bh.resolve_block_hashes(given_hashes, hbs, block_size))
    theirs = vllm_adapter.vllm_resolve_block_hashes(fine, hbs, block_size, block_size if as_view else None)
    assert ours == theirs


def _free_trace(hold_view: bool) -> list[Op]:
    return [Op("add", dict(rid="a", prompt=list(range(13)), max_tokens=2, cache_salt=None)),
            Op("admit", dict(rid="a", chunk=13, full_sequence_must_fit=False, reserved_blocks=0,
                             in_flight=False, token=1)),
            Op("finish", dict(rid="a", hold_view=hold_view))]


def test_free_leaves_a_held_block_list_in_table_order(vllm_adapter):
    """A connector holding ``get_blocks()`` across ``free`` still reads the table in order on
    vLLM and on the reference; with the old in-place ``reverse()`` the harness reports it."""
    pool = _pool(block_size=4, swa=True)
    h = Harness(pool, ["reference", "vllm"])
    for op in _free_trace(hold_view=True):
        h.apply(op)
    assert h.num_held_views == 1
    assert h.managers["reference"].get_num_free_blocks() == pool.num_blocks - 1


def test_free_reversing_in_place_is_caught(vllm_adapter, monkeypatch):
    """The pre-#23 reference (``blocks.reverse()`` on the popped table) fails the same trace."""
    def old_free(self, request_id):
        blocks = self.pop_blocks_for_free(request_id)
        if blocks:
            blocks.reverse()
            BlockPoolCore.free_blocks(self.block_pool, blocks)

    monkeypatch.setattr(SingleTypeKVCacheManager, "free", old_free)
    h = Harness(_pool(block_size=4, swa=True), ["reference", "vllm"])
    with pytest.raises(Divergence, match="get_blocks"):
        for op in _free_trace(hold_view=True):
            h.apply(op)


def test_stats_count_admissions_preemptions_and_resets(vllm_adapter):
    """``make_prefix_cache_stats`` after a hit, a re-admission of a preempted request and a
    reset: the same counters on both, and each call starts fresh."""
    pool = _pool(block_size=4, log_stats=True)
    h = Harness(pool, ["reference", "vllm"])
    prompt = list(range(10))
    ops = [Op("add", dict(rid="a", prompt=prompt, max_tokens=1, cache_salt=None)),
           Op("admit", dict(rid="a", chunk=10, full_sequence_must_fit=False, reserved_blocks=0, in_flight=False,
                            token=1)),
           Op("add", dict(rid="b", prompt=prompt + [7], max_tokens=4, cache_salt=None)),
           Op("admit", dict(rid="b", chunk=16, full_sequence_must_fit=False, reserved_blocks=0, in_flight=False,
                            token=2)),
           Op("preempt", dict(rid="b")),
           Op("admit", dict(rid="b", chunk=16, full_sequence_must_fit=False, reserved_blocks=0, in_flight=False,
                            token=3))]
    for op in ops:
        h.apply(op)
    stats = h.apply(Op("make_prefix_cache_stats", {})).value
    assert (stats["requests"], stats["queries"], stats["hits"]) == (2, 10 + 11, 8)
    assert stats["preempted_requests"] == 1 and stats["preempted_hits"] > 0 and not stats["reset"]
    h.apply(Op("finish", dict(rid="b")))
    assert h.apply(Op("reset_prefix_cache", dict(reset_running_requests=False))).value is True
    assert h.apply(Op("make_prefix_cache_stats", {})).value == {
        "reset": True, "requests": 0, "queries": 0, "hits": 0, "preempted_requests": 0,
        "preempted_queries": 0, "preempted_hits": 0, "hits_by_source": {}}


def test_skip_reading_prefix_cache_never_hits_nor_counts(vllm_adapter):
    pool = _pool(block_size=4, log_stats=True)
    ref, vllm = make_manager("reference", pool), make_manager("vllm", pool)
    first, again = Request("a", list(range(9))), Request("b", list(range(9)), skip_reading_prefix_cache=True)
    for m in (ref, vllm):
        m.allocate_slots(first, 9)
        assert m.get_computed_blocks(again) == (((),), 0)
        m.record_prefix_cache_stats(again, 0)
        assert m.make_prefix_cache_stats()["queries"] == 0


def test_connector_views(vllm_adapter):
    """``get_block_ids_for_computed_tokens`` cuts token-indexed groups at cdiv(n, block size);
    ``truncate_computed_blocks`` slices a hit without touching it; both equal vLLM's."""
    pool = _pool(block_size=4, swa=True)
    ref, vllm = make_manager("reference", pool), make_manager("vllm", pool)
    a, b = Request("a", list(range(17))), Request("b", list(range(17)) + [9])
    for m in (ref, vllm):
        m.allocate_slots(a, 17)
    a.num_computed_tokens, a.status = 17, RequestStatus.RUNNING
    for n in (0, 1, 4, 5, 17):
        assert ref.get_block_ids_for_computed_tokens("a", n) == vllm.get_block_ids_for_computed_tokens("a", n)
    assert ref.estimate_cached_tokens(a) == vllm.estimate_cached_tokens(a) == 16
    hit_ref, hit_vllm = ref.get_computed_blocks_for_connector(b), vllm.get_computed_blocks_for_connector(b)
    assert hit_ref == hit_vllm and hit_ref[1] == 16 and hit_ref[3] is False
    for end in (0, 8, 16):
        assert ref.truncate_computed_blocks(hit_ref[0], end) == vllm.truncate_computed_blocks(hit_vllm[0], end)
    ref.check_invariants()
    vllm.check_invariants()


def test_machine_with_every_issue_23_input(vllm_adapter):
    """The conformance machine with hash inputs, hash functions, seeds, lookahead, stats and
    connector ops drawn; everything observable compared after every op. It must reach them."""
    machine = kv_cache_manager_machine(("reference", "vllm"), group_sets=NON_MAMBA_GROUP_SETS)
    run_state_machine_as_test(machine, _min_steps=31, settings=settings(
        max_examples=profile_examples(20, 120), stateful_step_count=40, deadline=None))
    st_ = machine.stats
    assert st_.rules.get("connector_lookup", 0) > 0 and st_.rules.get("make_prefix_cache_stats", 0) > 0
    assert st_.prefix_hits > 0 and sum(st_.kv_events.values()) > 0


def test_resolve_rewrapping_a_view_is_caught(vllm_adapter):
    """The pre-#23 reference (a view wrapped again) differs from vLLM on a view it is handed."""
    fine = [bytes([i]) * 4 for i in range(8)]
    view = bh.BlockHashListWithBlockSize(fine, 1, 2)
    rewrapped = list(bh.BlockHashListWithBlockSize(view, 1, 2))  # what the old code returned
    assert rewrapped != vllm_adapter.vllm_resolve_block_hashes(fine, 1, 2, view_block_size=2)
    assert list(bh.resolve_block_hashes(view, 1, 2)) == vllm_adapter.vllm_resolve_block_hashes(fine, 1, 2, 2)
    with pytest.raises(ValueError, match="block_hashes"):
        bh.resolve_block_hashes(view, 1, 4)  # a view at another block size


def test_full_report_mode_announces_hits(vllm_adapter):
    """``kv_cache_report_mode="full"``: a prefix-cache hit is announced as ``BlockStored`` from
    block 0 (no parent), with the request's LoRA, session and extra keys, on both."""
    pool = _pool(block_size=4, enable_kv_cache_events=True, swa=True)
    ref, vllm = make_manager("reference", pool), make_manager("vllm", pool)
    lora = LoRARequest("a", 1, "/a")
    first = Request("a", list(range(13)), lora_request=lora, session_id="s")
    again = Request("b", list(range(13)) + [5], lora_request=lora, session_id="s", kv_cache_report_mode="full")
    for m in (ref, vllm):
        m.allocate_slots(first, 13)
        m.take_kv_events()
        assert m.get_computed_blocks(again)[1] == 12
    ours, theirs = ref.take_kv_events(), vllm.take_kv_events()
    assert ours == theirs and len(ours) == 2
    assert all(e["parent_block_hash"] is None and e["lora_name"] == "a" and e["session_id"] == "s" for e in ours)
