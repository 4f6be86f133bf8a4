"""The Triton kernels against the torch data path and dense attention (CPU: Triton's interpreter).

Paged attention: every mask kind x dtype, GQA ratios 1-4 (3 is not a power of two: padded
heads must stay out of the output), block sizes 1-16 against tiles of 2-32 positions (a tile
spanning several blocks and a block spanning several tiles), 1-3 key-range splits (the
flash-decoding combine), prefill chunks and decodes in one batch, scattered block tables. Tolerances (max abs
difference, O(1) values) are ``kvref.impl.torch.paged_attention.TOLERANCE``: float64 1e-10,
float32 1e-5, float16 1e-2, bfloat16 2e-2 — for Triton vs dense *and* Triton vs the torch path
(both accumulate in float32 for half types and round once at the end: they differ by at most one
unit in the last place, 1.6e-2 for bfloat16 outputs in [2, 4)).

K/V write and block copies: bit-identical to the torch path, on aliased hybrid caches with
padded pages, random bit patterns (NaN payloads included).

Interpreter mode is slow (about 0.1 s per small attention call), so shapes are small and the
cases few; ``profile_examples`` scales the generated ones (nightly: 20-25x the ci count, not 100x,
so the interpreted tests stay within minutes).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install triton==3.9.0, requirements/test.txt); "
                                     "the torch back-end is tested without it")

import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvref.impl.torch.block_table import slot_mapping  # noqa: E402
from kvref.impl.torch.kv_cache_tensors import KVCacheTensors  # noqa: E402
from kvref.impl.torch.offload_copy import OffloadCopier  # noqa: E402
from kvref.impl.torch.paged_attention import TOLERANCE, AttentionMask, dense_attention, paged_attention  # noqa: E402
from kvref.spec.errors import InvalidFieldError  # noqa: E402
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec  # noqa: E402
from tests.conftest import profile_examples  # noqa: E402
from tests.impl.torch.triton_support import kernel_device, needs_triton  # noqa: E402

pytestmark = needs_triton

ROOT = Path(__file__).resolve().parents[3]
DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _attention_case(seed, dtype, lens, queries, bs, hkv, group, d, dev):
    """Scattered block tables over a cache filled with noise; K/V of each request written through
    its slots; the last ``queries[r]`` positions of request ``r`` query (a prefill chunk, or a
    decode when 1). Returns the arguments of ``paged_attention`` and the per-request K/V."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = 1 + sum(-(-n // bs) for n in lens) + 2
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    table = torch.zeros((len(lens), max(-(-n // bs) for n in lens)), dtype=torch.int32)
    cache = torch.randn((num_blocks, 2, bs, hkv, d), generator=g, dtype=torch.float64).to(dtype)
    seqs, rows, qpos = [], [], []
    for r, (n, nq) in enumerate(zip(lens, queries)):
        nb = -(-n // bs)
        table[r, :nb] = torch.tensor(perm[:nb], dtype=torch.int32)
        perm = perm[nb:]
        k = torch.randn((n, hkv, d), generator=g, dtype=torch.float64).to(dtype)
        v = torch.randn((n, hkv, d), generator=g, dtype=torch.float64).to(dtype)
        slots = slot_mapping(table, torch.arange(n), bs, torch.full((n,), r))
        cache[slots // bs, 0, slots % bs] = k
        cache[slots // bs, 1, slots % bs] = v
        seqs.append((k, v))
        rows += [r] * min(nq, n)
        qpos += range(n - min(nq, n), n)
    q = torch.randn((len(rows), hkv * group, d), generator=g, dtype=torch.float64).to(dtype)
    args = [q, cache, table, torch.tensor(lens), torch.tensor(rows), torch.tensor(qpos)]
    return [a.to(dev) for a in args], seqs


def _dense(args, seqs, mask):
    q, _, _, _, rows, qpos = [a.cpu() for a in args]
    out = []
    for r, (k, v) in enumerate(seqs):
        sel = rows == r
        out.append(dense_attention(q[sel], k, v, qpos[sel], mask))
    return torch.cat(out)


def _check(args, seqs, mask, dtype, **tuning):
    from kvref.impl.torch.triton_kernels.attention import paged_attention_triton

    got = paged_attention_triton(*args, mask, **tuning).cpu()
    assert got.dtype == dtype and got.shape == args[0].shape
    torch_path = paged_attention(*[a.cpu() for a in args], mask)
    dense = _dense(args, seqs, mask)
    tol = TOLERANCE[dtype]
    vs_dense = float((got.double() - dense.double()).abs().max())
    vs_torch = float((got.double() - torch_path.double()).abs().max())
    assert vs_dense <= tol, f"{dtype} {mask}: triton vs dense {vs_dense} > {tol}"
    assert vs_torch <= tol, f"{dtype} {mask}: triton vs torch path {vs_torch} > {tol}"
    return got


MASKS = (AttentionMask(), AttentionMask("sliding_window", 5), AttentionMask("chunked_local", 4))
#: (mask, dtype, GQA group, block size, tile, splits): every mask x dtype once, the rest rotating
CASES = [(m, dt, (1, 2, 3, 4)[(i + j) % 4], (1, 2, 4, 16)[(i + 2 * j) % 4], (2, 16, 32)[(i + j) % 3],
          (1, 2, 3)[(2 * i + j) % 3])
         for i, m in enumerate(MASKS) for j, dt in enumerate(DTYPES)]


@pytest.mark.parametrize("mask,dtype,group,bs,tile,splits", CASES,
                         ids=[f"{m.kind}-{str(dt)[6:]}-gqa{g}-bs{b}-tile{t}-split{s}" for m, dt, g, b, t, s in CASES])
def test_triton_paged_attention_equals_torch_path_and_dense(mask, dtype, group, bs, tile, splits):
    # Two requests: a prefill chunk of 6 over 19 tokens and a decode at position 10.
    # Head size 16: tiles >= 16 take the tl.dot path (not float64), tile 2 the broadcast path.
    args, seqs = _attention_case(1, dtype, [19, 11], [6, 1], bs, 2, group, 16, kernel_device())
    _check(args, seqs, mask, dtype, tile=tile, num_splits=splits)


@settings(max_examples=profile_examples(4, 12, 300))
@given(seed=st.integers(0, 2**16), dtype=st.sampled_from(DTYPES),
       lens=st.lists(st.integers(1, 24), min_size=1, max_size=3), queries=st.lists(st.integers(1, 4), min_size=3,
                                                                                    max_size=3),
       bs=st.sampled_from([1, 2, 4, 8]), hkv=st.integers(1, 2), group=st.integers(1, 3),
       mask=st.one_of(st.just(AttentionMask()), st.builds(AttentionMask, st.just("sliding_window"), st.integers(1, 12)),
                      st.builds(AttentionMask, st.just("chunked_local"), st.integers(1, 12))),
       tile=st.sampled_from([1, 4, 16, 32]), splits=st.integers(1, 4), d=st.sampled_from([4, 16]))
def test_triton_paged_attention_on_generated_batches(seed, dtype, lens, queries, bs, hkv, group, mask, tile, splits, d):
    args, seqs = _attention_case(seed, dtype, lens, queries, bs, hkv, group, d, kernel_device())
    _check(args, seqs, mask, dtype, tile=tile, num_splits=splits)


def test_float64_is_near_exact_and_the_scale_is_not_rounded_to_float32():
    # head size 6: 6 ** -0.5 is not a float32 number; a float32 scale would cost ~1e-8
    args, seqs = _attention_case(5, torch.float64, [23, 9], [5, 1], 4, 2, 2, 6, kernel_device())
    from kvref.impl.torch.triton_kernels.attention import paged_attention_triton

    mask = AttentionMask("sliding_window", 7)
    got = paged_attention_triton(*args, mask).cpu()
    assert float((got - _dense(args, seqs, mask)).abs().max()) <= 1e-12
    scaled = paged_attention_triton(*args, mask, scale=0.3).cpu()
    ref = paged_attention(*[a.cpu() for a in args], mask, scale=0.3)
    assert float((scaled - ref).abs().max()) <= 1e-12 and float((scaled - got).abs().max()) > 1e-3


def test_only_blocks_the_mask_reaches_are_read():
    """The kernel walks ``[lo, hi)`` only: garbage in a block wholly outside the window (one a
    sliding-window manager may free) does not change the output; garbage in the oldest block still
    inside the window does. That is the property that makes early frees show up as wrong numbers."""
    from kvref.impl.torch.triton_kernels.attention import paged_attention_triton

    dev = kernel_device()
    args, _ = _attention_case(2, torch.float64, [16], [1], 4, 1, 1, 4, dev)  # decode at 15, blocks 0..3
    mask = AttentionMask("sliding_window", 6)                                 # reads positions 10..15
    base = paged_attention_triton(*args, mask)
    cache, table = args[1], args[2]
    outside, inside = int(table[0, 1]), int(table[0, 2])  # positions 4..7 (never read), 8..11 (10, 11 read)
    cache[outside] = float("nan")
    for tuning in ({}, {"tile": 2, "num_splits": 3}):
        assert torch.allclose(paged_attention_triton(*args, mask, **tuning), base, rtol=0, atol=1e-12), tuning
    cache[inside] = 100.0
    for tuning in ({}, {"tile": 2, "num_splits": 3}):
        assert float((paged_attention_triton(*args, mask, **tuning) - base).abs().max()) > 1e-3, tuning


def test_write_kv_kernel_stores_the_same_bits_as_the_torch_path():
    from kvref.impl.torch.triton_kernels.write_kv import write_kv_triton

    kw = dict(num_kv_heads=2, head_size=4, dtype="float32")
    groups = (KVCacheGroupSpec(("f",), FullAttentionSpec(block_size=4, **kw)),       # page = 64 elements
              KVCacheGroupSpec(("s",), SlidingWindowSpec(block_size=2, sliding_window=3, **kw)))  # 32: padded
    dev = kernel_device()
    g = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        ref = KVCacheTensors(groups, 6, 2, dtype, "cpu")
        got = KVCacheTensors(groups, 6, 2, dtype, dev)
        for group, slots in ((0, [4, 5, 23, 0, 9]), (1, [11, 2, 3])):
            n = len(slots)
            k, v = torch.randn((n, 2, 4), generator=g, dtype=torch.float64), torch.randn((n, 2, 4), generator=g,
                                                                                        dtype=torch.float64)
            for layer in range(2):
                ref.write_kv(group, layer, torch.tensor(slots), k, v)
                write_kv_triton(got.kv(group, layer), torch.tensor(slots, device=dev), k.to(dev), v.to(dev))
        for a, b in zip(ref.backing, got.backing):
            assert torch.equal(a.view(torch.uint8), b.cpu().view(torch.uint8)), dtype
        assert bool(ref.backing[0].abs().sum() > 0)


def _random_bits(t: torch.Tensor, gen: torch.Generator) -> None:
    raw = t.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))


@settings(max_examples=profile_examples(6, 20, 400))
@given(dtype=st.sampled_from(DTYPES), num_blocks=st.integers(2, 8), num_cpu=st.integers(1, 8),
       layers=st.integers(1, 2), data=st.data())
def test_offload_through_the_copy_kernel_equals_the_torch_copier_bit_for_bit(dtype, num_blocks, num_cpu, layers,
                                                                           data):
    kw = dict(num_kv_heads=2, head_size=4, dtype="float32")
    groups = (KVCacheGroupSpec(("f",), FullAttentionSpec(block_size=4, **kw)),)
    dev = kernel_device()
    seed = data.draw(st.integers(0, 10**6))
    caches = []
    for backend in ("torch", "triton"):
        cache = KVCacheTensors(groups, num_blocks, layers, dtype, dev if backend == "triton" else "cpu")
        gen = torch.Generator().manual_seed(seed)
        for t in cache.backing:
            bits = torch.empty(t.shape, dtype=dtype)
            _random_bits(bits, gen)
            t.copy_(bits)
        caches.append((backend, cache))
    n = data.draw(st.integers(0, min(num_blocks, num_cpu)))
    gpu = data.draw(st.permutations(range(num_blocks)))[:n]
    cpu = data.draw(st.permutations(range(num_cpu)))[:n]
    back = data.draw(st.permutations(range(num_blocks)))[:n]  # load into other device blocks
    copiers = []
    for backend, cache in caches:
        c = OffloadCopier(cache, num_cpu, backend=backend)
        c.store(list(zip(gpu, cpu))).wait()
        c.load(list(zip(back, cpu))).wait()
        copiers.append(c)
    (_, a), (_, b) = caches
    for x, y in zip(a.backing + copiers[0].host, b.backing + copiers[1].host):
        assert torch.equal(x.view(torch.uint8), y.cpu().view(torch.uint8))


def test_copy_kernel_rejects_bad_arguments():
    from kvref.impl.torch.triton_kernels.block_copy import copy_blocks_triton

    dev = kernel_device()
    src, dst = torch.zeros(4, 8, device=dev), torch.zeros(3, 8, device=dev)
    src[1], src[2] = 1.0, 2.0
    copy_blocks_triton(src, dst, [1, 2], [0, 1])
    assert dst.cpu().tolist() == [[1.0] * 8, [2.0] * 8, [0.0] * 8]
    for bad in (dict(src_ids=[1, 2], dst_ids=[0, 0]),          # one destination twice
                dict(src_ids=[4], dst_ids=[0]),                # source out of range
                dict(src_ids=[1, 2], dst_ids=[0]),             # lengths differ
                dict(src_ids=[1], dst_ids=[0], chunk=3)):      # not a power of two
        with pytest.raises(InvalidFieldError):
            copy_blocks_triton(src, dst, **bad)
    with pytest.raises(InvalidFieldError, match="src/dst"):
        copy_blocks_triton(src, torch.zeros(3, 4, device=dev), [1], [0])


def test_attention_and_write_kernels_reject_bad_arguments():
    from kvref.impl.torch.triton_kernels.attention import paged_attention_triton
    from kvref.impl.torch.triton_kernels.write_kv import write_kv_triton

    dev = kernel_device()
    q, cache = torch.zeros(2, 2, 4, device=dev), torch.zeros(5, 2, 4, 1, 4, device=dev)
    table, ctx, rows, pos = (torch.tensor([[1, 2]], dtype=torch.int32, device=dev), torch.tensor([8], device=dev),
                             torch.tensor([0, 0], device=dev), torch.tensor([6, 7], device=dev))
    assert paged_attention_triton(q, cache, table, ctx, rows, pos).shape == (2, 2, 4)
    with pytest.raises(InvalidFieldError, match="block_table"):
        paged_attention_triton(q, cache, torch.tensor([[1, 9]], dtype=torch.int32, device=dev), ctx, rows, pos)
    with pytest.raises(InvalidFieldError, match="num_query_heads"):
        paged_attention_triton(torch.zeros(2, 3, 4, device=dev), torch.zeros(5, 2, 4, 2, 4, device=dev), table, ctx,
                               rows, pos)
    with pytest.raises(InvalidFieldError, match="mask"):
        paged_attention_triton(q, cache, table, ctx, rows, pos, "causal")
    with pytest.raises(InvalidFieldError, match="tile"):
        paged_attention_triton(q, cache, table, ctx, rows, pos, tile=24)
    with pytest.raises(InvalidFieldError, match="num_splits"):
        paged_attention_triton(q, cache, table, ctx, rows, pos, num_splits=0)
    with pytest.raises(InvalidFieldError, match="num_warps"):
        paged_attention_triton(q, cache, table, ctx, rows, pos, num_warps=3)
    with pytest.raises(InvalidFieldError, match="slots"):
        write_kv_triton(cache, torch.tensor([4, 20], device=dev), torch.ones(2, 1, 4, device=dev),
                        torch.ones(2, 1, 4, device=dev))
    with pytest.raises(InvalidFieldError, match="k/v"):
        write_kv_triton(cache, torch.tensor([4, 5], device=dev), torch.ones(2, 1, 3, device=dev),
                        torch.ones(2, 1, 4, device=dev))


@pytest.mark.gpu
def test_compiled_kernels_on_cuda_match_the_torch_path():
    """On a GPU the same kernels compile (no interpreter): a subprocess without TRITON_INTERPRET
    runs attention for each mask (bfloat16, GQA 4, block size 16), the K/V write and an offload
    round trip through pinned host memory, against the torch path on the same device."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = ROOT / "benchmarks" / "bench_triton_attention.py"
    out = subprocess.run([sys.executable, str(script), "--check-only"], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "check passed" in out.stdout


@pytest.mark.gpu
def test_a_decode_call_without_validation_never_synchronizes_the_device():
    """With ``validate=False`` (the timing loop, an engine's hot path) a call must queue its
    launches and return: a blocking host-to-device copy inside it (the scale was once built with
    ``torch.tensor(..., device=cuda)``) syncs the stream per call, so the GPU idles while Python
    prepares the next step and the decode benchmark times the wrapper, not the kernel (#24).
    ``torch.cuda.set_sync_debug_mode("error")`` raises on any synchronizing call."""
    if kernel_device() != "cuda":
        pytest.skip("the kernels run in the interpreter here (CPU tensors): nothing to synchronize")
    from kvref.impl.torch.triton_kernels.attention import paged_attention_triton

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(3)
    cache = torch.randn((40, 2, 16, 2, 64), generator=g).to(torch.bfloat16).to(dev)
    table = (torch.randperm(39, generator=g)[:32] + 1).reshape(4, 8).to(torch.int32).to(dev)
    ctx = torch.tensor([128, 100, 64, 7], device=dev)
    rows = torch.arange(4, device=dev)
    pos = ctx - 1
    q = torch.randn((4, 8, 64), generator=g).to(torch.bfloat16).to(dev)
    for mask in (AttentionMask(), AttentionMask("sliding_window", 33)):
        for splits in (None, 1, 4):
            want = paged_attention_triton(q, cache, table, ctx, rows, pos, mask, num_splits=splits)  # compiles
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                got = paged_attention_triton(q, cache, table, ctx, rows, pos, mask, num_splits=splits,
                                             validate=False)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert torch.equal(got, want)


def test_the_launch_plan_is_computed_once_per_distinct_arguments_and_still_refuses_bad_tunings():
    """The wrapper keeps the configuration choice per argument tuple (host time per decode call,
    issue #24) without letting the cache skip validation: ``tile=True`` equals ``tile=1`` as a key
    and must still be refused after ``tile=1`` was accepted."""
    import kvref.impl.torch.triton_kernels.attention as attn

    dev = kernel_device()
    g = torch.Generator().manual_seed(5)
    cache = torch.randn((9, 2, 4, 1, 16), generator=g).to(dev)
    table = (torch.randperm(8, generator=g) + 1).reshape(2, 4).to(torch.int32).to(dev)
    ctx = torch.tensor([9, 5], device=dev)
    rows = torch.arange(2, device=dev)
    q = torch.randn((2, 2, 16), generator=g).to(dev)
    attn._launch_plan.cache_clear()
    first = attn.paged_attention_triton(q, cache, table, ctx, rows, ctx - 1, tile=1)
    again = attn.paged_attention_triton(q, cache, table, ctx, rows, ctx - 1, tile=1)
    info = attn._launch_plan.cache_info()
    assert (info.misses, info.hits) == (1, 1)
    assert torch.equal(first, again)
    with pytest.raises(InvalidFieldError, match="tile"):
        attn.paged_attention_triton(q, cache, table, ctx, rows, ctx - 1, tile=True)
    with pytest.raises(InvalidFieldError, match="tile"):
        attn.paged_attention_triton(q, cache, table, ctx, rows, ctx - 1, tile=[32])
