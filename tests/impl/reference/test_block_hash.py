"""Block hashing: chaining, NONE_HASH seeding, cache salt, coarse views, group-id keys."""

from __future__ import annotations

import hashlib
import pickle

import pytest

from kvref.impl.reference import block_hash as bh
from kvref.impl.request import Request


def test_sha256_is_hashlib_over_highest_protocol_pickle():
    obj = (b"x", (1, 2, 3), None)
    assert bh.sha256(obj) == hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def test_none_hash_seed_default_and_pythonhashseed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert bh.resolve_none_hash_seed() == "vllm-none-hash"
    default = bh.compute_none_hash()
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert bh.resolve_none_hash_seed() == "0"
    assert bh.compute_none_hash() == bh.sha256("0") != default


def test_hashes_chain_over_full_blocks_only():
    hasher = bh.RequestBlockHasher(4)
    req = Request("r", list(range(10)))
    hashes = hasher.block_hashes(req)
    assert len(hashes) == 2  # 10 tokens -> 2 full blocks of 4
    h0 = bh.sha256((hasher.none_hash, (0, 1, 2, 3), None))
    h1 = bh.sha256((h0, (4, 5, 6, 7), None))
    assert hashes == [h0, h1]


def test_hashes_extend_incrementally_as_outputs_are_appended():
    hasher = bh.RequestBlockHasher(4)
    req = Request("r", list(range(7)))
    first = list(hasher.block_hashes(req))
    req.output_token_ids.extend([7, 8])
    hashes = hasher.block_hashes(req)
    assert hashes[:1] == first and len(hashes) == 2
    fresh = bh.RequestBlockHasher(4).block_hashes(Request("q", list(range(9))))
    assert hashes == fresh  # same tokens, same hashes, however they arrived


def test_cache_salt_changes_only_through_the_first_block():
    hasher = bh.RequestBlockHasher(4)
    plain = hasher.block_hashes(Request("a", list(range(8))))
    salted = hasher.block_hashes(Request("b", list(range(8)), cache_salt="s"))
    assert plain[0] != salted[0]
    assert salted[0] == bh.sha256((hasher.none_hash, (0, 1, 2, 3), (("cache_salt", "s"),)))
    assert salted[1] == bh.sha256((salted[0], (4, 5, 6, 7), None))


def test_a_new_request_object_under_a_known_id_is_rehashed():
    hasher = bh.RequestBlockHasher(2)
    hasher.block_hashes(Request("r", [1, 2, 3, 4]))
    again = hasher.block_hashes(Request("r", [9, 9, 9, 9]))
    assert again == bh.RequestBlockHasher(2).block_hashes(Request("x", [9, 9, 9, 9]))
    hasher.forget("r")
    assert "r" not in hasher


def test_coarse_view_takes_the_last_fine_hash_of_each_coarse_block():
    fine = [bytes([i]) for i in range(7)]
    view = bh.BlockHashListWithBlockSize(fine, 16, 48)
    assert len(view) == 2 and list(view) == [fine[2], fine[5]] and view[-1] == fine[5]
    assert view[0:2] == [fine[2], fine[5]]
    with pytest.raises(IndexError):
        view[2]
    assert bh.resolve_block_hashes(fine, 16, 16) is fine


def test_group_id_key_is_hash_plus_four_big_endian_bytes():
    key = bh.make_block_hash_with_group_id(b"\x01\x02", 258)
    assert key == b"\x01\x02\x00\x00\x01\x02"
    assert bh.get_block_hash(key) == b"\x01\x02" and bh.get_group_id(key) == 258
