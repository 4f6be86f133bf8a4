"""Offload copy bandwidth of the torch data path vs a plain host<->device (on CPU: memcpy) copy.

A job of ``--blocks`` (gpu_block, cpu_block) pairs over ``--layers`` layers of pages of
``--page-kib`` KiB is stored (device -> host) and loaded (host -> device) by ``OffloadCopier``;
``contiguous`` jobs merge into one copy per layer, ``scattered`` jobs copy block by block. The
baseline moves the same number of bytes with one ``dst.copy_(src)`` between a device tensor and a
(pinned, on CUDA) host tensor, in the same run. Round trips are verified bit-exact before timing.

Run:  .venv/bin/python benchmarks/bench_torch_offload.py [--device cuda]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from kvref.impl.torch.kv_cache_tensors import KVCacheTensors
from kvref.impl.torch.offload_copy import OffloadCopier, host_buffer
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec


def timed(fn, repeats: int, device: torch.device) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--blocks", type=int, default=None)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--page-kib", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    blocks = args.blocks or (512 if on_gpu else 128)
    # page = 2 * block_size * heads * head_size * 2 bytes (bfloat16)
    heads, head = 8, 128
    block_size = max(1, args.page_kib * 1024 // (2 * heads * head * 2))
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head, dtype="bfloat16")
    cache = KVCacheTensors((KVCacheGroupSpec(("l",), spec),), blocks + 1, args.layers, torch.bfloat16, device)
    for t in cache.backing:
        t.copy_(torch.randn(t.shape, dtype=torch.float32).to(torch.bfloat16))
    copier = OffloadCopier(cache, blocks + 1)
    page_bytes = cache.block_stride * 2
    total = blocks * args.layers * page_bytes
    contiguous = [(g, g) for g in range(1, blocks + 1)]
    rng = random.Random(0)
    cpu_ids = list(range(1, blocks + 1))
    rng.shuffle(cpu_ids)
    scattered = list(zip(range(1, blocks + 1), cpu_ids))

    # correctness first: bit-exact round trip of the scattered job
    before = [t.clone() for t in cache.backing]
    copier.store(scattered).wait()
    for t in cache.backing:
        t.zero_()
    copier.load(scattered).wait()
    assert all(torch.equal(a[1:].view(torch.uint8), b[1:].view(torch.uint8)) for a, b in zip(cache.backing, before))

    rows = []
    for name, job in (("contiguous", contiguous), ("scattered", scattered)):
        t_store = timed(lambda: copier.store(job).wait(), args.repeats, device)
        t_load = timed(lambda: copier.load(job).wait(), args.repeats, device)
        rows.append((name, total / t_store / 1e9, total / t_load / 1e9))
    host = host_buffer((total // 2,), torch.bfloat16, device)  # pinned on CUDA
    dev = torch.empty(total // 2, dtype=torch.bfloat16, device=device)
    t_d2h = timed(lambda: host.copy_(dev, non_blocking=on_gpu), args.repeats, device)
    t_h2d = timed(lambda: dev.copy_(host, non_blocking=on_gpu), args.repeats, device)
    base = "device<->pinned host copy" if on_gpu else "CPU memcpy (tensor copy_)"
    name = torch.cuda.get_device_name(device) if on_gpu else "CPU"
    print(f"device={name} blocks={blocks} layers={args.layers} page={page_bytes // 1024} KiB "
          f"job bytes={total / 1e6:.1f} MB (bit-exact round trip verified)")
    print("| job | store GB/s | load GB/s | store / baseline | load / baseline |")
    print("|---|---|---|---|---|")
    for job, s, l_ in rows:
        print(f"| {job} | {s:.2f} | {l_:.2f} | {s / (total / t_d2h / 1e9):.2f} | {l_ / (total / t_h2d / 1e9):.2f} |")
    print(f"| baseline: {base} | {total / t_d2h / 1e9:.2f} | {total / t_h2d / 1e9:.2f} | 1.00 | 1.00 |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
