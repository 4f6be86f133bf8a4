"""The data path through the Triton back-end: bookkeeping faults still give wrong numbers.

``attention_backend="triton"`` routes every K/V write and paged-attention call of the
``DataPathRunner`` through the kernels (Triton's interpreter on CPU); dense attention stays the
oracle. The three torch mutants (``kvref.models.mutants.torch_catalogue``) must each be caught by wrong
numbers through the kernels, as they are through the torch path, and the unmutated runs must be
exact (float64: 1e-10). The kernel outputs must equal the torch path's step by step — also for
the mutants: both back-ends read the same corrupted cache, so both report the same wrong numbers.
"""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install triton==3.9.0, requirements/test.txt); "
                                     "the torch back-end is tested without it")

import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402

from kvref.impl.interface import PoolConfig  # noqa: E402
from kvref.impl.request import Request  # noqa: E402
from kvref.impl.torch.manager import TorchKVCacheManager  # noqa: E402
from kvref.impl.torch.model_runner import Chunk, DataPathRunner  # noqa: E402
from kvref.impl.torch.offload_copy import OffloadCopier  # noqa: E402
from kvref.models.machines.torch_datapath import DataPathScheduler  # noqa: E402
from kvref.models.mutants.torch_catalogue import EarlySlidingWindowFree, UncountedHitTouch, WrongCpuBlockLoader  # noqa: E402
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec  # noqa: E402
from tests.conftest import profile_examples  # noqa: E402
from tests.impl.torch.triton_support import USABLE, kernel_device, needs_triton  # noqa: E402

pytestmark = needs_triton
#: CPU tensors in the interpreter; CUDA where the kernels are compiled (a GPU machine, issue #24)
DEV = kernel_device() if USABLE else "cpu"

KW = dict(num_kv_heads=2, head_size=8, dtype="float32")
EXACT = 1e-10
WRONG = 1e-3


def _cfg(specs, num_blocks, block_size=4):
    return PoolConfig(num_blocks=num_blocks, groups=tuple(KVCacheGroupSpec((f"g{i}",), s) for i, s in enumerate(specs)),
                      max_model_len=64, scheduler_block_size=block_size, hash_block_size=block_size)


def _run_both(make_sched, must_schedule: bool = True) -> tuple[float, float, float]:
    """(torch back-end error vs dense, triton back-end error vs dense, max |triton - torch| over
    every scheduled token's output)."""
    runs = {}
    for backend in ("torch", "triton"):
        sched = make_sched(backend)
        sched.run()
        runs[backend] = sched
    a, b = runs["torch"], runs["triton"]
    assert a.outputs.keys() == b.outputs.keys(), "both back-ends must schedule the same chunks"
    assert a.outputs or not must_schedule, "the scenario must schedule something"
    diff = max((float((a.outputs[c][k] - b.outputs[c][k]).abs().max()) for c in a.outputs for k in a.outputs[c]),
               default=0.0)
    return a.max_error, b.max_error, diff


def _swa(cls, window, block_size, hybrid):
    specs = (SlidingWindowSpec(block_size=block_size, sliding_window=window, **KW),)
    if hybrid:
        specs = (FullAttentionSpec(block_size=block_size, **KW),) + specs

    def make(backend):
        sched = DataPathScheduler(cls(_cfg(specs, 48, block_size), device=DEV), budget=5, attention_backend=backend)
        sched.add(Request("a", list(range(22)), max_tokens=6))
        sched.add(Request("b", list(range(30, 47)), max_tokens=6))
        return sched
    return make


@pytest.mark.parametrize("window,block_size,hybrid", [(6, 4, False), (9, 4, True)])
def test_sliding_window_block_freed_early_is_caught_through_the_kernels(window, block_size, hybrid):
    torch_err, triton_err, diff = _run_both(_swa(TorchKVCacheManager, window, block_size, hybrid))
    assert torch_err <= EXACT and triton_err <= EXACT and diff <= EXACT
    torch_err, triton_err, diff = _run_both(_swa(EarlySlidingWindowFree, window, block_size, hybrid))
    assert triton_err > WRONG, f"the early free went unnoticed through the kernels ({triton_err})"
    assert torch_err > WRONG and diff <= EXACT


def _shared_prefix(cls):
    def make(backend):
        sched = DataPathScheduler(cls(_cfg((FullAttentionSpec(block_size=4, **KW),), 10), device=DEV),
                                  budget=16, attention_backend=backend)
        sched.add(Request("a", list(range(12)), max_tokens=2))
        sched.step()
        sched.add(Request("b", list(range(12)) + [7], max_tokens=8))  # hits a's first two blocks
        sched.step()
        sched.finish("a")  # the shared blocks must stay with b
        sched.add(Request("c", list(range(40, 60)), max_tokens=3))  # needs most of the pool
        return sched
    return make


def test_block_reused_while_referenced_is_caught_through_the_kernels():
    torch_err, triton_err, diff = _run_both(_shared_prefix(TorchKVCacheManager))
    assert torch_err <= EXACT and triton_err <= EXACT and diff <= EXACT
    torch_err, triton_err, diff = _run_both(_shared_prefix(UncountedHitTouch))
    assert triton_err > WRONG and torch_err > WRONG and diff <= EXACT


def _offload_round_trip(copier_cls, backend):
    """Prefill, store the blocks, clobber them, load them back (copy kernel), decode (attention kernel)."""
    cfg = _cfg((FullAttentionSpec(block_size=4, **KW), SlidingWindowSpec(block_size=4, sliding_window=8, **KW)), 40)
    mgr = TorchKVCacheManager(cfg, device=DEV)
    runner = DataPathRunner(mgr, num_layers=2, attention_backend=backend)
    req = Request("a", list(range(13)), max_tokens=4)
    assert mgr.allocate_slots(req, 13) is not None
    runner.run_step([Chunk(req, 0, 13)])
    req.num_computed_tokens = 13
    live = sorted({b for g in mgr.get_block_ids("a") for b in g if b})
    copier = copier_cls(runner.cache, num_cpu_blocks=len(live) + 2, backend=backend)
    job = [(b, i + 1) for i, b in enumerate(live)]
    copier.store(job).wait()
    for t in runner.cache.backing:
        t[live] = 0.0
    copier.load(job).wait()
    req.output_token_ids.append(3)
    assert mgr.allocate_slots(req, 1) is not None
    chunk = [Chunk(req, 13, 1)]
    paged, dense = runner.run_step(chunk), runner.dense_step(chunk)
    return max(float((paged[k] - dense[k]).abs().max()) for k in paged)


def test_load_from_the_wrong_cpu_block_is_caught_through_the_kernels():
    assert _offload_round_trip(OffloadCopier, "triton") <= EXACT
    wrong = _offload_round_trip(WrongCpuBlockLoader, "triton")
    assert wrong > WRONG
    assert abs(wrong - _offload_round_trip(WrongCpuBlockLoader, "torch")) <= EXACT


@settings(max_examples=profile_examples(3, 8, 80), suppress_health_check=list(HealthCheck))
@given(w=__import__("tests.impl.torch.test_datapath", fromlist=["workloads"]).workloads())
def test_generated_workloads_through_the_kernels_equal_dense_and_the_torch_path(w):
    cfg, reqs, budget, seed = w

    def make(backend):
        sched = DataPathScheduler(TorchKVCacheManager(cfg, device=DEV), budget=budget, seed=seed,
                                  attention_backend=backend)
        for r in copy.deepcopy(reqs):
            sched.add(r)
        return sched
    torch_err, triton_err, diff = _run_both(make, must_schedule=False)
    assert triton_err <= EXACT and diff <= EXACT, (triton_err, diff)


def test_differential_machine_runs_the_data_path_through_the_kernels(monkeypatch):
    """The torch-vs-reference machine with the data path on, kernels selected: every scheduled
    chunk through the Triton kernels equals dense attention, and the bookkeeping matches. The
    machine draws Mamba and unaligned-chunk pools too (no data path there), so the run is
    derandomized and the kernel calls are counted: the test fails if the kernels never ran."""
    import kvref.impl.torch.triton_kernels.attention as attn
    from kvref.impl.reference.adapter import ReferenceKVCacheManager
    from kvref.models.machines.torch_differential import make_differential_machine

    calls = []
    real = attn.paged_attention_triton

    def counted(*a, **k):
        calls.append(a[0].shape[0])
        return real(*a, **k)
    monkeypatch.setattr(attn, "paged_attention_triton", counted)
    from kvref.impl.torch import make_manager

    machine = make_differential_machine(ReferenceKVCacheManager, lambda cfg: make_manager(cfg, device=DEV),
                                        datapath=True, attention_backend="triton")
    machine.TestCase.settings = settings(max_examples=profile_examples(8, 16, 160), stateful_step_count=15,
                                         derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    machine.TestCase().runTest()
    assert calls, "the kernels never ran: no drawn pool had a data path"


def test_datapath_runner_uses_the_selected_backend(monkeypatch):
    """Guard against a selector that silently falls back to torch: with the kernels broken, a
    triton runner fails and a torch runner does not."""
    import kvref.impl.torch.triton_kernels.attention as attn

    cfg = _cfg((FullAttentionSpec(block_size=4, **KW),), 8)
    req = Request("a", list(range(6)), max_tokens=1)

    def broken(*a, **k):
        raise RuntimeError("kernel called")
    monkeypatch.setattr(attn, "paged_attention_triton", broken)
    for backend in ("torch", "triton"):
        mgr = TorchKVCacheManager(cfg, device=DEV)
        assert mgr.allocate_slots(req, 6) is not None
        runner = DataPathRunner(mgr, attention_backend=backend, dtype=torch.float64)
        if backend == "torch":
            assert runner.max_error([Chunk(req, 0, 6)]) <= EXACT
        else:
            with pytest.raises(RuntimeError, match="kernel called"):
                runner.run_step([Chunk(req, 0, 6)])
        mgr.free(req)
