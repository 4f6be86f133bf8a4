"""Bookkeeping cost per scheduler step: torch implementation vs the reference (and vLLM 0.33.0).

Workload: hybrid full attention + sliding window (window 128), block size 16, ``--blocks``
blocks, prefix caching on. ``--batch`` requests decode one token per step (``allocate_slots(req,
1)``); every ``--turnover`` steps the oldest request finishes and a new one (a 256-token prompt
sharing one of 4 prefixes) is admitted with its prefix hit and the full-sequence gate. Every
implementation runs the identical trace; the script checks they return the same block ids and
free-queue order before timing. Figure: mean wall time per step, and the ratio to the reference.

Run:  .venv/bin/python benchmarks/bench_torch_bookkeeping.py [--device cuda] [--steps 300] [--no-vllm]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from kvref.impl.interface import PoolConfig  # noqa: E402
from kvref.impl.request import Request, RequestStatus  # noqa: E402
from kvref.spec import EngineConfig, plan_kv_cache  # noqa: E402
from kvref.spec.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec  # noqa: E402

BS = 16


def config(num_blocks: int) -> PoolConfig:
    kw = dict(block_size=BS, num_kv_heads=8, head_size=128, dtype="bfloat16")
    # planned as startup plans it for a 512-token step, the block count fixed (--num-gpu-blocks-override)
    engine = EngineConfig(block_size=BS, max_model_len=4096, max_num_batched_tokens=512,
                          num_gpu_blocks_override=num_blocks)
    layers = {"full": FullAttentionSpec(**kw), "swa": SlidingWindowSpec(sliding_window=128, **kw)}
    return PoolConfig.from_plan(plan_kv_cache(layers, engine, 0))


def prompt(i: int) -> list[int]:
    return [(i % 4) * 1000 + t for t in range(192)] + [50_000 + i * 64 + t for t in range(64)]


def run(mgr, steps: int, batch: int, turnover: int, record: bool):
    """Drive the trace; returns (seconds per step, observations)."""
    reqs: list[Request] = []
    n = 0
    seen = []

    def admit():
        nonlocal n
        r = Request(f"r{n}", prompt(n), max_tokens=100_000)
        n += 1
        ids, hit = mgr.get_computed_blocks(r)
        out = mgr.allocate_slots(r, r.num_tokens - hit, hit, ids, full_sequence_must_fit=True)
        if out is None:
            return
        r.num_computed_tokens = r.num_tokens
        r.status = RequestStatus.RUNNING
        reqs.append(r)
        if record:
            seen.append(("admit", hit, out))

    for _ in range(batch):
        admit()
    t0 = time.perf_counter()
    for step in range(steps):
        for r in list(reqs):
            r.output_token_ids.append(step % 7)
            out = mgr.allocate_slots(r, 1)
            if out is None:  # preempt
                mgr.free(r)
                reqs.remove(r)
                continue
            r.num_computed_tokens += 1
            if record and out != ((), ()):
                seen.append((r.request_id, out))
        if step % turnover == turnover - 1 and reqs:
            mgr.free(reqs.pop(0))
            admit()
    dt = (time.perf_counter() - t0) / steps
    if record:
        seen.append(("queue", mgr.free_block_queue()))
    return dt, seen


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--turnover", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=2048)
    ap.add_argument("--no-vllm", action="store_true")
    args = ap.parse_args(argv)
    from kvref.impl.reference.adapter import ReferenceKVCacheManager
    from kvref.impl.torch import make_manager

    impls = {"reference": lambda c: ReferenceKVCacheManager(c),
             f"torch ({args.device})": lambda c: make_manager(c, device=args.device)}
    if not args.no_vllm:
        try:
            from kvref.impl.vllm.kv_cache_manager import make_vllm_manager

            impls["vLLM 0.33.0"] = make_vllm_manager
        except Exception as exc:  # vLLM not installed
            print(f"(vLLM skipped: {exc!r})")
    cfg = config(args.blocks)
    check = {name: run(f(cfg), min(args.steps, 60), args.batch, args.turnover, record=True)[1]
             for name, f in impls.items()}
    first = next(iter(check.values()))
    for name, obs in check.items():
        assert obs == first, f"{name} diverges from the reference on the benchmark trace"
    times = {name: run(f(cfg), args.steps, args.batch, args.turnover, record=False)[0] for name, f in impls.items()}
    ref = times["reference"]
    print(f"hybrid full+SWA(128), block {BS}, {args.blocks} blocks, batch {args.batch}, "
          f"turnover every {args.turnover} steps, {args.steps} steps (identical block ids checked)")
    print("| implementation | ms / step | us / request-step | vs reference |")
    print("|---|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {t * 1e3:.2f} | {t * 1e6 / args.batch:.0f} | {t / ref:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
