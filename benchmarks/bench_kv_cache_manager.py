"""Reference KVCacheManager vs vLLM 0.33.0's, same trace, one process.

Workload (as vLLM's own CPU probe): hybrid full attention + sliding window (window 32), block
size 16, 1024 blocks, prefix caching on, sha256 block hashes. Each cycle builds a 100-token
request (8 shared 64-token prefixes + a 36-token suffix from a fixed pool of 4), looks up its
prefix hit, allocates its slots and frees it. Both sides run the identical sequence; the script
checks they produce the same hit lengths and block ids before timing.

Run:  .venv/bin/python benchmarks/bench_kv_cache_manager.py [--cycles 5000] [--repeats 8]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

BLOCK_SIZE = 16
NUM_BLOCKS = 1024
WINDOW = 32


def prompts() -> list[list[int]]:
    prefixes = [[p * 10_000 + i for i in range(64)] for p in range(8)]
    suffixes = [[s * 100 + 50_000 + i for i in range(36)] for s in range(4)]
    return [prefixes[i % 8] + suffixes[(i // 8) % 4] for i in range(32)]


def pool_config():
    """The pool both sides run: the hybrid model planned as vLLM's startup plans it, the block
    count fixed (``--num-gpu-blocks-override``), so both managers get the same plan's values."""
    from kvref.impl.interface import PoolConfig
    from kvref.spec import EngineConfig, plan_kv_cache
    from kvref.spec.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    full = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype="float32")
    swa = SlidingWindowSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype="float32",
                            sliding_window=WINDOW)
    engine = EngineConfig(block_size=BLOCK_SIZE, max_model_len=8192, num_gpu_blocks_override=NUM_BLOCKS)
    return PoolConfig.from_plan(plan_kv_cache({"f": full, "s": swa}, engine, 0))


def reference_cycle_fn():
    from kvref.impl.reference.kv_cache_manager import KVCacheManager
    from kvref.impl.request import Request

    mgr = KVCacheManager(pool_config())
    ps = prompts()

    def cycle(i: int):
        req = Request(f"r{i}", ps[i % len(ps)])
        hits, n_hit, _ = mgr.get_computed_blocks(req)
        out = mgr.allocate_slots(req, req.num_tokens - n_hit, n_hit, hits)
        req.num_computed_tokens = req.num_tokens
        mgr.free(req)
        return n_hit, out.get_block_ids()

    return cycle, mgr


def vllm_cycle_fn():
    """vLLM's own ``KVCacheManager``, built by kvref's one manager builder from the same pool
    (``make_vllm_manager``: the converter and the NONE_HASH set-up every vLLM adapter uses), driven
    directly, nothing of kvref's adapter inside the cycle. vLLM's ``Request`` is built here with
    vLLM's own constructor on purpose, not through kvref's door (``vrequest``): the door's
    argument checks cost ~20 us a request, half a cycle, and would be charged to vLLM's time."""
    from kvref.impl.vllm import make_vllm_manager
    from kvref.impl.vllm.loader import load_vllm

    v = load_vllm()
    mgr = make_vllm_manager(pool_config()).vllm_manager
    hasher = v["get_request_block_hasher"](BLOCK_SIZE, v["sha256"])
    ps = prompts()
    params, VRequest = v["SamplingParams"](max_tokens=16), v["VRequest"]

    def cycle(i: int):
        req = VRequest(f"r{i}", ps[i % len(ps)], params, None, block_hasher=hasher)
        hits, n_hit, _ = mgr.get_computed_blocks(req)
        out = mgr.allocate_slots(req, req.num_tokens - n_hit, n_hit, hits)
        req.num_computed_tokens = req.num_tokens
        mgr.free(req)
        return n_hit, out.get_block_ids()

    return cycle, mgr


def rate(cycle, n: int) -> float:
    """Cycles per second of this process's CPU time (the machine is shared: wall time is noisy)."""
    t = time.process_time()
    for i in range(n):
        cycle(i)
    return n / (time.process_time() - t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=5_000, help="cycles per round")
    ap.add_argument("--repeats", type=int, default=8, help="interleaved rounds per side")
    args = ap.parse_args()
    ref_cycle, ref_mgr = reference_cycle_fn()
    vllm_cycle, vllm_mgr = vllm_cycle_fn()
    # Same trace, same answers (hit lengths and block ids) before anything is timed.
    for i in range(200):
        a, b = ref_cycle(i), vllm_cycle(i)
        assert (a[0], tuple(map(list, a[1]))) == (b[0], tuple(map(list, b[1]))), (i, a, b)
    ref_rates, vllm_rates = [], []
    for _ in range(args.repeats):  # interleaved, so machine noise hits both alike
        ref_rates.append(rate(ref_cycle, args.cycles))
        vllm_rates.append(rate(vllm_cycle, args.cycles))
    ref, vll = max(ref_rates), max(vllm_rates)
    print(f"workload: hybrid FA+SWA(window {WINDOW}), block 16, {NUM_BLOCKS} blocks, 100-token prompts "
          f"(8 shared 64-token prefixes), prefix caching, sha256; best of {args.repeats} x {args.cycles} cycles")
    print(f"reference: {ref:,.0f} cycles/s (CPU time; median round {sorted(ref_rates)[len(ref_rates) // 2]:,.0f})")
    print(f"vLLM 0.33.0: {vll:,.0f} cycles/s (CPU time; median round {sorted(vllm_rates)[len(vllm_rates) // 2]:,.0f})")
    print(f"ratio reference/vLLM: {ref / vll:.2f}x")
    assert ref_mgr.get_num_free_blocks() == vllm_mgr.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
