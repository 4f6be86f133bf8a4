"""Offload copies: device blocks -> host blocks -> device blocks come back bit-exact."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvref.impl.torch.kv_cache_tensors import KVCacheTensors
from kvref.impl.torch.offload_copy import OffloadCopier, merge_runs
from kvref.spec.errors import InvalidFieldError
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec
from tests.conftest import profile_examples

KW = dict(num_kv_heads=2, head_size=4, dtype="float32")
GROUPS = (KVCacheGroupSpec(("f",), FullAttentionSpec(block_size=4, **KW)),
          KVCacheGroupSpec(("s",), SlidingWindowSpec(block_size=2, sliding_window=3, **KW)))


def _random_bits(t: torch.Tensor, gen: torch.Generator) -> None:
    """Fill with random bit patterns (NaNs and infs included): bit-exactness, not value equality."""
    raw = t.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))


@settings(max_examples=profile_examples(30, 100))
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
       num_blocks=st.integers(2, 12), num_cpu=st.integers(1, 12), layers=st.integers(1, 3),
       data=st.data())
def test_store_then_load_round_trip_is_bit_exact(dtype, num_blocks, num_cpu, layers, data):
    cache = KVCacheTensors(GROUPS, num_blocks, layers, dtype)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 10**6)))
    for t in cache.backing:
        _random_bits(t, gen)
    before = [t.clone() for t in cache.backing]
    n = data.draw(st.integers(0, min(num_blocks, num_cpu)))
    gpu = data.draw(st.permutations(range(num_blocks)))[:n]
    cpu = data.draw(st.permutations(range(num_cpu)))[:n]
    copier = OffloadCopier(cache, num_cpu)
    job = list(zip(gpu, cpu))
    h = copier.store(job)
    h.wait()
    assert h.done() and h.num_blocks == n
    for host, dev in zip(copier.host, before):
        for g, c in job:
            assert torch.equal(host[c].view(torch.uint8), dev[g].view(torch.uint8))
    for t in cache.backing:
        _random_bits(t, gen)  # the device blocks are reused by others meanwhile
    # Load into a different placement of device blocks.
    dst = data.draw(st.permutations(range(num_blocks)))[:n]
    copier.load(list(zip(dst, cpu))).wait()
    for t, old in zip(cache.backing, before):
        for g_old, g_new in zip(gpu, dst):
            assert torch.equal(t[g_new].view(torch.uint8), old[g_old].view(torch.uint8))


def test_merge_runs_joins_consecutive_pairs():
    assert merge_runs([(5, 1), (3, 9), (4, 10), (6, 2), (8, 3)]) == [(3, 9, 2), (5, 1, 2), (8, 3, 1)]
    assert merge_runs([]) == []


@pytest.mark.parametrize("job,match", [
    ([(0, 0), (1, 0)], "distinct"),      # two stores into one CPU block
    ([(9, 0)], "gpu_block"),
    ([(0, 5)], "cpu_block"),
    ([(0,)], "job"),
    ("0,0", "job"),
    ([(-1, 0)], "gpu_block"),
])
def test_bad_store_jobs_are_rejected_before_copying(job, match):
    cache = KVCacheTensors(GROUPS, 4)
    copier = OffloadCopier(cache, 3)
    copier.host[0].fill_(1.0)
    with pytest.raises(InvalidFieldError, match=match):
        copier.store(job)
    assert bool((copier.host[0] == 1.0).all()), "nothing half-copied"


def test_bad_load_job_and_constructor_args():
    copier = OffloadCopier(KVCacheTensors(GROUPS, 4), 3)
    with pytest.raises(InvalidFieldError, match="distinct"):
        copier.load([(1, 0), (1, 2)])
    with pytest.raises(InvalidFieldError):
        OffloadCopier(object(), 3)
    with pytest.raises(InvalidFieldError):
        OffloadCopier(KVCacheTensors(GROUPS, 4), 0)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("form", ["pairs", "id array"])
def test_cuda_round_trip_uses_pinned_host_and_events(backend, form):
    """Both back-ends on CUDA (issue #24: the triton one refused its own pinned host side), with the
    job as a list of pairs and as an (n, 2) id array (its ids reach the kernel as CPU tensors)."""
    if backend == "triton":
        pytest.importorskip("triton", reason="triton is not installed")
    cache = KVCacheTensors(GROUPS, 64, 2, torch.bfloat16, device="cuda")
    for t in cache.backing:
        t.copy_(torch.randn_like(t, dtype=torch.float32).to(torch.bfloat16))
    before = [t.clone() for t in cache.backing]
    copier = OffloadCopier(cache, 64, backend=backend)
    assert copier.host[0].is_pinned()
    job = [(g, 63 - g) for g in range(1, 64)]
    if form == "id array":
        job = torch.tensor(job, dtype=torch.int32)
    h = copier.store(job)
    h.wait()
    for t in cache.backing:
        t.zero_()
    h = copier.load(job)
    h.wait_stream()
    torch.cuda.synchronize()
    assert h.done()
    for t, old in zip(cache.backing, before):
        assert torch.equal(t[1:].view(torch.uint8), old[1:].view(torch.uint8))
