"""Paged-attention decode throughput of the torch data path vs the device's copy bandwidth.

Decode step: ``--batch`` requests, each one query token over ``--context`` cached tokens,
``--kv-heads`` KV heads x ``--head-size``, GQA factor ``--gqa``, block size ``--block-size``,
block tables scattered over the pool. The figure is the bytes of K/V the step must read divided
by its time, next to the measured bandwidth of a plain device copy of the same number of bytes
(read + write of a contiguous tensor, ``dst.copy_(src)``) in the same run. The ratio says how far
the gather-then-einsum reference implementation is from a memory-bound kernel.

Run:  .venv/bin/python benchmarks/bench_torch_paged_attention.py [--device cuda] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import time

import torch

from kvref.impl.torch.paged_attention import AttentionMask, paged_attention

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeats: int) -> float:
    fn()
    sync(device)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--context", type=int, default=None)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--gqa", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--window", type=int, default=0, help="sliding window (0 = causal)")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    dtype = DTYPES[args.dtype or ("bfloat16" if on_gpu else "float32")]
    batch = args.batch or (64 if on_gpu else 8)
    context = args.context or (4096 if on_gpu else 512)
    bs, hkv, d = args.block_size, args.kv_heads, args.head_size
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

    t_attn = timed(lambda: paged_attention(q, cache, table, ctx, rows, pos, mask), device, args.repeats)
    kv_bytes = batch * context * 2 * hkv * d * cache.element_size()
    src = torch.empty(kv_bytes // cache.element_size(), dtype=dtype, device=device)
    dst = torch.empty_like(src)
    t_copy = timed(lambda: dst.copy_(src), device, args.repeats)
    attn_gbs = kv_bytes / t_attn / 1e9
    copy_gbs = 2 * kv_bytes / t_copy / 1e9  # a copy reads and writes every byte
    name = torch.cuda.get_device_name(device) if on_gpu else "CPU"
    print(f"device={name} dtype={str(dtype).split('.')[-1]} batch={batch} context={context} "
          f"kv_heads={hkv} head_size={d} gqa={args.gqa} block_size={bs} mask={mask.kind}")
    print("| measure | value |")
    print("|---|---|")
    print(f"| decode step time | {t_attn * 1e3:.3f} ms |")
    print(f"| decode throughput | {batch / t_attn:,.0f} tokens/s |")
    print(f"| K/V bytes read per step | {kv_bytes / 1e6:.1f} MB |")
    print(f"| effective K/V read bandwidth | {attn_gbs:.2f} GB/s |")
    print(f"| device copy bandwidth (read+write) | {copy_gbs:.2f} GB/s |")
    print(f"| ratio attention / copy | {attn_gbs / copy_gbs:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
