"""The data path catches bookkeeping faults on its own: each mutant gives wrong numbers.

No invariant check and no comparison with vLLM is involved: the only oracle is dense attention
over the contiguous sequence. The unmutated implementation runs the same scenario exactly.
"""

from __future__ import annotations

import pytest
import torch

from kvref.impl.interface import PoolConfig
from kvref.impl.request import Request
from kvref.impl.torch.kv_cache_tensors import KVCacheTensors
from kvref.impl.torch.manager import TorchKVCacheManager
from kvref.impl.torch.model_runner import Chunk, DataPathRunner
from kvref.impl.torch.offload_copy import OffloadCopier
from kvref.models.machines.torch_datapath import DataPathScheduler
from kvref.models.mutants.torch_catalogue import EarlySlidingWindowFree, UncountedHitTouch, WrongCpuBlockLoader
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec

KW = dict(num_kv_heads=2, head_size=8, dtype="float32")
EXACT = 1e-10


def _cfg(specs, num_blocks=40):
    return PoolConfig(num_blocks=num_blocks, groups=tuple(KVCacheGroupSpec((f"g{i}",), s) for i, s in enumerate(specs)),
                      max_model_len=64, scheduler_block_size=4, hash_block_size=4)


def _swa_run(cls, window, block_size, hybrid):
    specs = (SlidingWindowSpec(block_size=block_size, sliding_window=window, **KW),)
    if hybrid:
        specs = (FullAttentionSpec(block_size=block_size, **KW),) + specs
    cfg = PoolConfig(num_blocks=48, groups=tuple(KVCacheGroupSpec((f"g{i}",), s) for i, s in enumerate(specs)),
                     max_model_len=64, scheduler_block_size=block_size, hash_block_size=block_size)
    sched = DataPathScheduler(cls(cfg, device="cpu"), budget=5)
    sched.add(Request("a", list(range(22)), max_tokens=6))
    sched.add(Request("b", list(range(30, 47)), max_tokens=6))
    return sched.run()


@pytest.mark.parametrize("window,block_size,hybrid", [(6, 4, False), (9, 4, True), (5, 2, False), (16, 4, True)])
def test_sliding_window_block_freed_one_block_early_is_caught(window, block_size, hybrid):
    assert _swa_run(TorchKVCacheManager, window, block_size, hybrid) <= EXACT
    assert _swa_run(EarlySlidingWindowFree, window, block_size, hybrid) > 1e-3


def _shared_prefix_run(cls):
    sched = DataPathScheduler(cls(_cfg((FullAttentionSpec(block_size=4, **KW),), num_blocks=10), device="cpu"),
                              budget=16)
    sched.add(Request("a", list(range(12)), max_tokens=2))
    sched.step()
    sched.add(Request("b", list(range(12)) + [7], max_tokens=8))  # hits a's first two blocks
    sched.step()
    sched.finish("a")  # the shared blocks must stay with b
    sched.add(Request("c", list(range(40, 60)), max_tokens=3))  # needs most of the pool
    return sched.run()


def test_reusing_a_block_still_referenced_is_caught():
    assert _shared_prefix_run(TorchKVCacheManager) <= EXACT
    assert _shared_prefix_run(UncountedHitTouch) > 1e-3


def _offload_round_trip(copier_cls):
    """Prefill a request, offload its blocks, clobber them on the device, load them back, decode."""
    cfg = _cfg((FullAttentionSpec(block_size=4, **KW), SlidingWindowSpec(block_size=4, sliding_window=8, **KW)))
    mgr = TorchKVCacheManager(cfg, device="cpu")
    runner = DataPathRunner(mgr, num_layers=2)
    req = Request("a", list(range(13)), max_tokens=4)
    assert mgr.allocate_slots(req, 13) is not None
    runner.run_step([Chunk(req, 0, 13)])
    req.num_computed_tokens = 13
    live = sorted({b for g in mgr.get_block_ids("a") for b in g if b})
    copier = copier_cls(runner.cache, num_cpu_blocks=len(live) + 2)
    job = [(b, i + 1) for i, b in enumerate(live)]  # cpu slots 1.. (slot 0 and the last stay empty)
    copier.store(job).wait()
    for t in runner.cache.backing:
        t[live] = 0.0
    copier.load(job).wait()
    req.output_token_ids.append(3)
    assert mgr.allocate_slots(req, 1) is not None
    chunk = [Chunk(req, 13, 1)]
    paged, dense = runner.run_step(chunk), runner.dense_step(chunk)
    return max(float((paged[k] - dense[k]).abs().max()) for k in paged)


def test_loading_from_the_wrong_cpu_block_is_caught():
    assert _offload_round_trip(OffloadCopier) <= EXACT
    assert _offload_round_trip(WrongCpuBlockLoader) > 1e-3


@pytest.mark.parametrize("mutant", [EarlySlidingWindowFree, UncountedHitTouch])
def test_generated_workloads_find_each_bookkeeping_mutant_by_numbers(mutant):
    """Not only hand-made scenarios: among generated data-path workloads (the same strategy the
    data-path test uses) Hypothesis finds one where the mutant's outputs differ from dense
    attention. A mutant that raises instead does not count: only wrong numbers do."""
    import copy

    from hypothesis import HealthCheck, Phase, find, settings

    from tests.impl.torch.test_datapath import workloads

    def wrong_numbers(w) -> bool:
        cfg, reqs, budget, seed = w
        sched = DataPathScheduler(mutant(cfg, device="cpu"), budget=budget, seed=seed)
        for r in copy.deepcopy(reqs):
            sched.add(r)
        try:
            return sched.run(60) > 1e-6
        except Exception:  # noqa: BLE001 - crashing is not what this test is about
            return False

    found = find(workloads(), wrong_numbers,
                 settings=settings(max_examples=1000, phases=[Phase.generate], database=None,
                                   suppress_health_check=list(HealthCheck)))
    assert wrong_numbers(found)
