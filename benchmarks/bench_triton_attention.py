"""Decode throughput of the Triton paged-attention kernel vs the device's measured copy bandwidth.

One command on a CUDA machine (goal from issue #18: the kernel's effective K/V read bandwidth
>= 60 % of a plain device copy's, measured side by side in the same run):

    .venv/bin/python benchmarks/bench_triton_attention.py                 # bfloat16, batch 64, context 4096
    .venv/bin/python benchmarks/bench_triton_attention.py --window 1024   # sliding window: reads 1024 keys

Decode step: ``--batch`` requests, one query token each over ``--context`` cached tokens,
``--kv-heads`` x ``--head-size``, GQA ``--gqa``, block size ``--block-size``, block tables
scattered over the pool. Figures: step time, tokens/s, the bytes of K/V the step must read
divided by its time, and the bandwidth of ``dst.copy_(src)`` over the same number of bytes (read
+ write counted). The torch path (gather + matmul) is timed beside it. ``--check-only`` runs the
correctness check alone (every mask, every attention shape of the packaged config.json fixtures,
the K/V write, an offload round trip through pinned host memory, all against the torch path on
the device); the GPU-marked test runs it.

Without CUDA the command refuses (exit 2) — Triton has no CPU back-end — unless ``--interpreter``
is given: then the same kernel runs in Triton's interpreter on a small CPU shape, which measures
the cost of checking the kernels on CPU (CI), not their speed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

DTYPES = ("float32", "bfloat16", "float16", "float64")


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--interpreter", action="store_true", help="run on CPU tensors in Triton's interpreter")
    ap.add_argument("--check-only", action="store_true", help="correctness check on CUDA, no timing")
    ap.add_argument("--dtype", choices=DTYPES, default=None, help="default: bfloat16 (cuda), float32 (interpreter)")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--context", type=int, default=None)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--head-size", type=int, default=None)
    ap.add_argument("--gqa", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--window", type=int, default=0, help="sliding window (0 = causal)")
    ap.add_argument("--splits", type=int, default=None, help="key-range splits (default: the kernel's choice)")
    ap.add_argument("--tile", type=int, default=None)
    ap.add_argument("--num-warps", type=int, default=None)
    ap.add_argument("--num-stages", type=int, default=None)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sweep", type=float, default=0, metavar="SECONDS",
                    help="after the default run, time a grid of tunings (tile x warps x stages x splits) in "
                         "this process for at most SECONDS (compiles included); one table, fastest first")
    args = ap.parse_args(argv)
    for name in ("batch", "context", "kv_heads", "head_size", "gqa", "block_size", "repeats"):
        v = getattr(args, name)
        if v is not None and v < 1:
            ap.error(f"--{name.replace('_', '-')}={v}: expected a positive int")
    if args.sweep < 0:
        ap.error(f"--sweep={args.sweep}: expected >= 0 seconds")
    if args.window < 0 or args.threads < 0:
        ap.error(f"--window={args.window} / --threads={args.threads}: expected >= 0")
    return ap, args


def timed(fn, sync, repeats: int, inner: int) -> float:
    """Best over ``repeats`` of the mean time of ``inner`` back-to-back calls."""
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t) / inner)
    return best


def graph_timed(fn, repeats: int, inner: int) -> float | None:
    """Device time of one ``fn()`` without host overhead: ``inner`` calls captured in a CUDA graph
    (as an engine runs decode), the best of ``repeats`` replays timed with CUDA events. ``None``
    when the calls cannot be captured. The eager figure (:func:`timed`) also counts the Python
    wrapper and the launches whenever the host is slower than the GPU (issue #24: the same
    configuration timed 0.38 ms in one process and 0.58-0.63 ms in the next, while ncu read the
    kernel at 370 us)."""
    import torch

    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn()
    except RuntimeError as exc:  # a call that cannot be captured: report it, time eagerly only
        print(f"(CUDA graph capture failed: {str(exc)[:120]})")
        return None
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / inner)
    return best


def check_real_shapes_on_cuda(dev, g) -> list[str]:
    """Every attention shape of the packaged config.json fixtures (``aot.real_shapes``: head sizes
    64-576, GQA 1-128, hybrid block sizes like 528/1568), 1-2 KV heads, two requests just past one
    block (a prefill chunk of 4 crossing the boundary and a decode), in the model's dtype, with the
    kernel's default tuning and 3 splits: compiled kernel vs the torch path on the device."""
    import torch

    from kvref.impl.torch.paged_attention import TOLERANCE, AttentionMask, paged_attention
    from kvref.impl.torch.triton_kernels.aot import real_shapes
    from kvref.impl.torch.triton_kernels.attention import paged_attention_triton

    failures = []
    for kind, size, dt, hq, hkv, d, bs in real_shapes():
        dtype = getattr(torch, dt)
        hkv2 = min(hkv, 2)
        q_heads = hq // hkv * hkv2
        mask = AttentionMask(kind, size)
        lens = [bs + 2, bs + 3]
        nblk = -(-max(lens) // bs)
        cache = torch.randn((1 + 2 * nblk, 2, bs, hkv2, d), generator=g).to(dtype).to(dev)
        table = (torch.randperm(2 * nblk, generator=g) + 1).reshape(2, nblk).to(torch.int32).to(dev)
        rows = torch.tensor([0] * 4 + [1], device=dev)
        pos = torch.tensor([bs - 2, bs - 1, bs, bs + 1, bs + 2], device=dev)
        q = torch.randn((5, q_heads, d), generator=g).to(dtype).to(dev)
        ctx = torch.tensor(lens, device=dev)
        ref = paged_attention(q, cache, table, ctx, rows, pos, mask)
        for splits in (None, 3):
            got = paged_attention_triton(q, cache, table, ctx, rows, pos, mask, num_splits=splits)
            err = float((got.double() - ref.double()).abs().max())
            if not err <= 10 * TOLERANCE[dtype]:
                failures.append(f"attention {dt} {kind}{size or ''} gqa{hq // hkv} d{d} bs{bs} splits={splits}: {err}")
    return failures


def check_on_cuda() -> int:
    """Compiled kernels vs the torch path on the same CUDA device; 0 when all agree."""
    import torch

    from kvref.impl.torch.kv_cache_tensors import KVCacheTensors
    from kvref.impl.torch.offload_copy import OffloadCopier
    from kvref.impl.torch.paged_attention import TOLERANCE, AttentionMask, paged_attention
    from kvref.impl.torch.triton_kernels.attention import paged_attention_triton
    from kvref.impl.torch.triton_kernels.write_kv import write_kv_triton
    from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    failures = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        cache = torch.randn((64, 2, 16, 2, 64), generator=g).to(dtype).to(dev)
        table = (torch.randperm(63, generator=g)[:24] + 1).reshape(3, 8).to(torch.int32).to(dev)
        ctx = torch.tensor([128, 77, 5], device=dev)
        rows = torch.tensor([0] * 9 + [1, 2], device=dev)
        pos = torch.tensor(list(range(119, 128)) + [76, 4], device=dev)
        q = torch.randn((11, 8, 64), generator=g).to(dtype).to(dev)
        for mask in (AttentionMask(), AttentionMask("sliding_window", 33), AttentionMask("chunked_local", 32)):
            ref = paged_attention(q, cache, table, ctx, rows, pos, mask)
            for splits in (1, 3):
                got = paged_attention_triton(q, cache, table, ctx, rows, pos, mask, num_splits=splits)
                err = float((got.double() - ref.double()).abs().max())
                # the torch path may use TF32 matmuls on the GPU: allow 10x the CPU tolerance
                if not err <= 10 * TOLERANCE[dtype]:
                    failures.append(f"attention {dtype} {mask.kind} splits={splits}: {err}")
    failures += check_real_shapes_on_cuda(dev, g)
    kw = dict(num_kv_heads=2, head_size=64, dtype="bfloat16")
    groups = (KVCacheGroupSpec(("f",), FullAttentionSpec(block_size=16, **kw)),
              KVCacheGroupSpec(("s",), SlidingWindowSpec(block_size=8, sliding_window=40, **kw)))
    a = KVCacheTensors(groups, 32, 2, torch.bfloat16, dev)
    b = KVCacheTensors(groups, 32, 2, torch.bfloat16, dev)
    slots = torch.randperm(32 * 8, generator=g)[:50].to(dev)
    k, v = torch.randn((50, 2, 64), generator=g).to(dev), torch.randn((50, 2, 64), generator=g).to(dev)
    a.write_kv(1, 1, slots, k, v)
    write_kv_triton(b.kv(1, 1), slots, k, v)
    if not all(torch.equal(x, y) for x, y in zip(a.backing, b.backing)):
        failures.append("write_kv differs from the torch path")
    before = [t.clone() for t in b.backing]
    copier = OffloadCopier(b, 40, backend="triton")
    job = [(i, 39 - i) for i in range(1, 32)]
    copier.store(job).wait()
    for t in b.backing:
        t.zero_()
    copier.load(job).wait()
    if not all(torch.equal(x[1:].view(torch.int16), y[1:].view(torch.int16)) for x, y in zip(b.backing, before)):
        failures.append("offload round trip through pinned host memory is not bit-exact")
    for f in failures:
        print("FAIL", f)
    print("check failed" if failures else "check passed", f"({torch.cuda.get_device_name(dev)})")
    return 1 if failures else 0


#: relative error (max |out - exact| / max |exact|) allowed vs the float64 reference: a few units
#: in the last place of the output type (bfloat16 2**-8, float16 2**-11, float32 2**-23)
REL_TOLERANCE = {}


def _rel_tolerances():
    import torch

    REL_TOLERANCE.update({torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-5, torch.float64: 1e-12})


def dense_kv(cache, table, context: int, read: int, bs: int):
    """The last ``read`` of ``context`` keys and values of every row, gathered once into dense
    ``[B, Hkv, read, D]`` tensors (what a dense-cache attention would read)."""
    import torch

    nblk = -(-context // bs)
    pages = cache.index_select(0, table[:, :nblk].reshape(-1).long())
    pages = pages.view(table.shape[0], nblk, 2, bs, cache.shape[3], cache.shape[4])
    k = pages[:, :, 0].reshape(table.shape[0], nblk * bs, cache.shape[3], cache.shape[4])[:, context - read:context]
    v = pages[:, :, 1].reshape(table.shape[0], nblk * bs, cache.shape[3], cache.shape[4])[:, context - read:context]
    return k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()


def float64_reference(q, k, v, rows_per_chunk: int = 8):
    """Decode attention of ``q`` ``[B, Hq, D]`` over dense ``k``/``v`` ``[B, Hkv, L, D]`` in float64
    (GQA: query head ``h`` reads KV head ``h // (Hq / Hkv)``), a few rows at a time."""
    import torch

    b, hq, d = q.shape
    hkv = k.shape[1]
    out = []
    for i in range(0, b, rows_per_chunk):
        qq = q[i:i + rows_per_chunk].double().view(-1, hkv, hq // hkv, d)
        kk, vv = k[i:i + rows_per_chunk].double(), v[i:i + rows_per_chunk].double()
        p = torch.softmax(qq @ kk.transpose(-1, -2) * d ** -0.5, dim=-1)
        out.append((p @ vv).reshape(-1, hq, d))
    return torch.cat(out)


#: the grid ``--sweep`` walks, most promising first (a short budget keeps the head of it):
#: (tile, num_warps, num_stages, splits factor vs the default choice)
SWEEP = [(t, w, st, f) for f in (1, 2, 0.5) for t in (32, 64, 16) for w in (4, 8) for st in (2, 3, 4)]


def sweep(run, exact, kv_bytes: float, copy_gbs: float, default_splits: int, sync, repeats: int,
          budget_s: float, on_gpu: bool = False) -> list[tuple]:
    """Time each tuning of :data:`SWEEP` (``run(**tuning)`` -> output) until ``budget_s`` is spent;
    a tuning that does not fit or fails to compile is listed with the reason. Rows:
    ``(seconds or None, tile, warps, stages, splits, rel_error or None, note)``."""
    from kvref.spec.errors import InvalidFieldError

    rows, t0 = [], time.perf_counter()
    for tile, warps, stages, factor in SWEEP:
        if time.perf_counter() - t0 > budget_s:
            rows.append((None, tile, warps, stages, None, None, "budget spent: not timed"))
            break
        splits = max(1, min(64, int(round(default_splits * factor))))
        tuning = dict(tile=tile, num_warps=warps, num_stages=stages, num_splits=splits)
        try:
            out = run(**tuning)
            rel = float((out.double() - exact).abs().max() / exact.abs().max())
            secs = (graph_timed(lambda: run(**tuning), repeats, 20) if on_gpu else None) \
                or timed(lambda: run(**tuning), sync, repeats, 20)
            rows.append((secs, tile, warps, stages, splits, rel, ""))
        except (InvalidFieldError, RuntimeError, ValueError) as exc:  # OutOfResources is a RuntimeError
            rows.append((None, tile, warps, stages, splits, None, f"{type(exc).__name__}: {str(exc)[:80]}"))
    return rows


def print_sweep(rows, kv_bytes: float, copy_gbs: float, t_sdpa: float) -> None:
    print("| tile | warps | stages | splits | step time | K/V read GB/s | / device copy | time / SDPA | rel. error | note |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for secs, tile, warps, stages, splits, rel, note in sorted(rows, key=lambda r: (r[0] is None, r[0] or 0)):
        if secs is None:
            print(f"| {tile} | {warps} | {stages} | {splits or ''} | | | | | | {note.replace('|', '/')} |")
            continue
        gbs = kv_bytes / secs / 1e9
        print(f"| {tile} | {warps} | {stages} | {splits} | {secs * 1e3:.3f} ms | {gbs:.4g} | {gbs / copy_gbs:.3f} | "
              f"{secs / t_sdpa:.2f} | {rel:.2e} | {note} |")
    timed_rows = [r for r in rows if r[0] is not None]
    if timed_rows:
        best = min(timed_rows, key=lambda r: r[0])
        print(f"sweep best: tile {best[1]}, {best[2]} warps, {best[3]} stages, {best[4]} splits: "
              f"{kv_bytes / best[0] / 1e9 / copy_gbs:.3f} of device copy, {best[0] / t_sdpa:.2f}x SDPA")


def main(argv=None) -> int:
    ap, args = parse(argv)
    if args.interpreter:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are decorated (first import below)
    try:
        import triton  # noqa: F401
    except ImportError:
        print("bench_triton_attention: triton is not installed (pip install triton==3.9.0)", file=sys.stderr)
        return 2
    import torch

    _rel_tolerances()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.interpreter and not torch.cuda.is_available():
        print("bench_triton_attention: no CUDA device here. This benchmark measures the Triton kernels on a GPU "
              "(goal: decode K/V read bandwidth >= 60 % of device copy bandwidth). Run it on a CUDA machine, or "
              "pass --interpreter for CPU figures of Triton's interpreter (not a speed measurement).", file=sys.stderr)
        return 2
    if args.check_only:
        if args.interpreter:
            ap.error("--check-only checks the compiled kernels on CUDA; the interpreter is checked by the test suite")
        return check_on_cuda()

    from kvref.impl.torch.paged_attention import AttentionMask, paged_attention
    from kvref.impl.torch.triton_kernels.attention import paged_attention_triton

    on_gpu = not args.interpreter
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if on_gpu else "float32"))
    batch = args.batch or (64 if on_gpu else 4)
    context = args.context or (4096 if on_gpu else 256)
    hkv = args.kv_heads or (8 if on_gpu else 2)
    d = args.head_size or (128 if on_gpu else 64)
    bs = args.block_size
    blocks_per_req = -(-context // bs)
    num_blocks = 1 + batch * blocks_per_req
    g = torch.Generator().manual_seed(0)
    cache = torch.randn((num_blocks, 2, bs, hkv, d), generator=g, dtype=torch.float32).to(dtype).to(device)
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    table = perm[: batch * blocks_per_req].reshape(batch, blocks_per_req).to(torch.int32).to(device)
    q = torch.randn((batch, hkv * args.gqa, d), generator=g).to(dtype).to(device)
    ctx = torch.full((batch,), context, device=device)
    rows = torch.arange(batch, device=device)
    pos = torch.full((batch,), context - 1, device=device)
    mask = AttentionMask("sliding_window", args.window) if args.window else AttentionMask()
    read = min(context, args.window) if args.window else context

    sync = (lambda: torch.cuda.synchronize(device)) if on_gpu else (lambda: None)
    tuning = dict(num_splits=args.splits, tile=args.tile, num_warps=args.num_warps, num_stages=args.num_stages)
    out = paged_attention_triton(q, cache, table, ctx, rows, pos, mask, **tuning)  # checks the arguments once
    ref = paged_attention(q, cache, table, ctx, rows, pos, mask)
    err = float((out.double() - ref.double()).abs().max())
    # The peer: PyTorch SDPA on dense, contiguous K/V of the same shape (the keys the query reads).
    k_dense, v_dense = dense_kv(cache, table, context, read, bs)
    q4 = q[:, :, None, :]                                     # [B, Hq, 1, D]

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(q4, k_dense, v_dense, enable_gqa=True)[:, :, 0]
    outputs = {"triton": out, "torch": ref, "sdpa": sdpa()}
    exact = float64_reference(q, k_dense, v_dense)
    rel = {k: float((v.double() - exact).abs().max() / exact.abs().max()) for k, v in outputs.items()}
    inner = 20 if on_gpu else 1
    # Timed without the argument checks (each reads device values back: a sync per call).
    t_triton = timed(lambda: paged_attention_triton(q, cache, table, ctx, rows, pos, mask, validate=False, **tuning),
                     sync, args.repeats, inner)
    t_torch = timed(lambda: paged_attention(q, cache, table, ctx, rows, pos, mask), sync, args.repeats, inner)
    t_sdpa = timed(sdpa, sync, args.repeats, inner)
    # device time alone (CUDA graphs): what the kernel costs inside an engine's captured decode step
    g_triton = graph_timed(lambda: paged_attention_triton(q, cache, table, ctx, rows, pos, mask, validate=False,
                                                          **tuning), args.repeats, inner) if on_gpu else None
    g_sdpa = graph_timed(sdpa, args.repeats, inner) if on_gpu else None
    kv_bytes = batch * read * 2 * hkv * d * cache.element_size()
    src = torch.empty(kv_bytes // cache.element_size(), dtype=dtype, device=device)
    dst = torch.empty_like(src)
    t_copy = timed(lambda: dst.copy_(src), sync, args.repeats, inner)
    copy_gbs = 2 * kv_bytes / t_copy / 1e9  # a copy reads and writes every byte
    name = torch.cuda.get_device_name(device) if on_gpu else "CPU (Triton interpreter)"
    print(f"device={name} dtype={args.dtype or str(dtype)[6:]} batch={batch} context={context} kv_heads={hkv} "
          f"head_size={d} gqa={args.gqa} block_size={bs} "
          f"mask={mask.kind}{'/' + str(args.window) if args.window else ''}"
          f" max|triton - torch path|={err:.2e}")
    print("| path | step time | tokens/s | K/V read GB/s | / device copy | time / SDPA | rel. error vs float64 |")
    print("|---|---|---|---|---|---|---|")
    paths = [("triton kernel" + (" (interpreted)" if not on_gpu else ", eager (host overhead counted)"),
              t_triton, "triton", t_sdpa),
             ("torch path (gather + matmul)", t_torch, "torch", t_sdpa),
             ("PyTorch SDPA, dense contiguous K/V" + (", eager" if on_gpu else ""), t_sdpa, "sdpa", t_sdpa)]
    if g_triton and g_sdpa:  # each beside the same kind of SDPA time
        paths += [("triton kernel, CUDA graph (device time)", g_triton, "triton", g_sdpa),
                  ("PyTorch SDPA, CUDA graph (device time)", g_sdpa, "sdpa", g_sdpa)]
    for label, t, key, peer in paths:
        gbs = kv_bytes / t / 1e9
        print(f"| {label} | {t * 1e3:.3f} ms | {batch / t:,.1f} | {gbs:.3g} | {gbs / copy_gbs:.3g} | "
              f"{t / peer:.3g} | {rel[key]:.2e} |")
    print(f"| device copy (read+write), {kv_bytes / 1e6:.1f} MB | {t_copy * 1e3:.3f} ms | | {copy_gbs:.2f} | 1.000 | | |")
    if args.sweep:
        from kvref.impl.torch.triton_kernels.attention import default_splits as splits_for, kernel_config
        cfg = kernel_config(dtype, mask.kind, hkv * args.gqa, hkv, d, bs, on_gpu, False)
        auto = args.splits or splits_for(batch * hkv * cfg.consts["HEAD_BLOCKS"], context, cfg.consts["TILE"], device)
        rows_ = sweep(lambda **tn: paged_attention_triton(q, cache, table, ctx, rows, pos, mask, validate=False, **tn),
                      exact, kv_bytes, copy_gbs, auto, sync, args.repeats, args.sweep, on_gpu)
        print_sweep(rows_, kv_bytes, copy_gbs, g_sdpa or t_sdpa)
        bad_sweep = [r for r in rows_ if r[5] is not None and not r[5] <= REL_TOLERANCE[dtype]]
        if bad_sweep:
            print(f"FAIL: {len(bad_sweep)} sweep tunings above the relative tolerance {REL_TOLERANCE[dtype]:g}")
            return 1
    bad = [k for k, v in rel.items() if not v <= REL_TOLERANCE[dtype]]
    if bad:
        print(f"FAIL: relative error vs float64 above {REL_TOLERANCE[dtype]:g} for {', '.join(bad)}")
        return 1
    if on_gpu:
        # the goal is the kernel's: device time where graphs captured both, else the eager times
        k_t, s_t, how = (g_triton, g_sdpa, "CUDA graph") if g_triton and g_sdpa else (t_triton, t_sdpa, "eager")
        ratio = kv_bytes / k_t / 1e9 / copy_gbs
        print(f"goal ({how} times): triton / device copy >= 0.60: {'met' if ratio >= 0.60 else 'NOT met'} "
              f"({ratio:.3f}); triton time <= 1.5 x SDPA: {'met' if k_t <= 1.5 * s_t else 'NOT met'} "
              f"({k_t / s_t:.2f}x); host overhead per eager call beyond device time: "
              f"{max(0.0, t_triton - k_t) * 1e6:.0f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
