"""Per-operation cost of the reference block pool at 10k vs 1M blocks (goal: within 1.5x).

Every pool operation is O(blocks it touches), so the pool size should not matter. Two workloads,
each run at both sizes after a warm-up that leaves the pool in steady state (the prefix-cache
index holds about as many keys as there are blocks, and the free queue is shuffled):

* ``pool``: raw BlockPool ops in a loop: get_new_blocks(8), cache_full_blocks, free_blocks
  (reverse order), get_cached_block hits, touch + free of a cached free block, evict_blocks.
* ``manager``: KVCacheManager admission cycles (FA + SWA, 100-token prompts, 1/4 of them
  resends of an earlier prompt), i.e. get_computed_blocks + allocate_slots + free.

Time is this process's CPU time, best of a few interleaved rounds.

Run:  .venv/bin/python benchmarks/bench_pool_scaling.py [--small 10000] [--large 1000000]
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from kvref.impl.interface import PoolConfig
from kvref.impl.reference.block_pool import BlockPool
from kvref.impl.reference.kv_cache_manager import KVCacheManager
from kvref.impl.request import Request
from kvref.spec import EngineConfig, plan_kv_cache
from kvref.spec.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

OPS_PER_POOL_ITER = 7  # get_new_blocks, cache_full_blocks, free_blocks, get_cached_block, touch, free, evict


class PoolWorkload:
    def __init__(self, num_blocks: int) -> None:
        self.pool = BlockPool(num_blocks, True, 16)
        self.rng = random.Random(0)
        self.counter = 0
        self.recent: list[bytes] = []
        # warm up: cycle through the whole pool twice, so the index holds most blocks' keys and
        # the free queue is shuffled
        for _ in range(2 * num_blocks // 8):
            self.iteration()

    def iteration(self) -> None:
        pool = self.pool
        blocks = pool.get_new_blocks(8)
        hashes = [b"%d" % (self.counter + i) for i in range(8)]
        self.counter += 8
        pool.cache_full_blocks(hashes, blocks, 0, 8, 16, 0)
        pool.free_blocks(blocks[::-1])
        self.recent.append(hashes[0])
        if len(self.recent) > 64:
            self.recent.pop(0)
        hit = pool.get_cached_block(self.rng.choice(self.recent), [0])
        if hit:
            pool.touch(hit)
            pool.free_blocks(hit)
        pool.evict_blocks([self.rng.randrange(1, pool.num_gpu_blocks)])

    def run(self, n: int) -> float:
        t = time.process_time()
        for _ in range(n):
            self.iteration()
        return (time.process_time() - t) / (n * OPS_PER_POOL_ITER) * 1e9


class ManagerWorkload:
    def __init__(self, num_blocks: int) -> None:
        full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype="float32")
        swa = SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=1, dtype="float32", sliding_window=32)
        # planned as startup plans it, the block count fixed (--num-gpu-blocks-override)
        engine = EngineConfig(block_size=16, max_model_len=8192, num_gpu_blocks_override=num_blocks)
        cfg = PoolConfig.from_plan(plan_kv_cache({"f": full, "s": swa}, engine, 0))
        self.mgr = KVCacheManager(cfg)
        self.rng = random.Random(0)
        self.i = 0
        self.history: list[list[int]] = []
        for _ in range(2 * num_blocks // 9):  # a new prompt takes ~12 blocks, 3 in 4 are new
            self.cycle()

    def cycle(self) -> None:
        self.i += 1
        if self.history and self.i % 4 == 0:
            prompt = self.rng.choice(self.history)
        else:
            prompt = [self.i * 1000 + t for t in range(100)]
            self.history.append(prompt)
            if len(self.history) > 256:
                self.history.pop(0)
        req = Request(f"r{self.i}", prompt)
        hits, n, _ = self.mgr.get_computed_blocks(req)
        assert self.mgr.allocate_slots(req, req.num_tokens - n, n, hits) is not None
        req.num_computed_tokens = req.num_tokens
        self.mgr.free(req)

    def run(self, n: int) -> float:
        t = time.process_time()
        for _ in range(n):
            self.cycle()
        return (time.process_time() - t) / n * 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", type=int, default=10_000)
    ap.add_argument("--large", type=int, default=1_000_000)
    ap.add_argument("--iters", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    for name, cls, iters in (("pool", PoolWorkload, args.iters), ("manager", ManagerWorkload, args.iters // 4)):
        t = time.process_time()
        small, large = cls(args.small), cls(args.large)
        setup = time.process_time() - t
        small_ns = min(small.run(iters) for _ in range(args.rounds))
        large_ns = min(large.run(iters) for _ in range(args.rounds))
        print(f"{name:8s} {args.small:>9,} blocks: {small_ns:9.0f} ns/op   {args.large:>9,} blocks: "
              f"{large_ns:9.0f} ns/op   ratio {large_ns / small_ns:.2f}x   "
              f"(warm-up {setup:.0f} s; large pool's cached keys: "
              f"{len((large.pool if name == 'pool' else large.mgr.block_pool).cached_block_hash_to_block):,})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
