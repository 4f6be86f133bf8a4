"""The Z3 encodings agree with the Python code they are about, on generated inputs.

Each formula of :mod:`kvref.proofs.formulas` is evaluated twice — as Python ints and through a Z3
model of its encoding (fresh division witnesses, Bezout gcd/lcm), whose value must also be the only
one the constraints allow — and compared with ``kvref.spec`` / ``kvref.impl.reference``. This is
what keeps the theorems about the code and not about a drifted copy of it.
"""

from __future__ import annotations

import math

import pytest
import z3
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvref.proofs.formulas import REFERENCE as F
from kvref.proofs.ops import PyOps, Z3Ops
from kvref.spec import (ChunkedLocalAttentionSpec, EngineConfig, FullAttentionSpec, KVCacheGroupSpec, MambaSpec,
                        SlidingWindowSpec)
from kvref.spec.block_sizes import resolve_kv_cache_block_sizes
from kvref.spec.pool_sizing import (auto_fit_max_model_len, check_enough_kv_cache_memory, group_blocks_per_request,
                                    needed_bytes_for, pool_bytes_per_block)
from tests.conftest import profile_examples

N = profile_examples(30, 120)
N_Z3 = profile_examples(15, 40)
N_Z3_SLOW = profile_examples(6, 15)  # Bezout gcd/lcm witnesses take Z3 ~0.5 s each


def z3_value(build):
    """Evaluate ``build(ops)`` (given Z3 constants) through the encoding; assert it is determined."""
    o = Z3Ops()
    term = build(o)
    if isinstance(term, (int, bool)):
        return term
    s = z3.Solver()
    s.set("timeout", 30_000)
    s.add(*o.side)
    assert s.check() == z3.sat
    value = s.model().eval(term, model_completion=True)
    value = bool(z3.is_true(value)) if z3.is_bool(value) else value.as_long()
    s.add(term != (z3.BoolVal(value) if isinstance(value, bool) else value))
    assert s.check() == z3.unsat, "the encoding does not pin the value down"
    return value


def I(x):  # noqa: E743 - a Z3 integer constant, so the encoding (not Python) divides
    return z3.IntVal(x)


def _attn(cls, bs, **kw):
    return cls(block_size=bs, num_kv_heads=1, head_size=8, dtype="float16", **kw)


sizes = st.integers(1, 512)
tokens = st.integers(1, 1 << 18)


@settings(max_examples=N)
@given(sw=st.integers(1, 8192), extra=st.integers(0, 64), bs=sizes, F_=st.integers(0, 1 << 16), M=tokens)
def test_swa_cap_python_matches_spec(sw, extra, bs, F_, M):
    spec = _attn(SlidingWindowSpec, bs, sliding_window=sw, extra_retained_tokens=extra)
    assert F.swa_cap(PyOps, sw, extra, bs, F_, M) == spec.max_admission_blocks_per_request(F_, M)


@settings(max_examples=N_Z3)
@given(sw=st.integers(1, 8192), extra=st.integers(0, 64), bs=sizes, F_=st.integers(0, 1 << 16), M=tokens)
def test_swa_cap_z3_matches_spec(sw, extra, bs, F_, M):
    spec = _attn(SlidingWindowSpec, bs, sliding_window=sw, extra_retained_tokens=extra)
    got = z3_value(lambda o: F.swa_cap(o, I(sw), I(extra), I(bs), I(F_), I(M)))
    assert got == spec.max_admission_blocks_per_request(F_, M)


@settings(max_examples=N_Z3)
@given(chunk=st.integers(1, 8192), bs=sizes, F_=st.integers(0, 1 << 16), M=tokens)
def test_cl_cap_matches_spec(chunk, bs, F_, M):
    spec = _attn(ChunkedLocalAttentionSpec, bs, attention_chunk_size=chunk)
    want = spec.max_admission_blocks_per_request(F_, M)
    assert F.cl_cap(PyOps, chunk, bs, F_, M) == want
    assert z3_value(lambda o: F.cl_cap(o, I(chunk), I(bs), I(F_), I(M))) == want


@settings(max_examples=N_Z3)
@given(sw=st.integers(1, 4096), extra=st.integers(0, 16), chunk=st.integers(1, 4096), bs=sizes,
       k=st.integers(1, 4), B=st.integers(1, 8192), M=tokens)
def test_startup_blocks_and_bytes_match_spec(sw, extra, chunk, bs, k, B, M):
    cfg = EngineConfig(max_model_len=M, max_num_batched_tokens=B, max_concurrent_batches=k)
    swa = _attn(SlidingWindowSpec, bs, sliding_window=sw, extra_retained_tokens=extra)
    cl = _attn(ChunkedLocalAttentionSpec, bs, attention_chunk_size=chunk)
    assert F.max_in_flight_tokens(PyOps, k, B) == cfg.max_in_flight_tokens
    assert z3_value(lambda o: F.startup_swa_blocks(o, I(sw), I(extra), I(bs), I(k), I(B), I(M))) == \
        group_blocks_per_request(swa, cfg, M)
    assert F.swa_memory_bytes(PyOps, sw, extra, bs, swa.page_size_bytes, k, B, M) == swa.max_memory_usage_bytes(cfg, M)
    assert z3_value(lambda o: F.startup_cl_blocks(o, I(chunk), I(bs), I(k), I(B), I(M))) == \
        group_blocks_per_request(cl, cfg, M)
    assert F.cl_memory_bytes(PyOps, chunk, bs, cl.page_size_bytes, k, B, M) == cl.max_memory_usage_bytes(cfg, M)


@settings(max_examples=N_Z3)
@given(bs=sizes, dcp=st.integers(1, 8), M=tokens, sharded=st.booleans())
def test_full_pages_match_spec(bs, dcp, M, sharded):
    cfg = EngineConfig(max_model_len=M, dcp_world_size=dcp)
    spec = _attn(FullAttentionSpec, bs, dcp_sharded=sharded)
    d = dcp if sharded else 1
    assert z3_value(lambda o: F.full_pages(o, I(M), I(bs), I(d))) == group_blocks_per_request(spec, cfg, M)


@settings(max_examples=N)
@given(align=st.booleans(), spec_blocks=st.integers(0, 4), ckpt=st.integers(0, 3), bs=sizes, M=tokens)
def test_mamba_pages_match_spec(align, spec_blocks, ckpt, bs, M):
    mode = "align" if align else "none"
    cfg = EngineConfig(max_model_len=M, mamba_cache_mode=mode)
    spec = MambaSpec(block_size=bs, shapes=((4, 8),), dtypes=("float16",), mamba_cache_mode=mode,
                     num_speculative_blocks=spec_blocks, num_prefill_checkpoint_blocks=ckpt)
    want = group_blocks_per_request(spec, cfg, M)
    assert F.mamba_pages(PyOps, align, spec_blocks, ckpt) == want
    assert z3_value(lambda o: F.mamba_pages(o, z3.BoolVal(align), I(spec_blocks), I(ckpt))) == want


# ------------------------------------------------------------------ runtime: the reference managers

def _manager(spec, num_blocks=1024):
    from kvref.impl.reference.block_pool import BlockPool
    from kvref.impl.reference.chunked_local_manager import ChunkedLocalAttentionManager
    from kvref.impl.reference.full_attention_manager import FullAttentionManager
    from kvref.impl.reference.sliding_window_manager import SlidingWindowManager

    cls = {SlidingWindowSpec: SlidingWindowManager, ChunkedLocalAttentionSpec: ChunkedLocalAttentionManager,
           FullAttentionSpec: FullAttentionManager}[type(spec)]
    pool = BlockPool(num_blocks, enable_caching=False, hash_block_size=spec.block_size)
    return cls(spec, block_pool=pool, enable_caching=False, kv_cache_group_id=0,
               scheduler_block_size=spec.block_size)


@st.composite
def schedules(draw):
    """A request driven by a scheduler with ``k`` batches in flight and budget ``B``."""
    k = draw(st.integers(1, 3))
    B = draw(st.integers(1, 48))
    M = draw(st.integers(1, 400))
    steps = draw(st.lists(st.integers(1, B), min_size=1, max_size=40))
    return k, B, M, steps


def _drive(manager, k, B, M, steps, check):
    """Run the steps: remove on the processed basis, allocate, compare with the formulas."""
    c, in_flight = 0, []  # in_flight: token counts of the last k-1 steps not yet processed
    for n in steps:
        n = min(n, M - c)
        if n <= 0:
            break
        f = sum(in_flight)
        manager.remove_skipped_blocks("r", max(0, min(c, M) - f))
        manager.allocate_new_blocks("r", min(c + n, M), min(c + n, M))
        table = manager.req_to_blocks["r"]
        held = sum(1 for b in table if not b.is_null)
        check(c, f, n, held)
        manager.check_invariants()
        in_flight.append(n)
        if len(in_flight) > k - 1:
            in_flight.pop(0)
        c += n


@settings(max_examples=N)
@given(sched=schedules(), sw=st.integers(1, 64), extra=st.integers(0, 8), bs=st.integers(1, 16))
def test_swa_held_formula_matches_reference_manager_and_stays_within_cap(sched, sw, extra, bs):
    k, B, M, steps = sched
    spec = _attn(SlidingWindowSpec, bs, sliding_window=sw, extra_retained_tokens=extra)
    cap = spec.max_admission_blocks_per_request(k * B, M)

    def check(c, f, n, held):
        p = F.removal_basis(PyOps, c, f, M)
        assert held == F.held_after_step(PyOps, c, f, n, M, bs, F.swa_skipped(PyOps, p, sw, extra))
        assert held <= cap  # T2, concretely

    _drive(_manager(spec), k, B, M, steps, check)


@settings(max_examples=N)
@given(sched=schedules(), chunks=st.integers(1, 8), bs=st.integers(1, 16))
def test_cl_held_formula_matches_reference_manager_and_stays_within_cap(sched, chunks, bs):
    k, B, M, steps = sched
    chunk = chunks * bs  # T2's bound: the chunk is a multiple of the block size
    spec = _attn(ChunkedLocalAttentionSpec, bs, attention_chunk_size=chunk)
    cap = spec.max_admission_blocks_per_request(k * B, M)

    def check(c, f, n, held):
        p = F.removal_basis(PyOps, c, f, M)
        assert held == F.held_after_step(PyOps, c, f, n, M, bs, F.cl_skipped(PyOps, p, chunk))
        assert held <= cap

    _drive(_manager(spec), k, B, M, steps, check)


@settings(max_examples=N)
@given(L=st.integers(1, 2000), M=st.integers(1, 2000), sw=st.integers(1, 300), extra=st.integers(0, 8),
       chunk=st.integers(1, 300), bs=st.integers(1, 32), k=st.integers(1, 3), B=st.integers(1, 256))
def test_gate_formulas_match_reference_managers(L, M, sw, extra, chunk, bs, k, B):
    assume(L <= M)
    swa = _attn(SlidingWindowSpec, bs, sliding_window=sw, extra_retained_tokens=extra)
    cl = _attn(ChunkedLocalAttentionSpec, bs, attention_chunk_size=chunk)
    full = _attn(FullAttentionSpec, bs)
    for spec, formula in ((swa, lambda: F.gate_swa(PyOps, L, bs, F.runtime_swa_cap(PyOps, sw, extra, bs, k, B, M))),
                          (cl, lambda: F.gate_cl(PyOps, L, bs, F.runtime_cl_cap(PyOps, chunk, bs, k, B, M))),
                          (full, lambda: F.gate_full(PyOps, L, bs, 1))):
        cap = spec.max_admission_blocks_per_request(k * B, M) if not isinstance(spec, FullAttentionSpec) else None
        m = _manager(spec)
        m.max_admission_blocks_per_request = cap
        got = m.get_num_blocks_to_allocate("r", L, [], 0, 0, L, apply_admission_cap=True)
        assert got == formula()


@settings(max_examples=N)
@given(c=st.integers(0, 500), n=st.integers(1, 64), bs=st.integers(1, 16), sw=st.integers(1, 64))
def test_step_predictor_matches_reference_manager(c, n, bs, sw):
    spec = _attn(SlidingWindowSpec, bs, sliding_window=sw)
    m = _manager(spec)
    M = c + n
    if c:
        m.allocate_new_blocks("r", c, c)
    m.num_cached_block["r"] = 0  # running: the fast path
    table_len = len(m.req_to_blocks.get("r", []))
    got = m.get_num_blocks_to_allocate("r", c + n, [], c, c, c + n)
    assert got == F.step_predicted_blocks(PyOps, c + n, bs, table_len, None)
    assert got == F.step_pulled_blocks(PyOps, c + n, bs, table_len)
    assert len(m.allocate_new_blocks("r", c + n, c + n)) == got  # what the allocator really takes


# ------------------------------------------------------------------ pool sizing (kvref.spec)

@st.composite
def mixes(draw):
    page_heads = 1
    bs = draw(st.sampled_from([1, 2, 4, 8, 16]))
    kinds = draw(st.lists(st.sampled_from(["full", "swa", "cl"]), min_size=1, max_size=3, unique=True))
    sw = draw(st.integers(1, 200))
    extra = draw(st.integers(0, 4))
    chunk = draw(st.integers(1, 20)) * bs
    groups = []
    for i, kind in enumerate(kinds):
        if kind == "full":
            spec = _attn(FullAttentionSpec, bs)
        elif kind == "swa":
            spec = _attn(SlidingWindowSpec, bs, sliding_window=sw, extra_retained_tokens=extra)
        else:
            spec = _attn(ChunkedLocalAttentionSpec, bs, attention_chunk_size=chunk)
        groups.append(KVCacheGroupSpec((f"layer{i}",), spec))
    counts = {k: int(k in kinds) for k in ("full", "swa", "cl")}
    v = dict(nf=counts["full"], ns=counts["swa"], nc=counts["cl"], nm=0, bsf=bs, dcp=1, sw=sw, extra=extra,
             bss=bs, chunk=chunk, bsc=bs, bsm=1, spec=0, ckpt=0, ckpt_flag=0, align=True)
    del page_heads
    return tuple(groups), v


@settings(max_examples=N)
@given(mix=mixes(), k=st.integers(1, 2), B=st.integers(1, 512), M0=st.integers(1, 4000),
       override=st.integers(1, 600))
def test_auto_fit_and_check_match_the_characterisation(mix, k, B, M0, override):
    from kvref.proofs.theorems import _mix_pages, _mix_total
    from kvref.spec.errors import InsufficientKVCacheError

    groups, v = mix
    v = dict(v, k=k, B=B)
    cfg = EngineConfig(max_model_len=M0, max_num_batched_tokens=B, max_concurrent_batches=k,
                       num_gpu_blocks_override=override)
    bpb = pool_bytes_per_block(groups)
    need = lambda L: _mix_total(v, _mix_pages(F, PyOps, v, L))  # noqa: E731
    for L in (1, M0 // 2 or 1, M0):
        assert needed_bytes_for(groups, cfg, L) == bpb * need(L)
    avail = F.available_memory(PyOps, 0, True, override, bpb)
    check_mem = F.check_memory(PyOps, avail, bpb)
    feasible = [L for L in range(1, M0 + 1) if need(L) * bpb <= check_mem]
    try:
        fitted = auto_fit_max_model_len(groups, cfg, check_mem, M0)
    except InsufficientKVCacheError:
        assert not feasible
        return
    assert fitted == max(feasible)  # the largest feasible length: T4's characterisation
    check_enough_kv_cache_memory(groups, cfg, check_mem, fitted)  # T4: it passes
    assert need(fitted) <= F.num_blocks(PyOps, 0, True, override, bpb) - 1  # and counts the null block


def test_plan_kv_cache_applies_override_and_null_block_as_encoded():
    from kvref.spec.planning import plan_kv_cache

    spec = _attn(FullAttentionSpec, 16)
    layers = {"l0": spec, "l1": spec}
    for override in (5, 64, 257):
        cfg = EngineConfig(max_model_len="auto", derived_max_model_len=1 << 14, num_gpu_blocks_override=override)
        plan = plan_kv_cache(layers, cfg, available_memory=1 << 40)
        bpb = plan.bytes_per_block
        assert plan.memory_bytes == F.available_memory(PyOps, 1 << 40, True, override, bpb)
        assert plan.check_memory_bytes == F.check_memory(PyOps, plan.memory_bytes, bpb)
        assert plan.num_blocks == F.num_blocks(PyOps, 1 << 40, True, override, bpb) == override
        assert plan.max_model_len == (override - 1) * 16  # auto-fit reserves the null block


# ------------------------------------------------------------------ block sizes

@settings(max_examples=N_Z3_SLOW)
@given(bss=st.lists(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 32, 48, 64]), min_size=2, max_size=3),
       cacheable=st.lists(st.booleans(), min_size=2, max_size=2), dcp=st.integers(1, 4),
       sharded=st.lists(st.booleans(), min_size=3, max_size=3))
def test_block_sizes_match_spec(bss, cacheable, dcp, sharded):
    groups = []
    for i, bs in enumerate(bss):
        # cross-attention is not prefix-cacheable; the first group always is
        cls = CrossAttentionSpecOr(FullAttentionSpec, i, cacheable)
        groups.append(KVCacheGroupSpec((f"l{i}",), _attn(cls, bs, dcp_sharded=sharded[i])))
    cfg = EngineConfig(dcp_world_size=dcp, enable_prefix_caching=True)
    sbs, hbs = resolve_kv_cache_block_sizes(tuple(groups), cfg)
    eff = [bs * (dcp if sharded[i] else 1) for i, bs in enumerate(bss)]
    flags = [True] + [g.kv_cache_spec.prefix_cacheable for g in groups[1:]]
    assert F.scheduler_block_size(PyOps, eff) == sbs
    assert F.hash_block_size(PyOps, eff, flags, False, 0, eff[0]) == hbs
    assert z3_value(lambda o: F.scheduler_block_size(o, [I(e) for e in eff])) == sbs
    assert z3_value(lambda o: F.hash_block_size(o, [I(e) for e in eff], [z3.BoolVal(f) for f in flags],
                                                z3.BoolVal(False), I(1), I(eff[0]))) == hbs
    assert sbs % hbs == 0 and all(sbs % bs == 0 for bs in bss) and sbs == math.lcm(*eff)


def CrossAttentionSpecOr(default, index, cacheable):  # noqa: N802
    from kvref.spec import CrossAttentionSpec

    if index == 0 or cacheable[index - 1]:
        return default
    return CrossAttentionSpec


# ------------------------------------------------------------------ offloading window

@settings(max_examples=N_Z3)
@given(sw=st.integers(1, 4096), extra=st.integers(0, 32), chunk=st.integers(1, 4096), bs=st.integers(1, 64),
       bpc=st.integers(1, 16))
def test_offload_window_matches_reference_offload(sw, extra, chunk, bs, bpc):
    from kvref.impl.reference.offload.keys import get_sliding_window_size_in_chunks

    tpc = bs * bpc
    swa = _attn(SlidingWindowSpec, bs, sliding_window=sw, extra_retained_tokens=extra)
    cl = _attn(ChunkedLocalAttentionSpec, bs, attention_chunk_size=chunk)
    want_swa = get_sliding_window_size_in_chunks(swa, tpc)
    want_cl = get_sliding_window_size_in_chunks(cl, tpc)
    assert F.offload_window_swa(PyOps, sw, extra, tpc) == want_swa
    assert z3_value(lambda o: F.offload_window_swa(o, I(sw), I(extra), I(tpc))) == want_swa
    assert z3_value(lambda o: F.offload_window_cl(o, I(chunk), I(tpc))) == want_cl


@pytest.fixture(scope="module")
def vllm_offload_config():
    from tests.vllm_env import require_vllm

    require_vllm()
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import config as offload_config
    from vllm.v1 import kv_cache_interface as kvi

    return offload_config, kvi


@pytest.mark.vllm
@settings(max_examples=N)
@given(sw=st.integers(1, 4096), extra=st.integers(0, 32), chunk=st.integers(1, 4096), bs=st.integers(1, 64),
       bpc=st.integers(1, 16))
def test_offload_window_matches_vllm(vllm_offload_config, sw, extra, chunk, bs, bpc):
    import torch

    offload_config, kvi = vllm_offload_config
    tpc = bs * bpc
    swa = kvi.SlidingWindowSpec(block_size=bs, num_kv_heads=1, head_size=8, dtype=torch.float16,
                                sliding_window=sw, extra_retained_tokens=extra)
    cl = kvi.ChunkedLocalAttentionSpec(block_size=bs, num_kv_heads=1, head_size=8, dtype=torch.float16,
                                       attention_chunk_size=chunk)
    assert offload_config.get_sliding_window_size_in_chunks(swa, tpc) == F.offload_window_swa(PyOps, sw, extra, tpc)
    assert offload_config.get_sliding_window_size_in_chunks(cl, tpc) == F.offload_window_cl(PyOps, chunk, tpc)


# ------------------------------------------------------------------ runtime formulas vs vLLM's managers

@pytest.fixture(scope="module")
def vllm_managers():
    from tests.vllm_env import require_vllm

    require_vllm()
    import torch
    from vllm.v1.core import block_pool, single_type_kv_cache_manager as stm
    from vllm.v1 import kv_cache_interface as kvi

    def make(kind, bs, **kw):
        common = dict(block_size=bs, num_kv_heads=1, head_size=8, dtype=torch.float16)
        spec = {"swa": kvi.SlidingWindowSpec, "cl": kvi.ChunkedLocalAttentionSpec, "full": kvi.FullAttentionSpec}[kind](
            **common, **kw)
        cls = {"swa": stm.SlidingWindowManager, "cl": stm.ChunkedLocalAttentionManager,
               "full": stm.FullAttentionManager}[kind]
        pool = block_pool.BlockPool(1024, enable_caching=False, hash_block_size=bs)
        return spec, cls, pool

    return make


def _drive_vllm(manager, k, B, M, steps, check):
    c, in_flight = 0, []
    for n in steps:
        n = min(n, M - c)
        if n <= 0:
            break
        f = sum(in_flight)
        manager.remove_skipped_blocks("r", max(0, min(c, M) - f))
        manager.allocate_new_blocks("r", min(c + n, M), min(c + n, M))
        held = sum(1 for b in manager.req_to_blocks["r"] if not b.is_null)
        check(c, f, n, held)
        in_flight.append(n)
        if len(in_flight) > k - 1:
            in_flight.pop(0)
        c += n


@pytest.mark.vllm
@settings(max_examples=N)
@given(sched=schedules(), sw=st.integers(1, 64), extra=st.integers(0, 8), bs=st.integers(1, 16),
       chunks=st.integers(1, 8))
def test_held_formulas_match_vllm_managers(vllm_managers, sched, sw, extra, bs, chunks):
    k, B, M, steps = sched
    spec, cls, pool = vllm_managers("swa", bs, sliding_window=sw, extra_retained_tokens=extra)
    cap = spec.max_admission_blocks_per_request(k * B, M)
    assert cap == F.swa_cap(PyOps, sw, extra, bs, k * B, M)
    m = cls(spec, block_pool=pool, enable_caching=False, kv_cache_group_id=0, scheduler_block_size=bs,
            max_admission_blocks_per_request=cap)

    def check_swa(c, f, n, held):
        p = F.removal_basis(PyOps, c, f, M)
        assert held == F.held_after_step(PyOps, c, f, n, M, bs, F.swa_skipped(PyOps, p, sw, extra))
        assert held <= cap

    _drive_vllm(m, k, B, M, steps, check_swa)

    chunk = chunks * bs
    spec, cls, pool = vllm_managers("cl", bs, attention_chunk_size=chunk)
    cap = spec.max_admission_blocks_per_request(k * B, M)
    assert cap == F.cl_cap(PyOps, chunk, bs, k * B, M)
    m = cls(spec, block_pool=pool, enable_caching=False, kv_cache_group_id=0, scheduler_block_size=bs,
            max_admission_blocks_per_request=cap)

    def check_cl(c, f, n, held):
        p = F.removal_basis(PyOps, c, f, M)
        assert held == F.held_after_step(PyOps, c, f, n, M, bs, F.cl_skipped(PyOps, p, chunk))
        assert held <= cap

    _drive_vllm(m, k, B, M, steps, check_cl)


@pytest.mark.vllm
@settings(max_examples=N)
@given(L=st.integers(1, 2000), M=st.integers(1, 2000), sw=st.integers(1, 300), extra=st.integers(0, 8),
       chunk=st.integers(1, 300), bs=st.integers(1, 32), k=st.integers(1, 3), B=st.integers(1, 256),
       c=st.integers(0, 300), n=st.integers(1, 64))
def test_gate_and_predictor_formulas_match_vllm_managers(vllm_managers, L, M, sw, extra, chunk, bs, k, B, c, n):
    assume(L <= M)
    for kind, kw, formula in (
            ("swa", dict(sliding_window=sw, extra_retained_tokens=extra),
             lambda cap: F.gate_swa(PyOps, L, bs, cap)),
            ("cl", dict(attention_chunk_size=chunk), lambda cap: F.gate_cl(PyOps, L, bs, cap)),
            ("full", {}, lambda cap: F.gate_full(PyOps, L, bs, 1))):
        spec, cls, pool = vllm_managers(kind, bs, **kw)
        cap = spec.max_admission_blocks_per_request(k * B, M) if kind != "full" else None
        m = cls(spec, block_pool=pool, enable_caching=False, kv_cache_group_id=0, scheduler_block_size=bs,
                max_admission_blocks_per_request=cap)
        assert m.get_num_blocks_to_allocate("r", L, [], 0, 0, L, apply_admission_cap=True) == formula(cap)
        # a running request's per-step predictor (no cap) = what allocate_new_blocks takes
        if c:
            m.allocate_new_blocks("q", c, c)
        m.num_cached_block["q"] = 0
        table = len(m.req_to_blocks.get("q", []))
        got = m.get_num_blocks_to_allocate("q", c + n, [], c, c, c + n)
        assert got == F.step_predicted_blocks(PyOps, c + n, bs, table, cap)
        assert len(m.allocate_new_blocks("q", c + n, c + n)) == got


CL_UNALIGNED = dict(chunk=6, bs=4, k=1, B=2, M=100, steps=[2, 2, 2, 2, 2, 1, 2])


def _max_held(manager, k, M, steps):
    worst = []
    _drive_vllm(manager, k, 10 ** 6, M, steps, lambda c, f, n, held: worst.append(held))
    return max(worst)


@pytest.mark.vllm
def test_cl_unaligned_chunk_exceeds_the_cap_in_vllm_too(vllm_managers):
    """T2's needed bound, seen in vLLM itself: attention_chunk_size 6 with block_size 4 and 2 tokens
    per step holds 3 blocks while the cap (startup sizing) is 2."""
    x = CL_UNALIGNED
    spec, cls, pool = vllm_managers("cl", x["bs"], attention_chunk_size=x["chunk"])
    cap = spec.max_admission_blocks_per_request(x["k"] * x["B"], x["M"])
    m = cls(spec, block_pool=pool, enable_caching=False, kv_cache_group_id=0, scheduler_block_size=x["bs"],
            max_admission_blocks_per_request=cap)
    assert cap == 2 and _max_held(m, x["k"], x["M"], x["steps"]) == 3


def test_cl_unaligned_chunk_exceeds_the_cap_in_the_reference():
    x = CL_UNALIGNED
    spec = _attn(ChunkedLocalAttentionSpec, x["bs"], attention_chunk_size=x["chunk"])
    cap = spec.max_admission_blocks_per_request(x["k"] * x["B"], x["M"])
    assert cap == 2 and _max_held(_manager(spec), x["k"], x["M"], x["steps"]) == 3


# ------------------------------------------------------------------ Mamba align: T3's hypothesis and its limit

def _mamba_worst(manager, k, bs, chunks):
    c, in_flight, worst = 0, [], 0
    for n in chunks:
        f = sum(in_flight)
        manager.remove_skipped_blocks("r", max(0, c - f))
        manager.get_num_blocks_to_allocate("r", c + n, [], c, c, c + n)
        manager.allocate_new_blocks("r", c + n, c + n)
        worst = max(worst, sum(1 for b in manager.req_to_blocks["r"] if not b.is_null))
        in_flight.append(n)
        if len(in_flight) > k - 1:
            in_flight.pop(0)
        c += n
    return worst


def _ref_mamba(bs, spec_blocks):
    from kvref.impl.reference.block_pool import BlockPool
    from kvref.impl.reference.mamba_manager import MambaManager

    spec = MambaSpec(block_size=bs, shapes=((4, 8),), dtypes=("float16",), mamba_cache_mode="align",
                     num_speculative_blocks=spec_blocks)
    return MambaManager(spec, block_pool=BlockPool(512, enable_caching=False, hash_block_size=bs),
                        enable_caching=False, kv_cache_group_id=0, scheduler_block_size=bs)


@settings(max_examples=N)
@given(bs=st.sampled_from([4, 8, 16]), spec_blocks=st.integers(0, 2),
       chunks=st.lists(st.integers(1, 6), min_size=1, max_size=20))
def test_mamba_align_sync_holds_at_most_what_startup_charges(bs, spec_blocks, chunks):
    """T3's align-mode hypothesis (k = 1), on the reference manager: block-aligned chunks."""
    worst = _mamba_worst(_ref_mamba(bs, spec_blocks), 1, bs, [n * bs for n in chunks])
    assert worst <= F.mamba_pages(PyOps, True, spec_blocks, 0)


@pytest.fixture(scope="module")
def vllm_mamba():
    from tests.vllm_env import require_vllm

    require_vllm()
    import torch
    from vllm.v1 import kv_cache_interface as kvi
    from vllm.v1.core import block_pool, single_type_kv_cache_manager as stm

    def make(bs, spec_blocks):
        spec = kvi.MambaSpec(block_size=bs, shapes=((4, 8),), dtypes=(torch.float16,), mamba_cache_mode="align",
                             num_speculative_blocks=spec_blocks)
        return stm.MambaManager(spec, block_pool=block_pool.BlockPool(512, enable_caching=False, hash_block_size=bs),
                                enable_caching=False, kv_cache_group_id=0, scheduler_block_size=bs)
    return make


@pytest.mark.vllm
@settings(max_examples=N)
@given(bs=st.sampled_from([4, 8, 16]), spec_blocks=st.integers(0, 2),
       chunks=st.lists(st.integers(1, 6), min_size=1, max_size=20))
def test_mamba_align_sync_holds_at_most_what_startup_charges_in_vllm(vllm_mamba, bs, spec_blocks, chunks):
    worst = _mamba_worst(vllm_mamba(bs, spec_blocks), 1, bs, [n * bs for n in chunks])
    assert worst <= F.mamba_pages(PyOps, True, spec_blocks, 0)


@pytest.mark.vllm
@pytest.mark.parametrize("k", [2, 3])
def test_mamba_align_with_batches_in_flight_exceeds_startup_in_vllm(vllm_mamba, k):
    """Finding: with k batches in flight, vLLM's align-mode MambaManager holds 1 + k + spec blocks
    (removal runs on the processed basis), while startup charges 2 + spec (+ checkpoint blocks)."""
    for spec_blocks in (0, 1):
        assert _mamba_worst(vllm_mamba(16, spec_blocks), k, 16, [16] * 12) == 1 + k + spec_blocks
        assert F.mamba_pages(PyOps, True, spec_blocks, 0) == 2 + spec_blocks
