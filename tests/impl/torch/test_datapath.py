"""The data path through the torch bookkeeping: real K/V, slot mappings, paged attention.

Generated pools (uniform and hybrid full/sliding-window/chunked-local) and request mixes with
shared prefixes run step by step; after every step the attention output of every scheduled token
equals dense attention over the contiguous sequence (float64 on CPU: near exact), and the
bookkeeping invariants hold. Prefix-cache hits reuse stored K/V and give the outputs a
recomputation gives.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvref.impl.interface import PoolConfig
from kvref.impl.request import Request
from kvref.impl.torch import make_manager
from kvref.impl.torch.kv_cache_tensors import KVCacheTensors
from kvref.impl.torch.mamba_state import MambaStateRunner, scan
from kvref.impl.torch.model_runner import DataPathRunner
from kvref.models.machines.torch_datapath import DataPathScheduler
from kvref.models.machines.torch_differential import ATTENTION_LAYOUTS, pool_configs
from kvref.spec.errors import InvalidFieldError
from kvref.spec.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from tests.conftest import profile_examples

EXACT = 1e-10


@st.composite
def workloads(draw):
    cfg = draw(pool_configs(ATTENTION_LAYOUTS, aligned_chunks=True))
    base = draw(st.lists(st.integers(0, 3), min_size=8, max_size=30))
    reqs = []
    for i in range(draw(st.integers(1, 5))):
        cut = draw(st.integers(0, len(base)))
        prompt = (base[:cut] + draw(st.lists(st.integers(0, 3), max_size=6)))[: cfg.max_model_len - 1] or [1]
        reqs.append(Request(f"r{i}", prompt, max_tokens=draw(st.integers(1, 6)),
                            cache_salt=draw(st.sampled_from([None, None, "s"]))))
    return cfg, reqs, draw(st.integers(1, 12)), draw(st.integers(0, 3))


@settings(max_examples=profile_examples(20, 80))
@given(w=workloads())
def test_paged_attention_through_bookkeeping_equals_dense(w):
    cfg, reqs, budget, seed = w
    sched = DataPathScheduler(make_manager(cfg, device="cpu"), budget=budget, seed=seed)
    for r in reqs:
        sched.add(r)
    for _ in range(60):
        if not sched.running and not sched.waiting:
            break
        log = sched.step()
        assert log.error <= EXACT, f"step {len(sched.log)}: paged vs dense differ by {log.error}"
        sched.m.check_invariants()


def _groups(specs):
    return tuple(KVCacheGroupSpec((f"g{i}",), s) for i, s in enumerate(specs))


def _cfg(groups, num_blocks=40, caching=True):
    return PoolConfig(num_blocks=num_blocks, groups=tuple(KVCacheGroupSpec((f"g{i}",), s) for i, s in enumerate(groups)),
                      max_model_len=64, scheduler_block_size=4, hash_block_size=4, enable_caching=caching)


KW = dict(num_kv_heads=2, head_size=8, dtype="float32")
LAYOUTS = {
    "fa": (FullAttentionSpec(block_size=4, **KW),),
    "swa": (SlidingWindowSpec(block_size=4, sliding_window=7, **KW),),
    "fa+swa": (FullAttentionSpec(block_size=4, **KW), SlidingWindowSpec(block_size=4, sliding_window=5, **KW)),
}


def _per_position(sched, rid):
    out = {}
    for (r, start), tensors in sched.outputs.items():
        if r != rid:
            continue
        for key, t in tensors.items():
            for i in range(t.shape[0]):
                out[(key, start + i)] = t[i]
    return out


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_prefix_hit_gives_the_outputs_of_recomputing(layout):
    prompt = list(range(10, 30))
    with_cache = DataPathScheduler(make_manager(_cfg(LAYOUTS[layout]), device="cpu"), budget=6, seed=1)
    with_cache.add(Request("a", prompt + [1], max_tokens=1))
    with_cache.run()
    with_cache.add(Request("b", prompt + [2, 3], max_tokens=3))
    with_cache.run()
    hit = next(log.hits["b"] for log in with_cache.log if "b" in log.hits)
    assert hit >= 8, "the scenario must produce a prefix hit"

    fresh = DataPathScheduler(make_manager(_cfg(LAYOUTS[layout], caching=False), device="cpu"), budget=6, seed=1)
    fresh.add(Request("b", prompt + [2, 3], max_tokens=3))
    fresh.run()
    got, want = _per_position(with_cache, "b"), _per_position(fresh, "b")
    assert got and set(got) <= set(want)
    assert min(p for _, p in got) == hit  # the hit tokens were not recomputed
    for key, t in got.items():
        assert torch.allclose(t, want[key], atol=EXACT, rtol=0), key
    assert with_cache.max_error <= EXACT and fresh.max_error <= EXACT


def test_misaligned_chunked_local_hit_shows_up_as_wrong_numbers():
    """vLLM's chunked-local lookup nulls every block before ``floor(chunk_start / block_size)`` and
    counts it as computed. With a chunk size that is not a multiple of the block size (vLLM's
    workers reject that: ``make_local_attention_virtual_batches`` asserts divisibility) the hit then
    covers tokens the rest of their chunk still attends to. The bookkeeping keeps vLLM's ids; the
    data path flags the outputs (see docs/differences.md, "torch: chunked-local hits")."""
    from kvref.spec.kv_cache_interface import ChunkedLocalAttentionSpec

    spec = ChunkedLocalAttentionSpec(block_size=4, attention_chunk_size=6, **KW)
    sched = DataPathScheduler(make_manager(_cfg((spec,)), device="cpu"), budget=1)
    sched.add(Request("r0", [0] * 7, max_tokens=1))
    log = sched.step()
    assert log.hits["r0"] == 4  # tokens 0..3 "computed" without ever being written
    assert log.error > 0.1


def test_runner_rejects_mixed_head_shapes_and_bad_heads():
    cfg = _cfg((FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype="float32"),
                SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float32", sliding_window=4)))
    with pytest.raises(InvalidFieldError, match="groups"):
        DataPathRunner(make_manager(cfg, device="cpu"))
    with pytest.raises(InvalidFieldError, match="num_q_heads"):
        DataPathRunner(make_manager(_cfg(LAYOUTS["fa"]), device="cpu"), num_q_heads=3)
    with pytest.raises(InvalidFieldError, match="manager"):
        DataPathRunner(object())


def test_groups_alias_the_same_backing_memory():
    cache = KVCacheTensors(_groups(LAYOUTS["fa+swa"]), num_blocks=6, num_layers=2, dtype=torch.float64)
    cache.kv(0, 1)[3, 1, 2] = 7.0
    assert bool((cache.kv(1, 1)[3, 1, 2] == 7.0).all()), "layer 1 of both groups shares block 3"
    assert float(cache.kv(1, 0).abs().sum()) == 0.0
    with pytest.raises(InvalidFieldError):
        cache.kv(2, 0)
    with pytest.raises(InvalidFieldError):
        cache.kv(0, 2)


@settings(max_examples=profile_examples(20, 60))
@given(seed=st.integers(0, 1000), lengths=st.lists(st.integers(1, 25), min_size=1, max_size=4),
       chunk=st.integers(1, 7))
def test_mamba_state_in_its_block_matches_one_full_scan(seed, lengths, chunk):
    spec = MambaSpec(block_size=16, shapes=((3, 4),), dtypes=("float32",))
    cache = KVCacheTensors((KVCacheGroupSpec(("m",), spec),), num_blocks=len(lengths) + 2, dtype=torch.float64)
    runner = MambaStateRunner(cache, 0, seed=seed)
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn((n, 3, 4), generator=g, dtype=torch.float64) for n in lengths]
    blocks = list(range(1, len(lengths) + 1))
    for b in blocks:
        runner.reset(b)
    done = [0] * len(lengths)
    outs = [[] for _ in lengths]
    while any(d < n for d, n in zip(done, lengths)):  # interleave the requests' chunks
        for i, (b, x) in enumerate(zip(blocks, xs)):
            if done[i] < lengths[i]:
                outs[i].append(runner.run_chunk(b, x[done[i]:done[i] + chunk]))
                done[i] += chunk
    for i, x in enumerate(xs):
        want = scan(runner.decay, x, torch.zeros((3, 4), dtype=torch.float64))
        assert torch.allclose(torch.cat(outs[i]), want, atol=1e-12, rtol=0)


def test_mamba_state_read_from_the_wrong_block_gives_wrong_numbers():
    spec = MambaSpec(block_size=16, shapes=((4,),), dtypes=("float32",))
    cache = KVCacheTensors((KVCacheGroupSpec(("m",), spec),), num_blocks=4, dtype=torch.float64)
    runner = MambaStateRunner(cache, 0)
    x = torch.ones((6, 4), dtype=torch.float64)
    y = -torch.ones((6, 4), dtype=torch.float64)
    runner.reset(1)
    runner.reset(2)
    runner.run_chunk(1, x[:3])
    runner.run_chunk(2, y[:3])
    wrong = runner.run_chunk(2, x[3:])  # request 1's second chunk reads request 2's block
    want = scan(runner.decay, x, torch.zeros(4, dtype=torch.float64))[3:]
    assert float((wrong - want).abs().max()) > 0.1
    with pytest.raises(InvalidFieldError):
        runner.run_chunk(0, x)
    with pytest.raises(InvalidFieldError):
        MambaStateRunner(KVCacheTensors(_groups(LAYOUTS["fa"]), 4), 0)


def _fa_mamba_cfg(num_blocks, spec_blocks=0):
    fa = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype="float32")
    mamba = MambaSpec(block_size=64, shapes=((3, 4),), dtypes=("float32",), num_speculative_blocks=spec_blocks)
    return PoolConfig(num_blocks=num_blocks, groups=(KVCacheGroupSpec(("fa",), fa), KVCacheGroupSpec(("m",), mamba)),
                      max_model_len=64, scheduler_block_size=64, hash_block_size=16, enable_caching=False)


@pytest.mark.parametrize("num_blocks,spec_blocks", [(40, 0), (40, 1), (9, 0)])
def test_mamba_state_in_its_block_through_the_bookkeeping(num_blocks, spec_blocks):
    """FA + Mamba (no prefix caching): each request's recurrent state lives in its Mamba block
    (block table entry 0); chunked prefill, decodes and preemptions (9 blocks) give the outputs of
    one scan over the whole sequence, and attention still equals dense attention."""
    sched = DataPathScheduler(make_manager(_fa_mamba_cfg(num_blocks, spec_blocks), device="cpu"), budget=7)
    for i in range(4):
        sched.add(Request(f"r{i}", list(range(i, 30 + 5 * i)), max_tokens=6))
    assert sched.run() <= EXACT
    assert any(log.chunks for log in sched.log)
    if num_blocks == 9:
        assert any(r.num_preemptions for r in sched.reqs.values()), "the small pool must preempt"


def test_mamba_state_read_through_a_wrong_table_entry_gives_wrong_numbers():
    mgr = make_manager(_fa_mamba_cfg(40), device="cpu")
    sched = DataPathScheduler(mgr, budget=40)
    a, b = Request("a", list(range(20)), max_tokens=4), Request("b", list(range(40, 60)), max_tokens=4)
    sched.add(a)
    sched.add(b)
    assert sched.step().error <= EXACT
    ta, tb = mgr.get_block_ids("a")[1][0], mgr.get_block_ids("b")[1][0]
    tables = mgr.groups[1].tables  # a's Mamba entry now points at b's state block, and back
    tables.table[tables._row["a"], 0], tables.table[tables._row["b"], 0] = tb, ta
    assert sched.step().error > 1e-3
    with pytest.raises(InvalidFieldError, match="block_size"):
        DataPathRunner(make_manager(_fa_mamba_cfg(40).__class__(
            num_blocks=10, groups=(KVCacheGroupSpec(("fa",), FullAttentionSpec(block_size=16, **KW)),
                                   KVCacheGroupSpec(("m",), MambaSpec(block_size=16, shapes=((2,),),
                                                                      dtypes=("float32",)))),
            max_model_len=64, scheduler_block_size=16, hash_block_size=16, enable_caching=False), device="cpu"))
