"""Issue #24: an offload job given as an ``(n, 2)`` id array (what vLLM's offload workers hold:
``np.ndarray`` block ids) is checked and split in tensor operations, without a Python pass per
pair (the copier's host time kept the scattered job under its goal on an H200). It must copy
exactly what the same job as a list of pairs copies, split the same way between the copy engine
and the kernel, and refuse exactly what the list form refuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvref.impl.torch.kv_cache_tensors import KVCacheTensors
from kvref.impl.torch.offload_copy import OffloadCopier
from kvref.spec.errors import InvalidFieldError
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from tests.conftest import profile_examples

GROUPS = (KVCacheGroupSpec(("f",), FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=4, dtype="float32")),)


def _job(data, num_blocks, num_cpu, kind):
    """Pairs with distinct destinations, runs of consecutive pairs likely (shifted ranges)."""
    n = data.draw(st.integers(0, min(num_blocks, num_cpu)))
    if data.draw(st.booleans()):  # runs: one shifted range, some pairs dropped
        g0, c0 = data.draw(st.integers(0, num_blocks - n)), data.draw(st.integers(0, num_cpu - n))
        pairs = [(g0 + i, c0 + i) for i in range(n) if data.draw(st.integers(0, 4))]
    else:
        pairs = list(zip(data.draw(st.permutations(range(num_blocks)))[:n],
                         data.draw(st.permutations(range(num_cpu)))[:n]))
    if kind == "store" and pairs and data.draw(st.booleans()):  # a store may read one source twice
        free_c = sorted(set(range(num_cpu)) - {c for _, c in pairs})
        if free_c:
            pairs.append((pairs[0][0], free_c[0]))
    return data.draw(st.permutations(pairs))


@settings(max_examples=profile_examples(40, 120), deadline=None)
@given(num_blocks=st.integers(1, 14), num_cpu=st.integers(1, 14), kind=st.sampled_from(["store", "load"]),
       threshold_pages=st.integers(0, 5), data=st.data())
def test_an_id_array_is_planned_as_its_list_of_pairs(num_blocks, num_cpu, kind, threshold_pages, data):
    """Same copy-engine runs (same order) and the same pairs left to the kernel, for both back-ends
    and every copy-engine threshold."""
    cache = KVCacheTensors(GROUPS, num_blocks, 1, torch.float32, "cpu")
    page_bytes = cache.block_stride * 4
    job = _job(data, num_blocks, num_cpu, kind)
    for backend in ("torch", "triton"):
        copier = OffloadCopier.__new__(OffloadCopier)  # the plan needs no kernel: no triton check
        copier.cache, copier.num_cpu_blocks, copier.backend = cache, num_cpu, backend
        copier.copy_engine_min_bytes = threshold_pages * page_bytes
        runs_l, g_l, c_l = copier._plan_pairs(copier._check(job, kind))
        table = np.array(job, dtype=np.int32).reshape(-1, 2) if data.draw(st.booleans()) \
            else torch.tensor(job, dtype=torch.int64).reshape(-1, 2)
        runs_t, g_t, c_t = copier._plan_table(copier._check_table(table, kind))
        assert runs_t == runs_l
        assert sorted(zip(g_t.tolist(), c_t.tolist())) == sorted(zip(g_l, c_l))


@settings(max_examples=profile_examples(20, 60), deadline=None)
@given(num_blocks=st.integers(1, 10), num_cpu=st.integers(1, 10), data=st.data())
def test_an_id_array_job_copies_what_its_list_copies(num_blocks, num_cpu, data):
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 10**6)))
    copies = []
    job = _job(data, num_blocks, num_cpu, "store")
    for form in (list, lambda j: np.array(j, dtype=np.int64).reshape(-1, 2)):
        cache = KVCacheTensors(GROUPS, num_blocks, 2, torch.float32, "cpu")
        for t in cache.backing:
            t.view(torch.int32).copy_(torch.randint(-2**31, 2**31 - 1, t.shape, generator=gen.manual_seed(7),
                                                    dtype=torch.int32))
        copier = OffloadCopier(cache, num_cpu)
        h = copier.store(form(job))
        assert h.num_blocks == len(job)
        for t in cache.backing:
            t.zero_()
        copier.load(form(list({g: (g, c) for g, c in job}.values()))).wait()  # one source per device block
        copies.append(([h.clone() for h in copier.host], [t.clone() for t in cache.backing]))
    for a, b in zip(copies[0][0] + copies[0][1], copies[1][0] + copies[1][1]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("bad, field", [
    (np.array([[1.0, 2.0]]), "job"), (torch.tensor([[True, False]]), "job"), (np.zeros((2, 3), dtype=np.int64), "job"),
    (torch.tensor([1, 2]), "job"), (np.array([[4, 0]]), "gpu_block"), (np.array([[0, -1]]), "cpu_block"),
    (np.array([[0, 5]]), "cpu_block"), (np.array([[0, 1], [2, 1]]), "job"), (np.array([["a", "b"]]), "job"),
])
def test_bad_id_arrays_are_refused_and_nothing_is_copied(bad, field):
    cache = KVCacheTensors(GROUPS, 4, 1, torch.float32, "cpu")
    cache.backing[0].fill_(1.0)
    copier = OffloadCopier(cache, 5)
    with pytest.raises(InvalidFieldError, match=field):
        copier.store(bad)
    assert not copier.host[0].any()


def test_load_arrays_need_distinct_device_blocks():
    cache = KVCacheTensors(GROUPS, 4, 1, torch.float32, "cpu")
    copier = OffloadCopier(cache, 5)
    copier.store(np.array([[2, 0], [2, 1]])).wait()  # a store may read one device block twice
    with pytest.raises(InvalidFieldError, match="distinct destination"):
        copier.load(np.array([[2, 0], [2, 1]]))
