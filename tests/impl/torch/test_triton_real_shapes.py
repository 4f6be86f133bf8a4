"""The Triton kernels on the attention shapes real models use (CPU: Triton's interpreter).

``test_triton_kernels.py`` draws toy shapes (head size 4/16, GQA 1-3, block sizes 1-16). Here:

* every attention shape of every packaged ``config.json`` fixture (``kvref/examples/hf_configs``,
  iterated at collection, so new fixtures are picked up), as
  :func:`kvref.spec.hf_config.layout_from_hf_config` derives it for one rank of tensor
  parallelism (TP 1 and the largest TP <= 8 vLLM accepts): head sizes 64/128/256 and the
  576-wide MLA latent, GQA ratios 1-8 and 128 (MLA at TP 1: several head blocks per program),
  block sizes 16/64 and the hybrid-aligned 80/144/400/528/544/1040/1568 (not powers of two),
  windows 128-4096 and chunks of 8192 larger than the context, in the model's dtype. Each case
  keeps 1-2 KV heads and a context just past one block: a prefill chunk whose queries cross the
  block boundary and a decode, the K/V written through a slot mapping with padded (``-1``)
  entries by the write kernel, then attention through the kernel vs the torch path and dense;
  tiles, splits and head blocks rotate over the cases;
* a Hypothesis test over head size {64, 80, 96, 112, 128, 256} (80/96/112 leave padding lanes),
  GQA {1, 4, 8, 16}, block sizes powers of two or not, windows/chunks not multiples of the block
  size or larger than the context, every dtype.

Tolerances as in ``test_triton_kernels.py`` (``paged_attention.TOLERANCE``): float64 1e-10,
float32 1e-5, float16 1e-2, bfloat16 2e-2, kernel vs dense and kernel vs torch path; the K/V
write is bit-identical. The fixture cases whose block is above 600 tokens (Nemotron-H's 1040,
Falcon-H1's 1568: long contexts, slow in the interpreter) run under the nightly profile only.
"""

from __future__ import annotations

import json
from importlib import resources

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install triton==3.9.0, requirements/test.txt); "
                                     "the torch back-end is tested without it")

import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvref.impl.torch.block_table import slot_mapping  # noqa: E402
from kvref.impl.torch.paged_attention import TOLERANCE, AttentionMask, paged_attention  # noqa: E402
from kvref.spec.errors import InvalidFieldError  # noqa: E402
from kvref.spec.hf_config import layout_from_hf_config  # noqa: E402
from kvref.spec.kv_cache_interface import AttentionSpec, MLAAttentionSpec  # noqa: E402
from tests.conftest import profile_examples  # noqa: E402
from tests.impl.torch.test_triton_kernels import _dense  # noqa: E402
from tests.impl.torch.triton_support import kernel_device, needs_triton  # noqa: E402

pytestmark = needs_triton

NIGHTLY = settings._current_profile == "nightly"  # type: ignore[attr-defined]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
#: blocks above this many tokens need contexts the interpreter walks slowly (1040: 6 s, 1568: 36 s
#: on one core): nightly only
CI_MAX_BLOCK = 600


def _fixture_shapes() -> list[tuple[str, int, AttentionMask, str, int, int, int, int]]:
    """``(fixture, tp, mask, dtype, query heads, KV heads, head size, block size)`` per distinct
    attention shape of each fixture (one rank of TP 1 and of the largest TP <= 8 that divides the
    query heads and that vLLM accepts)."""
    root = resources.files("kvref") / "examples" / "hf_configs"
    out: dict[tuple, str] = {}
    for path in sorted((p for p in root.iterdir() if p.name.endswith(".json")), key=lambda p: p.name):
        data = json.loads(path.read_text())
        cfg = data.get("text_config", data)
        heads = cfg.get("num_attention_heads")
        if not heads:
            continue  # attention-free (Mamba): nothing for these kernels
        for tp in sorted({1, max(t for t in range(1, 9) if heads % t == 0)}):
            try:
                layout = layout_from_hf_config(data, tensor_parallel_size=tp)
            except InvalidFieldError:
                continue  # a KV-head count this TP cannot split
            for spec in layout.layers.values():
                if not isinstance(spec, AttentionSpec):
                    continue
                hkv = spec.num_kv_heads
                hq = heads // tp if isinstance(spec, MLAAttentionSpec) else max(hkv, heads // tp)
                key = (AttentionMask.for_spec(spec), spec.dtype, hq // hkv, spec.head_size, spec.block_size)
                out.setdefault(key, f"{path.name[:-5]}-tp{tp}")
    return [(name, mask, dt, group, d, bs) for (mask, dt, group, d, bs), name in out.items()]


SHAPES = _fixture_shapes()


def _case(seed, dtype, ctx_lens, nqueries, bs, hkv, group, d, dev, pad_every=3):
    """K/V of each request written through its slots by the write kernel (slot mapping with a
    ``-1`` entry after every ``pad_every`` tokens, whose K/V is garbage that must land nowhere) and
    by plain indexing on a reference copy (bit-equal checked); the last ``nqueries[r]`` positions
    of request ``r`` query. Returns the paged-attention arguments and the per-request K/V."""
    from kvref.impl.torch.triton_kernels.write_kv import write_kv_triton

    g = torch.Generator().manual_seed(seed)
    nblk = [-(-n // bs) for n in ctx_lens]
    num_blocks = 1 + sum(nblk) + 1
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    table = torch.zeros((len(ctx_lens), max(nblk)), dtype=torch.int32)
    noise = torch.randn((num_blocks, 2, bs, hkv, d), generator=g, dtype=torch.float64).to(dtype)
    ref, cache = noise.clone(), noise.to(dev)
    seqs, rows, qpos = [], [], []
    for r, (n, nq, nb) in enumerate(zip(ctx_lens, nqueries, nblk)):
        table[r, :nb] = torch.tensor(perm[:nb], dtype=torch.int32)
        perm = perm[nb:]
        k = torch.randn((n, hkv, d), generator=g, dtype=torch.float64).to(dtype)
        v = torch.randn((n, hkv, d), generator=g, dtype=torch.float64).to(dtype)
        slots = slot_mapping(table, torch.arange(n), bs, torch.full((n,), r))
        ref[slots // bs, 0, slots % bs] = k
        ref[slots // bs, 1, slots % bs] = v
        pad = torch.arange(n + n // pad_every) % (pad_every + 1) == pad_every
        padded_slots = torch.full((pad.numel(),), -1, dtype=torch.int64)
        padded_slots[~pad] = slots
        kp = torch.full((pad.numel(), hkv, d), 7.0, dtype=dtype)
        vp = kp.clone()
        kp[~pad], vp[~pad] = k, v
        write_kv_triton(cache, padded_slots.to(dev), kp.to(dev), vp.to(dev), allow_padding=True)
        seqs.append((k, v))
        rows += [r] * min(nq, n)
        qpos += range(n - min(nq, n), n)
    assert torch.equal(cache.cpu().view(torch.uint8), ref.view(torch.uint8)), "write kernel != indexed write"
    q = torch.randn((len(rows), hkv * group, d), generator=g, dtype=torch.float64).to(dtype)
    args = [q, cache, table, torch.tensor(ctx_lens), torch.tensor(rows), torch.tensor(qpos)]
    return [a.to(dev) for a in args], seqs


def _check(args, seqs, mask, dtype, **tuning):
    from kvref.impl.torch.triton_kernels.attention import paged_attention_triton

    got = paged_attention_triton(*args, mask, **tuning).cpu()
    assert got.dtype == dtype and got.shape == args[0].shape
    tol = TOLERANCE[dtype]
    torch_path = paged_attention(*[a.cpu() for a in args], mask)
    vs_torch = float((got.double() - torch_path.double()).abs().max())
    vs_dense = float((got.double() - _dense(args, seqs, mask).double()).abs().max())
    assert vs_dense <= tol and vs_torch <= tol, f"{dtype} {mask} {tuning}: vs dense {vs_dense}, vs torch {vs_torch}"


#: (tile, splits, group_block) rotated over the fixture cases; None = the wrapper's default
TUNINGS = ((None, 1, None), (16, 2, None), (32, 3, 16), (8, 1, None), (None, 2, 16))


@pytest.mark.parametrize("i", range(len(SHAPES)),
                         ids=[f"{n}-{m.kind}{m.size or ''}-{dt}-gqa{g}-d{d}-bs{bs}" for n, m, dt, g, d, bs in SHAPES])
def test_fixture_attention_shapes_through_the_kernels(i):
    _, mask, dt, group, d, bs = SHAPES[i]
    if bs > CI_MAX_BLOCK and not NIGHTLY:
        pytest.skip(f"block size {bs} > {CI_MAX_BLOCK}: a context past one block is slow in the interpreter "
                    "(nightly profile; hybrid block sizes 144-544 run at ci)")
    tile, splits, group_block = TUNINGS[i % len(TUNINGS)]
    hkv = 1 + i % 2 if group <= 16 else 1        # 1-2 KV heads; the 128-head MLA group once
    if kernel_device() == "cuda":
        from kvref.impl.torch.triton_kernels.attention import device_shared_limit, kernel_config

        try:  # an explicit tuning this GPU's shared memory cannot hold is refused (issue #24)
            kernel_config(DTYPES[dt], mask.kind, group * hkv, hkv, d, bs, True, splits > 1, tile, None, group_block,
                          shared_limit=device_shared_limit(torch.device("cuda")))
        except InvalidFieldError:
            tile = group_block = None
    # A prefill chunk of 4 whose queries cross the first block boundary, and a decode two tokens
    # past it: contexts bs + 2 and bs + 3 (for the 1-token block no boundary is special).
    args, seqs = _case(i, DTYPES[dt], [bs + 2, bs + 3], [4, 1], bs, hkv, group, d, kernel_device())
    _check(args, seqs, mask, DTYPES[dt], tile=tile, num_splits=splits, group_block=group_block)


def test_the_fixtures_cover_the_shapes_real_models_use():
    """What the parametrized test above covers; fails if the fixtures (or their derivation) stop
    reaching the shapes named in the module docstring."""
    heads = {d for _, _, _, _, d, _ in SHAPES}
    groups = {g for _, _, _, g, _, _ in SHAPES}
    blocks = {bs for *_, bs in SHAPES}
    kinds = {m.kind for _, m, *_ in SHAPES}
    assert {64, 128, 256, 576} <= heads, heads
    assert {1, 2, 4, 8, 128} <= groups and any(g & (g - 1) for g in groups), groups
    assert {16, 64} <= blocks and any(b & (b - 1) for b in blocks), blocks
    assert kinds == {"causal", "sliding_window", "chunked_local"}, kinds


MASKS = st.one_of(st.just(AttentionMask()),
                  st.builds(AttentionMask, st.just("sliding_window"), st.integers(1, 40) | st.just(4096)),
                  st.builds(AttentionMask, st.just("chunked_local"), st.integers(1, 40) | st.just(8192)))


@settings(max_examples=profile_examples(3, 8, 150), deadline=None)
@given(seed=st.integers(0, 2**16), dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32,
                                                          torch.float64]),
       d=st.sampled_from([64, 80, 96, 112, 128, 256]), group=st.sampled_from([1, 4, 8, 16]),
       bs=st.sampled_from([16, 32, 64, 128, 5, 12, 48, 80]), hkv=st.integers(1, 2),
       extra=st.integers(1, 12), nq=st.integers(1, 6), mask=MASKS,
       tile=st.sampled_from([None, 8, 16, 32]), splits=st.integers(1, 3), group_block=st.sampled_from([None, 16]))
def test_generated_real_head_sizes_and_gqa_ratios(seed, dtype, d, group, bs, hkv, extra, nq, mask, tile, splits,
                                                  group_block):
    # A context past the first block boundary by `extra` tokens; the prefill chunk of `nq` queries
    # and a decode; the window/chunk may be smaller than, unaligned with, or larger than it.
    args, seqs = _case(seed, dtype, [bs + extra, max(1, bs // 2 + extra)], [nq, 1], bs, hkv, group, d,
                       kernel_device(), pad_every=1 + seed % 4)
    _check(args, seqs, mask, dtype, tile=tile, num_splits=splits, group_block=group_block)


def test_padded_slots_are_skipped_only_when_asked():
    from kvref.impl.torch.triton_kernels.write_kv import write_kv_triton

    dev = kernel_device()
    cache = torch.zeros((3, 2, 5, 1, 80), device=dev)
    k = torch.ones((3, 1, 80), device=dev)
    with pytest.raises(InvalidFieldError, match="slots"):
        write_kv_triton(cache, torch.tensor([4, -1, 7], device=dev), k, k)
    with pytest.raises(InvalidFieldError, match="slots"):
        write_kv_triton(cache, torch.tensor([4, -2, 7], device=dev), k, k, allow_padding=True)
    write_kv_triton(cache, torch.tensor([4, -1, 7], device=dev), k, 2 * k, allow_padding=True)
    c = cache.cpu()
    assert float(c.sum()) == 3 * 2 * 80  # two tokens, K ones and V twos: the padded one landed nowhere
    assert bool((c[0, 0, 4] == 1).all()) and bool((c[1, 1, 2] == 2).all())


def test_group_blocks_and_their_limits_are_validated():
    from kvref.impl.torch.triton_kernels.attention import kernel_config, paged_attention_triton

    # the 128-head MLA group at 576 lanes (512 + 64) runs in blocks of 16 heads; float64 in blocks of 2
    cfg = kernel_config(torch.bfloat16, "causal", 128, 1, 576, 64, True, False)
    consts = cfg.consts
    assert (consts["GROUP_P"], consts["HEAD_BLOCKS"], consts["HEAD_A"], consts["HEAD_B"], consts["TILE"],
            cfg.num_warps, cfg.num_stages) == (16, 8, 512, 64, 16, 8, 2)
    consts = kernel_config(torch.float64, "causal", 128, 1, 576, 64, True, False).consts
    assert (consts["GROUP_P"], consts["HEAD_BLOCKS"], consts["TILE"], consts["USE_DOT"]) == (2, 64, 4, False)
    dev = kernel_device()
    q, cache = torch.zeros(2, 2, 4, device=dev), torch.zeros(5, 2, 4, 1, 4, device=dev)
    table, ctx, rows, pos = (torch.tensor([[1, 2]], dtype=torch.int32, device=dev), torch.tensor([8], device=dev),
                             torch.tensor([0, 0], device=dev), torch.tensor([6, 7], device=dev))
    with pytest.raises(InvalidFieldError, match="group_block"):
        paged_attention_triton(q, cache, table, ctx, rows, pos, group_block=3)
    # a pool of 2**31 blocks (a zero-stride view: no memory) cannot go through an int32 table
    huge = torch.zeros(1, 2, 4, 1, 4, device=dev).expand(2**31, 2, 4, 1, 4)
    with pytest.raises(InvalidFieldError, match="2147483647 blocks"):
        paged_attention_triton(q, huge, table, ctx, rows, pos)


@pytest.mark.parametrize("dtype,group,group_block,tile", [(torch.float64, 5, 2, 4),    # broadcast path: 3 blocks
                                                          (torch.float32, 20, 16, 16),  # tl.dot path: 2 blocks
                                                          (torch.bfloat16, 24, 16, 32)])
def test_query_heads_split_over_head_blocks(dtype, group, group_block, tile):
    """A group wider than one program's head block runs in several; the last block's padding heads
    (which index the next KV head's queries) must neither read nor write."""
    from kvref.impl.torch.triton_kernels.attention import kernel_config

    consts = kernel_config(dtype, "causal", 2 * group, 2, 80, 12, False, False, tile, None, group_block).consts
    assert consts["HEAD_BLOCKS"] == -(-group // group_block) > 1
    args, seqs = _case(3, dtype, [29, 14], [5, 1], 12, 2, group, 80, kernel_device())
    _check(args, seqs, AttentionMask("sliding_window", 17), dtype, tile=tile, num_splits=2, group_block=group_block)
