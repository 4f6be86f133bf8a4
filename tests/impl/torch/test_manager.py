"""Unit tests of the torch bookkeeping: vLLM-documented examples, hashing, bad input, invariants."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvref.impl.interface import KVCacheManagerLike, PoolConfig
from kvref.impl.request import Request
from kvref.impl.torch import TorchKVCacheManager, make_manager
from kvref.impl.torch.block_pool import TorchBlockPool
from kvref.impl.torch.block_table import slot_mapping
from kvref.impl.torch.hashing import DEFAULT_NONE_HASH_SEED, RequestHashes, hash_block_tokens, none_hash, sha256_pickle
from kvref.spec.errors import InvalidFieldError
from kvref.spec.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from tests.vllm_env import require_vllm

KW = dict(num_kv_heads=1, head_size=2, dtype="float32")


def cfg(*specs, num_blocks=16, hbs=4, sbs=4, **kw):
    return PoolConfig(num_blocks=num_blocks, groups=tuple(KVCacheGroupSpec((f"g{i}",), s) for i, s in enumerate(specs)),
                      max_model_len=64, scheduler_block_size=sbs, hash_block_size=hbs, **kw)


FA = FullAttentionSpec(block_size=4, **KW)


def test_protocol_and_factory():
    m = make_manager(cfg(FA), device="cpu")
    assert isinstance(m, KVCacheManagerLike)
    from kvref.impl import interface
    if hasattr(interface, "_BUILTIN_MODULES"):
        assert type(interface.make_manager("torch", cfg(FA))) is TorchKVCacheManager


def test_free_queue_prepends_scratch_and_appends_cached_blocks():
    """vLLM 0.33.0 ``free_blocks``: unhashed blocks go to the front (LIFO), hashed ones to the back."""
    m = make_manager(cfg(FA, num_blocks=8), device="cpu")
    r = Request("a", list(range(10)))
    assert m.allocate_slots(r, 10) == ((1, 2, 3),)
    assert m.free_block_queue() == (4, 5, 6, 7)
    m.free(r)  # blocks 1, 2 are full (hashed); block 3 holds 2 tokens (scratch)
    assert m.free_block_queue() == (3, 4, 5, 6, 7, 2, 1)
    assert set(m.cached_blocks()) == {(0, 1), (0, 2)}
    m.check_invariants()


def test_sliding_window_hit_is_nulls_then_the_window_blocks():
    """vLLM's docstring example: block size 4, window 8 -> a hit looks like [NULL, NULL, b, b]."""
    swa = SlidingWindowSpec(block_size=4, sliding_window=8, **KW)
    m = make_manager(cfg(swa, num_blocks=20), device="cpu")
    a = Request("a", list(range(20)))
    assert m.allocate_slots(a, 20) is not None
    b = Request("b", list(range(17)) + [99])
    ids, hit = m.get_computed_blocks(b)
    assert hit == 16 and ids[0][:2] == (0, 0) and 0 not in ids[0][2:] and len(ids[0]) == 4
    m.check_invariants()


def test_eagle_drops_the_last_hit_block():
    m = make_manager(cfg(FA, num_blocks=20, use_eagle=True), device="cpu")
    a = Request("a", list(range(13)))
    m.allocate_slots(a, 13)
    ids, hit = m.get_computed_blocks(Request("b", list(range(13)) + [5]))
    assert (ids, hit) == (((1, 2),), 8)  # 3 cached blocks match, the last is dropped


def test_chunked_local_hit_counts_earlier_chunks_as_computed():
    local = ChunkedLocalAttentionSpec(block_size=4, attention_chunk_size=8, **KW)
    m = make_manager(cfg(local, num_blocks=20), device="cpu")
    ids, hit = m.get_computed_blocks(Request("a", list(range(18))))
    assert ids == ((0, 0, 0, 0),) and hit == 16  # everything before the last chunk start


def test_mamba_keeps_only_the_last_state_block_plus_speculative_blocks():
    mamba = MambaSpec(block_size=4, shapes=((2,),), dtypes=("float32",), num_speculative_blocks=1)
    m = make_manager(cfg(FA, mamba, num_blocks=20, enable_caching=False), device="cpu")
    r = Request("a", list(range(10)))
    assert m.allocate_slots(r, 10) == ((1, 2, 3), (4, 5, 6, 7))  # cdiv(10 + 4, 4) state blocks
    r.num_computed_tokens = 10
    r.output_token_ids.append(1)
    m.allocate_slots(r, 1)
    assert m.get_block_ids("a")[1] == (0, 0, 6, 7)  # state of token 9 lives in block index 2
    m.check_invariants()


def test_block_tables_and_slot_mapping_are_int32_device_tensors():
    m = make_manager(cfg(FA, num_blocks=12), device="cpu")
    a, b = Request("a", list(range(6))), Request("b", list(range(50, 59)))
    m.allocate_slots(a, 6)
    m.allocate_slots(b, 9)
    table, lens = m.batch_block_tables(0, ["b", "a"])
    assert table.dtype == torch.int32 and lens.dtype == torch.int32
    assert table[0, :3].tolist() == [3, 4, 5] and table[1, :2].tolist() == [1, 2] and lens.tolist() == [3, 2]
    slots = slot_mapping(table, torch.tensor([0, 5, 8]), 4, torch.tensor([1, 1, 0]))
    assert slots.tolist() == [1 * 4 + 0, 2 * 4 + 1, 5 * 4 + 0]
    with pytest.raises(InvalidFieldError):
        m.batch_block_tables(0, ["nobody"])
    with pytest.raises(InvalidFieldError):
        m.batch_block_tables(3, ["a"])


def test_hashes_chain_and_salt_only_the_first_block():
    h = RequestHashes(2)
    plain = h.get(Request("a", [1, 2, 3, 4, 5]))
    assert len(plain) == 2
    assert plain[0] == sha256_pickle((none_hash(), (1, 2), None))
    assert plain[1] == hash_block_tokens(plain[0], [3, 4])
    salted = RequestHashes(2).get(Request("b", [1, 2, 3, 4], cache_salt="x"))
    assert salted[0] == sha256_pickle((none_hash(), (1, 2), (("cache_salt", "x"),)))
    assert salted[1] == hash_block_tokens(salted[0], [3, 4])


def test_none_hash_seed_follows_pythonhashseed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert none_hash() == sha256_pickle(DEFAULT_NONE_HASH_SEED)
    monkeypatch.setenv("PYTHONHASHSEED", "123")
    assert none_hash() == sha256_pickle("123")


@pytest.mark.vllm
@settings(max_examples=30)
@given(tokens=st.lists(st.integers(0, 50000), min_size=0, max_size=40), hbs=st.sampled_from([1, 2, 4, 16]),
       salt=st.sampled_from([None, "", "salt"]), seed=st.sampled_from([None, "0", "42"]))
def test_hashes_equal_vllms(tokens, hbs, salt, seed):
    require_vllm()
    import os

    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request as VRequest

    old = os.environ.pop("PYTHONHASHSEED", None)
    try:
        if seed is not None:
            os.environ["PYTHONHASHSEED"] = seed
        kv_cache_utils.init_none_hash(sha256)
        prompt = tokens or [0]
        v = VRequest("r", prompt, SamplingParams(max_tokens=1), None, cache_salt=salt,
                     block_hasher=kv_cache_utils.get_request_block_hasher(hbs, sha256))
        ours = RequestHashes(hbs).get(Request("r", prompt, cache_salt=salt))
        assert ours == [bytes(h) for h in v.block_hashes]
        assert none_hash() == bytes(kv_cache_utils.NONE_HASH)
    finally:
        os.environ.pop("PYTHONHASHSEED", None)
        if old is not None:
            os.environ["PYTHONHASHSEED"] = old
        kv_cache_utils.init_none_hash(sha256)


@pytest.mark.parametrize("build,field", [
    (lambda: cfg(MambaSpec(block_size=4, shapes=((2,),), dtypes=("float32",))), "enable_caching"),
    (lambda: cfg(MambaSpec(block_size=4, shapes=((2,),), dtypes=("float32",), mamba_cache_mode="align")),
     "kv_cache_spec"),
    (lambda: cfg(CrossAttentionSpec(block_size=4, **KW)), "kv_cache_spec"),
    (lambda: cfg(ChunkedLocalAttentionSpec(block_size=4, attention_chunk_size=8, **KW), use_eagle=True), "use_eagle"),
    (lambda: cfg(FullAttentionSpec(block_size=4, **KW), hbs=2), "hash_block_size"),
    (lambda: cfg(FA, ChunkedLocalAttentionSpec(block_size=4, attention_chunk_size=8, **KW), sbs=8, hbs=4), "scheduler_block_size"),
])
def test_unsupported_configs_are_rejected(build, field):
    with pytest.raises(InvalidFieldError, match=field):
        TorchKVCacheManager(build(), device="cpu")


def test_bad_devices_and_configs_are_rejected():
    with pytest.raises(InvalidFieldError, match="device"):
        TorchKVCacheManager(cfg(FA), device="not-a-device")
    if not torch.cuda.is_available():
        with pytest.raises(InvalidFieldError, match="device"):
            TorchKVCacheManager(cfg(FA), device="cuda")
    with pytest.raises(InvalidFieldError, match="pool_config"):
        TorchKVCacheManager({"num_blocks": 3})


def _snapshot(m):
    return (m.free_block_queue(), m.get_block_ids("a"), m.cached_blocks(), m.ref_counts())


BAD_CALLS = [
    dict(num_new_tokens=-1),
    dict(num_new_tokens=1.5),
    dict(num_new_tokens=0),
    dict(num_new_tokens=2, num_new_computed_tokens=-4),
    dict(num_new_tokens=2, new_computed_block_ids=((1,), (2,))),
    dict(num_new_tokens=2, num_new_computed_tokens=4, new_computed_block_ids=((99,),)),
    dict(num_new_tokens=2, num_new_computed_tokens=4, new_computed_block_ids=((True,),)),
    dict(num_new_tokens=2, num_new_computed_tokens=3, new_computed_block_ids=((1,),)),
    dict(num_new_tokens=2, reserved_blocks=-1),
    dict(num_new_tokens=2, full_sequence_must_fit="yes"),
    dict(num_new_tokens=2, num_lookahead_tokens=None),
]


@pytest.mark.parametrize("kw", BAD_CALLS)
def test_bad_allocate_slots_calls_raise_value_errors_and_change_nothing(kw):
    m = make_manager(cfg(FA), device="cpu")
    a = Request("a", list(range(9)))
    assert m.allocate_slots(a, 9) is not None
    a.num_computed_tokens = 9
    before = _snapshot(m)
    with pytest.raises(InvalidFieldError):
        m.allocate_slots(a, **kw)
    assert _snapshot(m) == before
    m.check_invariants()


@settings(max_examples=50)
@given(args=st.lists(st.one_of(st.integers(-3, 3), st.none(), st.text(max_size=2), st.floats(allow_nan=False),
                               st.booleans()), min_size=1, max_size=4))
def test_fuzzed_positional_args_never_crash_with_non_value_errors(args):
    m = make_manager(cfg(FA), device="cpu")
    a = Request("a", list(range(9)))
    before = _snapshot(m)
    try:
        m.allocate_slots(a, *args)
    except ValueError:
        assert _snapshot(m) == before
    m.check_invariants()
    for bad in (None, "a", 3):
        with pytest.raises(InvalidFieldError):
            m.get_computed_blocks(bad)
        with pytest.raises(InvalidFieldError):
            m.free(bad)


def test_check_invariants_catches_corrupted_state():
    m = make_manager(cfg(FA), device="cpu")
    a = Request("a", list(range(9)))
    m.allocate_slots(a, 9)
    m.check_invariants()
    m.pool.ref_cnt[1] += 1
    with pytest.raises(AssertionError, match="ref counts"):
        m.check_invariants()
    pool = TorchBlockPool(6, True, torch.device("cpu"))
    pool.queue_key[3] = pool.queue_key[2]
    with pytest.raises(AssertionError, match="duplicate"):
        pool.check_invariants()
    pool = TorchBlockPool(6, True, torch.device("cpu"))
    pool.num_free -= 1
    with pytest.raises(AssertionError, match="num_free"):
        pool.check_invariants()


def test_cache_blocks_publishes_a_block_whose_last_token_arrived_later():
    """Async scheduling: the block holding a sampled token is hashed only when the output comes
    back (vLLM ``KVCacheManager.cache_blocks``); it is then freed to the back of the queue."""
    m = make_manager(cfg(FA, num_blocks=8), device="cpu")
    r = Request("a", list(range(7)), max_tokens=3)
    assert m.allocate_slots(r, 7) == ((1, 2),)  # block 2 holds positions 4..6 of 8
    assert set(m.cached_blocks()) == {(0, 1)}
    r.num_computed_tokens = 7
    assert m.allocate_slots(r, 1) == ((),)  # the next step: position 7 is a placeholder so far
    assert set(m.cached_blocks()) == {(0, 1)}
    r.output_token_ids.append(99)  # the first step's sampled token arrives
    r.num_computed_tokens = 8
    m.cache_blocks(r, 8)  # token 7 is known now: block 2 is full and hashable
    assert set(m.cached_blocks()) == {(0, 1), (0, 2)}
    m.free(r)
    assert m.free_block_queue()[-2:] == (2, 1)
    m.check_invariants()


def test_cache_blocks_rejects_bad_counts():
    m = make_manager(cfg(FA, num_blocks=8), device="cpu")
    r = Request("a", list(range(7)))
    m.allocate_slots(r, 7)
    with pytest.raises(InvalidFieldError, match="num_computed_tokens"):
        m.cache_blocks(r, -1)
    with pytest.raises(InvalidFieldError, match="num_computed_tokens=9"):
        m.cache_blocks(r, 9)  # two blocks of 4 hold 8 tokens
    with pytest.raises(InvalidFieldError, match="request"):
        m.cache_blocks("a", 4)
