"""Paged attention through scattered block tables equals dense attention on the contiguous sequence.

Tolerances (max abs difference, O(1) values): float64 1e-10, float32 1e-5, float16 1e-2,
bfloat16 2e-2 (``kvref.impl.torch.paged_attention.TOLERANCE``).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvref.impl.torch.block_table import slot_mapping
from kvref.impl.torch.paged_attention import TOLERANCE, AttentionMask, dense_attention, paged_attention
from kvref.spec.errors import InvalidFieldError

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def _case(seed, dtype, lens, queries, bs, hkv, groups, d, mask):
    g = torch.Generator().manual_seed(seed)
    num_blocks = 1 + sum(-(-n // bs) for n in lens) + 3
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # scattered, never block 0
    width = max(-(-n // bs) for n in lens)
    table = torch.zeros((len(lens), width), dtype=torch.int32)
    cache = torch.randn((num_blocks, 2, bs, hkv, d), generator=g, dtype=torch.float64).to(dtype)
    seqs = []
    for r, n in enumerate(lens):
        nb = -(-n // bs)
        table[r, :nb] = torch.tensor(perm[:nb], dtype=torch.int32)
        perm = perm[nb:]
        k = torch.randn((n, hkv, d), generator=g, dtype=torch.float64).to(dtype)
        v = torch.randn((n, hkv, d), generator=g, dtype=torch.float64).to(dtype)
        pos = torch.arange(n)
        slots = slot_mapping(table, pos, bs, torch.full((n,), r))
        cache[slots // bs, 0, slots % bs] = k
        cache[slots // bs, 1, slots % bs] = v
        seqs.append((k, v))
    rows, qpos = [], []
    for r, (n, nq) in enumerate(zip(lens, queries)):
        nq = min(nq, n)
        rows += [r] * nq
        qpos += range(n - nq, n)
    q = torch.randn((len(rows), hkv * groups, d), generator=g, dtype=torch.float64).to(dtype)
    rows_t, qpos_t = torch.tensor(rows), torch.tensor(qpos)
    out = paged_attention(q, cache, table, torch.tensor(lens), rows_t, qpos_t, mask)
    ref = []
    at = 0
    for r, (n, nq) in enumerate(zip(lens, queries)):
        nq = min(nq, n)
        k, v = seqs[r]
        ref.append(dense_attention(q[at:at + nq], k, v, qpos_t[at:at + nq], mask))
        at += nq
    return out, torch.cat(ref)


masks = st.one_of(st.just(AttentionMask()),
                  st.builds(AttentionMask, st.just("sliding_window"), st.integers(1, 20)),
                  st.builds(AttentionMask, st.just("chunked_local"), st.integers(1, 20)))


@settings(max_examples=40)
@given(seed=st.integers(0, 2**16), dtype=st.sampled_from(DTYPES),
       lens=st.lists(st.integers(1, 40), min_size=1, max_size=4), queries=st.lists(st.integers(1, 8), min_size=4, max_size=4),
       bs=st.sampled_from([1, 2, 4, 16]), hkv=st.integers(1, 2), groups=st.integers(1, 3), mask=masks)
def test_paged_equals_dense(seed, dtype, lens, queries, bs, hkv, groups, mask):
    out, ref = _case(seed, dtype, lens, queries, bs, hkv, groups, 4, mask)
    assert out.dtype == dtype
    err = float((out.double() - ref.double()).abs().max())
    assert err <= TOLERANCE[dtype], f"{dtype} paged vs dense: {err}"


def test_float64_is_near_exact():
    out, ref = _case(7, torch.float64, [37, 5, 20], [8, 5, 1], 4, 2, 2, 8, AttentionMask("sliding_window", 9))
    assert float((out - ref).abs().max()) <= 1e-12


def test_masks_select_the_documented_keys():
    q = torch.tensor([0, 5, 7, 8])
    k = torch.arange(10)
    assert AttentionMask().allowed(q, k)[1].tolist() == [True] * 6 + [False] * 4
    assert AttentionMask("sliding_window", 3).allowed(q, k)[1].nonzero().flatten().tolist() == [3, 4, 5]
    assert AttentionMask("chunked_local", 4).allowed(q, k)[2].nonzero().flatten().tolist() == [4, 5, 6, 7]
    assert AttentionMask("chunked_local", 4).allowed(q, k)[3].nonzero().flatten().tolist() == [8]


def test_a_wrong_block_table_entry_changes_the_output():
    out, ref = _case(3, torch.float64, [12], [4], 4, 1, 1, 4, AttentionMask())
    assert float((out - ref).abs().max()) <= 1e-12
    # Same data, but the table points one position at the null block: the numbers move.
    g = torch.Generator().manual_seed(3)
    cache = torch.randn((5, 2, 4, 1, 4), generator=g, dtype=torch.float64)
    table = torch.tensor([[1, 2, 3]], dtype=torch.int32)
    q = torch.randn((1, 1, 4), generator=g, dtype=torch.float64)
    args = (torch.tensor([12]), torch.tensor([0]), torch.tensor([11]))
    good = paged_attention(q, cache, table, *args)
    bad = paged_attention(q, cache, torch.tensor([[1, 0, 3]], dtype=torch.int32), *args)
    assert float((good - bad).abs().max()) > 1e-3


@pytest.mark.parametrize("kind,size", [("diagonal", 0), ("sliding_window", 0), ("chunked_local", -1)])
def test_bad_masks_are_rejected(kind, size):
    with pytest.raises(InvalidFieldError):
        AttentionMask(kind, size)


def test_bad_shapes_are_rejected():
    with pytest.raises(InvalidFieldError, match="query"):
        paged_attention(torch.zeros(2, 4), torch.zeros(3, 2, 4, 1, 4), torch.zeros((1, 1), dtype=torch.int32),
                        torch.tensor([1]), torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(InvalidFieldError, match="num_query_heads"):
        paged_attention(torch.zeros(1, 3, 4), torch.zeros(3, 2, 4, 2, 4), torch.ones((1, 1), dtype=torch.int32),
                        torch.tensor([1]), torch.tensor([0]), torch.tensor([0]))


@pytest.mark.gpu
def test_paged_attention_on_cuda_matches_cpu():
    g = torch.Generator().manual_seed(11)
    cache = torch.randn((9, 2, 16, 2, 64), generator=g, dtype=torch.float32)
    table = torch.tensor([[3, 5, 7]], dtype=torch.int32)
    q = torch.randn((2, 8, 64), generator=g, dtype=torch.float32)
    args = (torch.tensor([40]), torch.tensor([0, 0]), torch.tensor([38, 39]))
    mask = AttentionMask("sliding_window", 33)
    cpu = paged_attention(q, cache, table, *args, mask)
    gpu = paged_attention(q.cuda(), cache.cuda(), table.cuda(), *(a.cuda() for a in args), mask)
    assert float((cpu - gpu.cpu()).abs().max()) <= 1e-4


def _args():
    return dict(query=torch.zeros(2, 2, 4), kv_cache=torch.zeros(5, 2, 4, 1, 4),
                block_table=torch.tensor([[1, 2]], dtype=torch.int32), context_lens=torch.tensor([8]),
                query_rows=torch.tensor([0, 0]), query_positions=torch.tensor([6, 7]))


@pytest.mark.parametrize("field,value", [
    ("query", torch.zeros(2, 2, 3)),                                  # head size differs
    ("kv_cache", torch.zeros(5, 3, 4, 1, 4)),                         # not K and V
    ("block_table", torch.tensor([1, 2], dtype=torch.int32)),         # not [B, W]
    ("block_table", torch.tensor([[1, 9]], dtype=torch.int32)),       # id beyond the cache
    ("context_lens", torch.tensor([9])),                              # longer than the table covers
    ("query_rows", torch.tensor([0, 1])),                             # row out of range
    ("query_positions", torch.tensor([7])),                           # not one per query
])
def test_paged_attention_rejects_bad_arguments_with_value_errors(field, value):
    args = _args()
    assert paged_attention(**args).shape == (2, 2, 4)
    args[field] = value
    with pytest.raises(InvalidFieldError):
        paged_attention(**args)


def test_write_kv_rejects_bad_shapes_and_slots():
    from kvref.impl.torch.kv_cache_tensors import KVCacheTensors
    from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    cache = KVCacheTensors((KVCacheGroupSpec(("f",), FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=2,
                                                                        dtype="float32")),), num_blocks=3)
    ok = torch.ones(2, 1, 2)
    cache.write_kv(0, 0, torch.tensor([4, 5]), ok, ok)
    assert float(cache.kv(0, 0)[1, 0, :2].sum()) == 4.0
    with pytest.raises(InvalidFieldError, match="slots"):
        cache.write_kv(0, 0, torch.tensor([4, 12]), ok, ok)
    with pytest.raises(InvalidFieldError, match="k/v"):
        cache.write_kv(0, 0, torch.tensor([4, 5]), torch.ones(2, 1, 3), ok)
