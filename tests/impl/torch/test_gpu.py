"""The torch implementation on CUDA: same bookkeeping answers, data path within float32 tolerance.

Skipped (with the reason) where no CUDA device is present; the CPU runs of the same code are in
the other test modules.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings

from kvref.impl.interface import PoolConfig
from kvref.impl.request import Request
from kvref.impl.torch import make_manager
from kvref.impl.torch.paged_attention import TOLERANCE
from kvref.models.machines.torch_datapath import DataPathScheduler
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec

pytestmark = pytest.mark.gpu


def test_cuda_bookkeeping_matches_cpu_bookkeeping_on_generated_traces():
    from kvref.models.machines.torch_differential import make_differential_machine

    machine = make_differential_machine(lambda cfg: make_manager(cfg, device="cpu"),
                                        torch_factory=lambda cfg: make_manager(cfg, device="cuda"))
    machine.TestCase.settings = settings(max_examples=30, stateful_step_count=30)
    machine.TestCase().runTest()


def test_cuda_data_path_equals_dense_attention():
    kw = dict(num_kv_heads=2, head_size=64, dtype="float32")
    cfg = PoolConfig(num_blocks=64, groups=(KVCacheGroupSpec(("f",), FullAttentionSpec(block_size=16, **kw)),
                                            KVCacheGroupSpec(("s",), SlidingWindowSpec(block_size=16, sliding_window=40,
                                                                                       **kw))),
                     max_model_len=256, scheduler_block_size=16, hash_block_size=16)
    mgr = make_manager(cfg, device="cuda")
    assert mgr.pool.ref_cnt.is_cuda and mgr.batch_block_tables(0, [])[0].is_cuda
    sched = DataPathScheduler(mgr, budget=32, dtype=torch.float32)
    base = list(range(100))
    for i in range(6):
        sched.add(Request(f"r{i}", base[: 60 + 7 * i] + [i], max_tokens=8))
    assert sched.run() <= 100 * TOLERANCE[torch.float32]  # 1e-3: TF32 kernels, if enabled
    mgr.check_invariants()
