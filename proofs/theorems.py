"""The theorems about vLLM 0.33.0's KV-cache bounds, stated for all positive integers.

Each theorem is a :class:`~kvref.proofs.engine.Theorem` whose claims are written against a formula
set ``F`` (:mod:`kvref.proofs.formulas`) and an ops back-end ``o``; see :mod:`kvref.proofs.engine`.
Hypotheses beyond "positive integers" are listed in ``bounds`` and in docs/proofs.md, and every
bound that is really needed has a sibling claim in :mod:`kvref.proofs.variants` (the ``broken`` variants) showing that
dropping it gives a counterexample.
"""

from __future__ import annotations

from .engine import BOOL, INT, Claim, Theorem


def _ints(names: str) -> dict[str, str]:
    return {n: INT for n in names.split()}


def _pos(*xs):
    return [x >= 1 for x in xs]


def _nonneg(*xs):
    return [x >= 0 for x in xs]


def divides_goal(o, d, x):
    """``d | x`` in a goal position (negation introduces only existential witnesses)."""
    if hasattr(o, "div_goal"):
        return o.div_goal(d, x)
    return o.Not(o.not_divides(d, x))


def _step_hyps(o, v):
    """A reachable point of chunked prefill / decode with async scheduling.

    ``c`` tokens computed (scheduled) so far, ``f`` of them still in flight (scheduled by at most
    ``k - 1`` earlier steps of ``<= B`` tokens each), ``n`` new tokens scheduled now
    (``1 <= n <= B``), never past ``max_model_len``.
    """
    c, f, n, k, B, M = v["c"], v["f"], v["n"], v["k"], v["B"], v["M"]
    return [c >= 0, f >= 0, f <= c, f <= (k - 1) * B, n >= 1, n <= B, c + n <= M]


_STEP_VARS = _ints("k B M c f n")


# ------------------------------------------------------------------------------------------- T1

def _t1_swa(F, o, v):
    sw, extra, bs, page, k, B, M = (v[x] for x in "sw extra bs page k B M".split())
    hyps = _pos(sw, bs, page, k, B, M) + _nonneg(extra)
    startup = F.startup_swa_blocks(o, sw, extra, bs, k, B, M)
    mem = F.swa_memory_bytes(o, sw, extra, bs, page, k, B, M)
    runtime = F.runtime_swa_cap(o, sw, extra, bs, k, B, M)
    return hyps, o.And(mem == runtime * page, F.pages_from_bytes(o, mem, page) == runtime, startup == runtime)


def _t1_cl(F, o, v):
    chunk, bs, page, k, B, M = (v[x] for x in "chunk bs page k B M".split())
    hyps = _pos(chunk, bs, page, k, B, M)
    startup = F.startup_cl_blocks(o, chunk, bs, k, B, M)
    mem = F.cl_memory_bytes(o, chunk, bs, page, k, B, M)
    runtime = F.runtime_cl_cap(o, chunk, bs, k, B, M)
    return hyps, o.And(mem == runtime * page, F.pages_from_bytes(o, mem, page) == runtime, startup == runtime)


def _both(a, b):
    def build(F, o, v):
        ha, ga = a(F, o, v)
        hb, gb = b(F, o, v)
        return ha + hb, o.And(ga, gb)
    return build


T1_SWA = Claim("swa", "SWA: startup bytes = runtime cap x page, and cdiv(bytes, page) = cap",
               _ints("sw extra bs page k B M"), _t1_swa)
T1_CL = Claim("cl", "chunked-local: startup bytes = runtime cap x page, and cdiv(bytes, page) = cap",
              _ints("chunk bs page k B M"), _t1_cl)
T1 = Theorem(
    id="T1", name="single-source",
    title="startup per-request bound = admission cap x page size (SWA, chunked-local)",
    statement=("For every sliding-window spec (window, extra retained tokens, block size, page size) and "
               "chunked-local spec, every max_concurrent_batches k, max_num_batched_tokens B and max_model_len "
               "M: max_memory_usage_bytes = max_admission_blocks_per_request(k*B, M) * page_size_bytes, the "
               "cap the runtime manager gets from get_manager_for_kv_cache_spec, and the startup check counts "
               "exactly that many blocks (cdiv(bytes, page) = cap). Seed 000 / vLLM #40946."),
    reference=("kvref.spec.kv_cache_interface.SlidingWindowSpec.max_admission_blocks_per_request",
               "kvref.spec.kv_cache_interface.SlidingWindowSpec.max_memory_usage_bytes",
               "kvref.spec.kv_cache_interface.ChunkedLocalAttentionSpec.max_admission_blocks_per_request",
               "kvref.spec.kv_cache_interface.ChunkedLocalAttentionSpec.max_memory_usage_bytes",
               "vllm.v1.core.single_type_kv_cache_manager.get_manager_for_kv_cache_spec"),
    bounds=(),
    claim=Claim("all", "both", _ints("sw extra chunk bs page k B M"), _both(_t1_swa, _t1_cl)),
    lemmas=(T1_SWA, T1_CL),
    combination="the claim is the conjunction of the two lemmas",
)


# ------------------------------------------------------------------------------------------- T2

def _t2_swa(F, o, v):
    sw, extra, bs, k, B, M = (v[x] for x in "sw extra bs k B M".split())
    hyps = _pos(sw, bs, k, B, M) + _nonneg(extra) + _step_hyps(o, v)
    p = F.removal_basis(o, v["c"], v["f"], M)
    held = F.held_after_step(o, v["c"], v["f"], v["n"], M, bs, F.swa_skipped(o, p, sw, extra))
    return hyps, held <= F.runtime_swa_cap(o, sw, extra, bs, k, B, M)


def _t2_cl(F, o, v, *, aligned=True):
    chunk, bs, k, B, M = (v[x] for x in "chunk bs k B M".split())
    hyps = _pos(chunk, bs, k, B, M) + _step_hyps(o, v)
    if aligned:
        hyps.append(o.divides(bs, chunk))
    p = F.removal_basis(o, v["c"], v["f"], M)
    held = F.held_after_step(o, v["c"], v["f"], v["n"], M, bs, F.cl_skipped(o, p, chunk))
    return hyps, held <= F.runtime_cl_cap(o, chunk, bs, k, B, M)


T2_SWA = Claim("swa", "SWA: blocks held after every allocate_slots <= cap", {**_ints("sw extra bs"), **_STEP_VARS},
               _t2_swa)
T2_CL = Claim("cl", "chunked-local: blocks held after every allocate_slots <= cap",
              {**_ints("chunk bs"), **_STEP_VARS}, _t2_cl)
def _t2_lookahead(F, o, v):
    """T2's SWA claim with ``la >= 1`` speculative lookahead slots allocated on top (no bound)."""
    sw, extra, bs, k, B, M, la = (v[x] for x in "sw extra bs k B M la".split())
    hyps = _pos(sw, bs, k, B, M, la) + _nonneg(extra) + _step_hyps(o, v)
    c, f, n = v["c"], v["f"], v["n"]
    p = F.removal_basis(o, c, f, M)
    nulls = o.min(o.fdiv(F.swa_skipped(o, p, sw, extra), bs), o.cdiv(c, bs))
    held = o.max(o.cdiv(o.min(c + n + la, M), bs), o.cdiv(c, bs)) - nulls
    return hyps, held <= F.runtime_swa_cap(o, sw, extra, bs, k, B, M)


T2 = Theorem(
    id="T2", name="runtime-within-cap",
    title="a windowed request never holds more blocks than its admission cap",
    statement=("At every point of chunked prefill and decode - c tokens computed, f of them still in flight "
               "(async scheduling / pipeline parallelism: at most k-1 earlier steps of <= B tokens), n new "
               "tokens scheduled - the non-null blocks a sliding-window or chunked-local request holds after "
               "allocate_slots (removal on the processed basis c - f, then allocation to cdiv(c+n, bs)) are "
               "at most max_admission_blocks_per_request(k*B, M)."),
    reference=("kvref.spec.kv_cache_interface.SlidingWindowSpec.max_admission_blocks_per_request",
               "kvref.spec.kv_cache_interface.ChunkedLocalAttentionSpec.max_admission_blocks_per_request",
               "vllm.v1.core.single_type_kv_cache_manager.SlidingWindowManager.get_num_skipped_tokens",
               "vllm.v1.core.single_type_kv_cache_manager.ChunkedLocalAttentionManager.get_num_skipped_tokens",
               "kvref.impl.reference.sliding_window_manager.SlidingWindowManager.get_num_skipped_tokens",
               "kvref.impl.reference.chunked_local_manager.ChunkedLocalAttentionManager.get_num_skipped_tokens",
               "kvref.impl.reference.single_type_manager.SingleTypeKVCacheManager.remove_skipped_blocks",
               "vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager.remove_skipped_blocks",
               "vllm.v1.core.kv_cache_manager.KVCacheManager.allocate_slots"),
    bounds=("no speculative decoding: num_lookahead_tokens = 0 (lookahead slots are not part of the cap; "
            "sibling T2/lookahead shows the cap can be exceeded with them)",
            "chunked-local: attention_chunk_size is a multiple of block_size (sibling T2/cl-unaligned shows a "
            "counterexample otherwise: the chunk start falls mid-block and the cap has no +1)",
            "no copy-on-write partial-hit tail block (fine-grained partial prefix hits)",
            "a step schedules 1 <= n <= max_num_batched_tokens tokens and at most max_concurrent_batches - 1 "
            "earlier steps are in flight"),
    claim=Claim("all", "both", {**_ints("sw extra chunk bs"), **_STEP_VARS}, _both(_t2_swa, _t2_cl)),
    lemmas=(T2_SWA, T2_CL),
    combination="the claim is the conjunction of the two lemmas",
    search_hints=(dict(bs=16, sw=1024, extra=0, chunk=8192, k=2, B=2048),
                  dict(bs=16, sw=1024, chunk=8192, k=1, B=2048)),
    necessary=(Claim("cl-unaligned", "chunked-local without 'chunk is a multiple of block_size'",
                     {**_ints("chunk bs"), **_STEP_VARS}, lambda F, o, v: _t2_cl(F, o, v, aligned=False)),
               Claim("lookahead", "SWA with speculative lookahead slots", {**_ints("sw extra bs la"), **_STEP_VARS},
                     _t2_lookahead)),
)


# ------------------------------------------------------------------------------------------- T3
# A hybrid mix: nf full-attention groups, ns sliding-window, nc chunked-local, nm Mamba groups
# (counts >= 0; groups of one kind share their spec, as vLLM's uniform-page grouping makes them).

_MIX_VARS = {**_ints("nf bsf dcp ns sw extra bss nc chunk bsc nm bsm spec ckpt ckpt_flag"), "align": BOOL}
_POOL_VARS = {**_ints("bpb profiled override"), "override_set": BOOL}


def _mix_hyps(o, v):
    M = v["M"]
    return (_nonneg(v["nf"], v["ns"], v["nc"], v["nm"], v["extra"], v["spec"], v["ckpt"])
            + _pos(v["bsf"], v["dcp"], v["sw"], v["bss"], v["chunk"], v["bsc"], v["bsm"])
            + [o.divides(v["bsc"], v["chunk"]),
               v["ckpt_flag"] >= 0, v["ckpt_flag"] <= 1, v["ckpt_flag"] <= v["ckpt"],
               # vLLM sets mamba_block_size = max_model_len outside align mode (models/config.py)
               o.Implies(o.Not(v["align"]), v["bsm"] >= M) if not v.get("_no_mamba_bound") else True])


def _mix_pages(F, o, v, M):
    """Blocks the startup check charges each kind of group for max_model_len ``M``."""
    k, B = v["k"], v["B"]
    return (F.full_pages(o, M, v["bsf"], v["dcp"]),
            F.startup_swa_blocks(o, v["sw"], v["extra"], v["bss"], k, B, M),
            F.startup_cl_blocks(o, v["chunk"], v["bsc"], k, B, M),
            F.mamba_pages(o, v["align"], v["spec"], v["ckpt"]))


def _mix_total(v, per_kind):
    return v["nf"] * per_kind[0] + v["ns"] * per_kind[1] + v["nc"] * per_kind[2] + v["nm"] * per_kind[3]


def _startup(F, o, v, need_pages):
    bpb = v["bpb"]
    avail = F.available_memory(o, v["profiled"], v["override_set"], v["override"], bpb)
    check_mem = F.check_memory(o, avail, bpb)
    accepted = F.check_passes(o, need_pages * bpb, check_mem)
    nb = F.num_blocks(o, v["profiled"], v["override_set"], v["override"], bpb)
    hyps = _pos(bpb, v["override"]) + _nonneg(v["profiled"])
    return hyps, accepted, nb


def _mix_gate(F, o, v, L):
    k, B, M = v["k"], v["B"], v["M"]
    swa_cap = F.runtime_swa_cap(o, v["sw"], v["extra"], v["bss"], k, B, M)
    cl_cap = F.runtime_cl_cap(o, v["chunk"], v["bsc"], k, B, M)
    return (F.gate_full(o, L, v["bsf"], v["dcp"]),
            F.gate_swa(o, L, v["bss"], swa_cap),
            F.gate_cl(o, L, v["bsc"], cl_cap),
            F.gate_mamba(o, L, v["bsm"], v["align"], v["spec"], v["ckpt_flag"]))


def _mix_held(F, o, v, mamba_pages):
    c, f, n, M = v["c"], v["f"], v["n"], v["M"]
    p = F.removal_basis(o, c, f, M)
    full = o.cdiv(o.min(c + n, M), v["bsf"] * v["dcp"])
    swa = F.held_after_step(o, c, f, n, M, v["bss"], F.swa_skipped(o, p, v["sw"], v["extra"]))
    cl = F.held_after_step(o, c, f, n, M, v["bsc"], F.cl_skipped(o, p, v["chunk"]))
    # Align-mode Mamba: MambaManager's physical cap (1 state + partial + checkpoint + speculative
    # blocks) is taken as the per-step bound - a hypothesis, see docs/proofs.md.
    mamba = o.ite(v["align"], mamba_pages,
                  F.mamba_held_nonalign(o, c, n, M, v["bsm"], v["spec"]))
    return full, swa, cl, mamba


def _mamba_align_sync(o, v):
    """Align-mode Mamba is covered for max_concurrent_batches = 1 only: with k batches in flight
    vLLM's MambaManager holds 1 + k + spec state blocks (see docs/proofs.md, Findings)."""
    return o.Implies(o.And(v["nm"] >= 1, v["align"]), v["k"] == 1)


def _t3_all(F, o, v):
    M, L = v["M"], v["L"]
    pages = _mix_pages(F, o, v, M)
    hs, accepted, nb = _startup(F, o, v, _mix_total(v, pages))
    hyps = (_pos(M, L, v["k"], v["B"]) + [L <= M] + _mix_hyps(o, v) + _step_hyps(o, v) + hs + [accepted]
            + [_mamba_align_sync(o, v)])
    gate = _mix_total(v, _mix_gate(F, o, v, L))
    held = _mix_total(v, _mix_held(F, o, v, pages[3]))
    free = nb - 1  # the null block is never handed out
    return hyps, o.And(gate <= free, held <= free)


def _t3_kind(index):
    def build(F, o, v):
        M, L = v["M"], v["L"]
        hyps = _pos(M, L, v["k"], v["B"]) + [L <= M] + _mix_hyps(o, v) + _step_hyps(o, v) + [_mamba_align_sync(o, v)]
        pages = _mix_pages(F, o, v, M)
        gate = _mix_gate(F, o, v, L)[index]
        held = _mix_held(F, o, v, pages[3])[index]
        return hyps, o.And(gate <= pages[index], held <= pages[index])
    return build


def _t3_sum(F, o, v):
    """Per-kind bounds x_g, y_g <= P_g plus an accepted startup give Σ n_g x_g <= num_blocks - 1."""
    kinds = ("f", "s", "c", "m")
    P = tuple(v["P" + g] for g in kinds)
    X = tuple(v["X" + g] for g in kinds)
    hs, accepted, nb = _startup(F, o, v, _mix_total(v, P))
    hyps = (hs + [accepted] + _nonneg(v["nf"], v["ns"], v["nc"], v["nm"], *P, *X)
            + [x <= p for x, p in zip(X, P)])
    return hyps, _mix_total(v, X) <= nb - 1


def _t3_partial_hit_tail(F, o, v):
    """The full-attention gate for a request whose cached prefix (``h`` tokens, found per
    ``hb``-token hash block, every hit block in the free queue) ends inside a block: the touched
    hits plus the new blocks plus a copy-on-write block for the shared tail (docs/proofs.md
    Findings 3). T3 assumes no hits; this drops that assumption."""
    M, L, h, hb, bs = v["M"], v["L"], v["h"], v["hb"], v["bsf"]
    hyps = _pos(M, L, hb, bs) + [L <= M, h >= 1, h < L, h % hb == 0, bs % hb == 0, h % bs != 0]
    hit_blocks = o.cdiv(h, bs)
    gate = (F.gate_full(o, L, bs, 1) - hit_blocks) + hit_blocks + 1
    return hyps, gate <= F.gate_full(o, M, bs, 1)


_T3_VARS = {**_ints("M L"), **_MIX_VARS, **_POOL_VARS, **_STEP_VARS}
T3 = Theorem(
    id="T3", name="no-deadlock-at-startups-word",
    title="startup accepts => one request up to max_model_len is admitted and never fails mid-prefill",
    statement=("For any hybrid mix of full-attention, sliding-window, chunked-local and Mamba groups, with or "
               "without num_gpu_blocks_override: if the startup enough-memory check accepts max_model_len M, "
               "then (a) a single request of any length L <= M passes the full-sequence admission gate into an "
               "empty pool (num_blocks - 1 free: the null block is withheld), and (b) at every later step of its "
               "chunked prefill and decode (async scheduling included) the blocks it holds after allocate_slots "
               "fit in the pool, so the per-step allocation never fails."),
    reference=("kvref.spec.pool_sizing.check_enough_kv_cache_memory",
               "kvref.spec.pool_sizing.needed_bytes_for",
               "kvref.spec.pool_sizing.group_blocks_per_request",
               "kvref.impl.reference.single_type_manager.SingleTypeKVCacheManager.get_num_blocks_to_allocate",
               "kvref.impl.reference.kv_cache_manager.KVCacheManager.allocate_slots",
               "vllm.v1.core.kv_cache_planning.get_kv_cache_configs",
               "vllm.v1.core.kv_cache_manager.KVCacheManager.allocate_slots"),
    bounds=T2.bounds + (
        "Mamba outside align mode: block_size >= max_model_len (vLLM sets mamba_block_size = max_model_len "
        "when prefix caching is off; sibling T3/mamba-small-block shows it is needed)",
        "Mamba align mode, part (b): max_concurrent_batches = 1, and the per-step bound (at most 2 + "
        "num_speculative_blocks + num_prefill_checkpoint_blocks blocks held) is a hypothesis checked on generated "
        "schedules against vLLM's MambaManager, not proved. With k >= 2 batches in flight vLLM's manager holds "
        "1 + k + num_speculative_blocks blocks, more than startup charges (a finding, docs/proofs.md)",
        "watermark 0 (the default) and no prefix-cache hits for the request. An empty pool (nothing running) can "
        "still hold cached free blocks; with hits found per hash block smaller than the block a hit can end "
        "inside a block, and the gate then counts a copy-on-write block beyond startup's (sibling "
        "T3/partial-hit-tail; vLLM 0.33.0 hangs, docs/proofs.md Findings 3)",
        "groups of one kind share one spec (counts n_g >= 0 of each kind)"),
    claim=Claim("all", "whole hybrid mix", _T3_VARS, _t3_all),
    necessary=(Claim("mamba-small-block", "Mamba outside align mode with block_size < max_model_len", _T3_VARS,
                     lambda F, o, v: _t3_kind(3)(F, o, {**v, "_no_mamba_bound": True})),
               Claim("partial-hit-tail", "a cached prefix ending inside a full-attention block (fine-grained hashes)",
                     {**_T3_VARS, **_ints("h hb")}, _t3_partial_hit_tail)),
    lemmas=(Claim("full", "full attention: gate(L) <= pages(M) and held <= pages(M)", _T3_VARS, _t3_kind(0)),
            Claim("swa", "sliding window: gate(L) <= cap and held <= cap", _T3_VARS, _t3_kind(1)),
            Claim("cl", "chunked local: gate(L) <= cap and held <= cap", _T3_VARS, _t3_kind(2)),
            Claim("mamba", "Mamba: gate(L) <= pages and held <= pages", _T3_VARS, _t3_kind(3)),
            Claim("sum", "per-group bounds + accepted startup => sum <= num_blocks - 1",
                  {**_ints("nf ns nc nm Pf Ps Pc Pm Xf Xs Xc Xm"), **_POOL_VARS}, _t3_sum)),
    combination=("instantiate the sum lemma once with X_g = gate_g(L) and once with X_g = held_g; the "
                 "per-kind lemmas supply X_g <= P_g"),
    search_hints=(
        # realistic: block size 16, window 1024, 2048-token steps (Gemma-like full + SWA)
        dict(nf=1, ns=1, nc=0, nm=0, dcp=1, extra=0, c=0, f=0, n=1, chunk=1, bsc=1, bsm=1, override_set=False,
             k=1, bpb=1, align=True, spec=0, ckpt=0, ckpt_flag=0, bsf=16, bss=16, sw=1024, B=2048),
        # realistic: full attention + Mamba (no prefix caching) with one speculative block
        dict(nf=1, ns=0, nc=0, nm=1, dcp=1, c=0, f=0, n=1, sw=1, extra=0, bss=1, chunk=1, bsc=1,
             override_set=False, k=1, bpb=1, align=False, ckpt=0, ckpt_flag=0, bsf=16, spec=1, B=2048),
        # full + sliding window, first step of a fresh request, no override
        dict(nf=1, ns=1, nc=0, nm=0, dcp=1, extra=0, c=0, f=0, n=1, override_set=False, k=1, bpb=1, align=False, spec=0, ckpt=0, ckpt_flag=0),
        # full + Mamba outside align mode
        dict(nf=1, ns=0, nc=0, nm=1, dcp=1, c=0, f=0, n=1, override_set=False, k=1, bpb=1, align=False, ckpt=0, ckpt_flag=0),
        # full attention alone
        dict(nf=1, ns=0, nc=0, nm=0, dcp=1, c=0, f=0, n=1, override_set=False, k=1, bpb=1),
    ),
)


# ------------------------------------------------------------------------------------------- T4

def _t4_need(F, o, v, L):
    return _mix_total(v, _mix_pages(F, o, v, L))


def _t4_hyps(F, o, v):
    M0, Ls = v["M0"], v["Lstar"]
    bpb = v["bpb"]
    avail = F.available_memory(o, v["profiled"], True, v["override"], bpb)
    check_mem = F.check_memory(o, avail, bpb)
    feasible = lambda L: _t4_need(F, o, v, L) * bpb <= check_mem  # noqa: E731
    hyps = (_pos(M0, Ls, v["k"], v["B"], bpb, v["override"]) + _nonneg(v["profiled"])
            + _mix_hyps(o, {**v, "M": Ls})
            + [Ls <= M0, check_mem > 0, feasible(Ls), o.Or(Ls == M0, o.Not(feasible(Ls + 1)))])
    return hyps, check_mem, feasible


def _t4_passes(F, o, v):
    hyps, check_mem, _ = _t4_hyps(F, o, v)
    nb = F.num_blocks(o, v["profiled"], True, v["override"], v["bpb"])
    need = _t4_need(F, o, v, v["Lstar"])
    return hyps, o.And(F.check_passes(o, need * v["bpb"], check_mem), need <= nb - 1)


def _t4_maximal(F, o, v):
    hyps, _, feasible = _t4_hyps(F, o, v)
    Lp = v["Lp"]
    return hyps + [Lp > v["Lstar"], Lp <= v["M0"]], o.Not(feasible(Lp))


_T4_VARS = {**_ints("M0 Lstar Lp k B bpb profiled override"), **_MIX_VARS}
def _t4_passes_core(F, o, v):
    """The pool part alone: any need N that auto-fit accepted fits in O - 1 blocks."""
    N, bpb, O = v["N"], v["bpb"], v["override"]
    avail = F.available_memory(o, v["profiled"], True, O, bpb)
    check_mem = F.check_memory(o, avail, bpb)
    nb = F.num_blocks(o, v["profiled"], True, O, bpb)
    hyps = _pos(bpb, O) + _nonneg(v["profiled"], N) + [check_mem > 0, N * bpb <= check_mem]
    return hyps, o.And(F.check_passes(o, N * bpb, check_mem), N <= nb - 1)


def _t4_monotone(index):
    def build(F, o, v):
        L1, L2 = v["L1"], v["L2"]
        hyps = _pos(L1, v["k"], v["B"]) + [L1 <= L2] + _mix_hyps(o, {**v, "M": L2})
        return hyps, _mix_pages(F, o, v, L1)[index] <= _mix_pages(F, o, v, L2)[index]
    return build


def _t4_maximal_core(F, o, v):
    """Monotone per-kind pages + L*+1 infeasible => every larger length infeasible."""
    kinds = ("f", "s", "c", "m")
    P1 = [v["P" + g] for g in kinds]   # pages at L* + 1
    P2 = [v["Q" + g] for g in kinds]   # pages at L' > L* + 1 (>= P1 by the monotone lemmas)
    bpb, cm = v["bpb"], v["check_mem"]
    hyps = (_nonneg(v["nf"], v["ns"], v["nc"], v["nm"], *P1) + _pos(bpb)
            + [q >= p for p, q in zip(P1, P2)] + [_mix_total(v, P1) * bpb > cm])
    return hyps, _mix_total(v, P2) * bpb > cm


_T4_VARS = {**_ints("M0 Lstar Lp k B bpb profiled override"), **_MIX_VARS}
_T4_MONO_VARS = {**_ints("L1 L2 k B"), **_MIX_VARS}
T4 = Theorem(
    id="T4", name="override-auto-fit",
    title="with num_gpu_blocks_override, auto-fit picks a length that passes the check and counts the null block",
    statement=("With num_gpu_blocks_override = O and bytes per block bpb, for any hybrid mix and profiled memory: "
               "the auto-fitted max_model_len L* (the largest L <= the model's maximum whose per-request need "
               "fits check memory O*bpb - bpb) passes the enough-memory check, needs at most O - 1 blocks (the "
               "pool has O blocks, one of them the null block), and no larger L up to the model's maximum fits. "
               "Seed 001 / vLLM #41069, null block PRs 47272 / 48724."),
    reference=("kvref.spec.pool_sizing.auto_fit_max_model_len",
               "kvref.spec.pool_sizing.estimate_max_model_len",
               "kvref.spec.pool_sizing.pool_bytes_per_block",
               "kvref.spec.pool_sizing.check_enough_kv_cache_memory",
               "kvref.spec.planning.plan_kv_cache",
               "vllm.v1.core.kv_cache_planning._auto_fit_max_model_len",
               "vllm.v1.core.kv_cache_planning._pool_bytes_per_block"),
    bounds=("auto-fit's binary search returns the largest feasible length; Z3 proves need(L) is monotone "
            "(lemmas monotone-*), and the search itself is checked against this characterisation by Hypothesis",
            "Mamba outside align mode: block_size >= the fitted length (vLLM sets it to the model maximum)",
            "chunked-local: attention_chunk_size is a multiple of block_size (as in T2)"),
    claim=Claim("all", "passes and maximal", _T4_VARS, _both(_t4_passes, _t4_maximal)),
    lemmas=(Claim("passes", "a need N accepted by auto-fit passes the check and N <= O - 1",
                  _ints("N bpb override profiled"), _t4_passes_core),
            Claim("monotone-full", "full-attention pages are monotone in max_model_len", _T4_MONO_VARS,
                  _t4_monotone(0)),
            Claim("monotone-swa", "sliding-window pages are monotone", _T4_MONO_VARS, _t4_monotone(1)),
            Claim("monotone-cl", "chunked-local pages are monotone", _T4_MONO_VARS, _t4_monotone(2)),
            Claim("monotone-mamba", "Mamba pages do not depend on max_model_len", _T4_MONO_VARS, _t4_monotone(3)),
            Claim("maximal", "monotone pages + L*+1 infeasible => no larger length fits",
                  _ints("nf ns nc nm Pf Ps Pc Pm Qf Qs Qc Qm bpb check_mem"), _t4_maximal_core)),
    combination=("'passes' with N = need(L*) gives the first part; 'maximal' with P_g = pages_g(L*+1), "
                 "Q_g = pages_g(L') and the monotone lemmas (L*+1 <= L') gives the second"),
    search_hints=(dict(nf=1, ns=0, nc=0, nm=0, dcp=1, k=1, B=2048, bpb=65536, bsf=16, align=False, spec=0, ckpt=0,
                       ckpt_flag=0, override=512, M0=32768),
                  dict(nf=1, ns=0, nc=0, nm=0, dcp=1, k=1, bpb=1, align=False, spec=0, ckpt=0, ckpt_flag=0),),
)


# ------------------------------------------------------------------------------------------- T5

_T5_VARS = {**_ints("bs1 bs2 bs3 dcp unit m cache_bs"),
            **{n: BOOL for n in "s1 s2 s3 c2 c3 unit_set".split()}}


def _t5_sizes(o, v):
    raw = (v["bs1"], v["bs2"], v["bs3"])
    eff = tuple(b * o.ite(v[s], v["dcp"], 1) for b, s in zip(raw, ("s1", "s2", "s3")))
    if hasattr(o, "note"):
        for b, s, e in zip(raw, ("s1", "s2", "s3"), eff):
            o.note(e, b, o.ite(v[s], v["dcp"], 1))
    return raw, eff


def _t5_goals(F, o, v):
    raw, eff = _t5_sizes(o, v)
    cacheable = (True, v["c2"], v["c3"])
    h = F.hash_block_size(o, eff, cacheable, v["unit_set"], v["unit"], v["cache_bs"])
    sbs = F.scheduler_block_size(o, eff)
    hyps = (_pos(*raw, v["dcp"], v["unit"], v["m"])
            + [v["cache_bs"] == eff[0]]  # cache_config.block_size: the first group's (read by a variant)
            # resolve_kv_cache_block_sizes raises unless prefix_match_unit divides every cacheable size
            + [o.Implies(o.And(v["unit_set"], c), o.divides(v["unit"], e)) for c, e in zip(cacheable, eff)]
            + [o.divides(e, v["m"]) for e in eff])  # m: any common multiple
    goals = ([o.Implies(c, divides_goal(o, h, e)) for c, e in zip(cacheable, eff)]
             + [divides_goal(o, h, sbs)] + [divides_goal(o, b, sbs) for b in raw + eff] + [sbs <= v["m"]])
    return hyps, goals


_T5_GOAL_NAMES = ("hash|size1", "hash|size2", "hash|size3", "hash|sbs", "raw1|sbs", "raw2|sbs", "raw3|sbs",
                  "eff1|sbs", "eff2|sbs", "eff3|sbs", "sbs<=m")


def _t5(F, o, v):
    hyps, goals = _t5_goals(F, o, v)
    return hyps, o.And(*goals)


class _LcmFactsOps:
    """Z3Ops for the T5 fold: ``lcm``/``gcd`` become fresh terms carrying the facts the lcm lemmas
    prove (``a | L``, ``b | L``, ``L >= 1``, ``L | m`` for the claim's common multiple ``m``; a gcd
    divides both arguments), each with its witness recorded. A divisibility goal ``d | x`` is then
    stated as ``(x == d * w1 * ... * wk) or d | x`` for a chain of recorded witnesses from ``x``
    down to ``d``: the first disjunct implies the second, so the goal means the same, but Z3 no
    longer has to find the chain itself."""

    def __init__(self, m):
        from .ops import Z3Ops

        self._o = Z3Ops()
        self.m = m
        self.edges: dict[int, list[tuple[object, object]]] = {}

    def __getattr__(self, item):
        return getattr(self._o, item)

    def note(self, big, small, witness):
        """Record ``big == small * witness`` (already implied by the constraints)."""
        self.edges.setdefault(big.get_id(), []).append((small, witness))

    def divides(self, d, x):
        k = self._o.fresh("mult")
        self.note(x, d, k)
        return x == d * k

    def lcm(self, a, b):
        o = self._o
        L, wa, wb, wm = (o.fresh(s) for s in ("lcmL", "wa", "wb", "wm"))
        o.side += [L >= 1, L == a * wa, L == b * wb, self.m == L * wm]
        self.note(L, a, wa), self.note(L, b, wb), self.note(self.m, L, wm)
        return L

    def gcd(self, a, b):
        o = self._o
        g, ka, kb = o.fresh("gcdG"), o.fresh("ka"), o.fresh("kb")
        o.side += [g >= 1, a == g * ka, b == g * kb]
        self.note(a, g, ka), self.note(b, g, kb)
        return g

    def _chain(self, x, d, seen=()):
        if x.get_id() == d.get_id():
            return []
        for small, w in self.edges.get(x.get_id(), ()):
            if small.get_id() in seen:
                continue
            rest = self._chain(small, d, seen + (x.get_id(),))
            if rest is not None:
                return [w] + rest
        return None

    def div_goal(self, d, x):
        import z3

        if z3.is_app_of(d, z3.Z3_OP_ITE):
            c, t, e = d.children()
            return z3.If(c, self.div_goal(t, x), self.div_goal(e, x))
        general = z3.Not(self._o.not_divides(d, x))
        chain = self._chain(x, d)
        if chain is None:
            return general
        prod = d
        for w in chain:
            prod = prod * w
        return z3.Or(x == prod, general)


def _t5_fold(index):
    def build(F, o, v):
        if o.name != "z3":
            hyps, goals = _t5_goals(F, o, v)
            return hyps, goals[index]
        lo = _LcmFactsOps(v["m"])
        hyps, goals = _t5_goals(F, lo, v)
        return hyps + lo._o.side, goals[index]
    return build


def _lcm_base(v):
    a, b, g, ka, kb, x, y, L = (v[n] for n in "a b g ka kb x y L".split())
    return [a >= 1, b >= 1, g > 0, a == g * ka, b == g * kb, a * x + b * y == g, L * g == a * b]


def _lcm_claim(name, text, extra, goal):
    def build(F, o, v):
        return _lcm_base(v) + extra(v), goal(v)
    return Claim(name, text, _ints("a b g ka kb x y L m u w t"), build)


_T5_LCM_LEMMAS = (
    _lcm_claim("lcm-cancel", "L*g = a*b with a = g*ka, b = g*kb => L = g*ka*kb",
               lambda v: [], lambda v: v["L"] == v["g"] * v["ka"] * v["kb"]),
    _lcm_claim("lcm-multiple", "a | L and b | L (witnesses kb, ka), L >= 1",
               lambda v: [v["L"] == v["g"] * v["ka"] * v["kb"]],
               lambda v: z3_and(v["L"] == v["a"] * v["kb"], v["L"] == v["b"] * v["ka"], v["L"] >= 1)),
    _lcm_claim("lcm-bezout", "m = a*u = b*w => m*g = L*g*(w*x + u*y) (Bezout)",
               lambda v: [v["m"] == v["a"] * v["u"], v["m"] == v["b"] * v["w"]],
               lambda v: v["m"] * v["g"] == v["L"] * v["g"] * (v["w"] * v["x"] + v["u"] * v["y"])),
    _lcm_claim("lcm-divides", "m*g = L*g*t, g > 0 => m = L*t, so L | m",
               lambda v: [v["m"] * v["g"] == v["L"] * v["g"] * v["t"]], lambda v: v["m"] == v["L"] * v["t"]),
    _lcm_claim("lcm-least", "L | m, L >= 1, m >= 1 => L <= m",
               lambda v: [v["m"] == v["L"] * v["t"], v["m"] >= 1, v["L"] >= 1], lambda v: v["L"] <= v["m"]),
)


def z3_and(*xs):
    import z3

    return z3.And(*xs)


T5 = Theorem(
    id="T5", name="block-size-threading",
    title="scheduler_block_size is a multiple of hash_block_size and of every group's block size, and the smallest",
    statement=("For three KV cache groups of any block sizes (each possibly DCP-sharded, any DCP size), any "
               "prefix-cacheable subset and any prefix_match_unit that resolve_kv_cache_block_sizes accepts: "
               "hash_block_size divides every prefix-cacheable group's block size; scheduler_block_size is a "
               "multiple of hash_block_size and of every group's raw and DCP-scaled block size (so the "
               "coordinator's divisibility assertion never fires); and no smaller positive common multiple of the "
               "DCP-scaled sizes exists. Seed 003 / vLLM #44165."),
    reference=("kvref.spec.block_sizes.resolve_kv_cache_block_sizes",
               "vllm.v1.core.kv_cache_utils.resolve_kv_cache_block_sizes",
               "vllm.v1.core.kv_cache_coordinator.KVCacheCoordinator.__init__"),
    bounds=("three groups (lcm and gcd fold pairwise, so more groups repeat the same step); the first group is "
            "prefix-cacheable (gcd is symmetric, any one will do)",),
    claim=Claim("all", "divisibility and minimality", _T5_VARS, _t5),
    lemmas=_T5_LCM_LEMMAS + tuple(
        Claim(f"fold:{g}", f"three-group fold, goal {g} (lcm steps replaced by the lcm lemmas' facts)",
              _T5_VARS, _t5_fold(i)) for i, g in enumerate(_T5_GOAL_NAMES)),
    combination=("the lcm lemmas show, for L = lcm(a, b) as encoded (Bezout gcd): a | L, b | L, L >= 1 and L | m "
                 "for every common multiple m; 'fold' uses exactly these facts for each pairwise step"),
    search_hints=(dict(dcp=1, s1=False, s2=False, s3=False, unit_set=False, unit=1, c2=True, c3=False, bs3=1),),
)


# ------------------------------------------------------------------------------------------- T6

def _t6(F, o, v):
    sw, extra, chunk, bs, bpc = (v[x] for x in "sw extra chunk bs bpc".split())
    tpc = bs * bpc
    hyps = _pos(sw, chunk, bs, bpc) + _nonneg(extra)
    w = F.offload_window_swa(o, sw, extra, tpc)
    need = o.max(sw, sw - 1 + extra)
    wc = F.offload_window_cl(o, chunk, tpc)
    supported = F.offload_supports_chunked_local
    if o.name == "z3":
        import z3

        supported = z3.BoolVal(bool(supported))
    return hyps, o.And(w * tpc >= need, (w - 1) * tpc < need, supported, wc * tpc >= chunk, (wc - 1) * tpc < chunk)


T6 = Theorem(
    id="T6", name="offload-window",
    title="the offload scheduler's window in chunks covers the attention window, tightly",
    statement=("For every block size bs, blocks per chunk bpc (tokens per chunk tpc = bs*bpc), sliding window sw "
               "and extra retained tokens e: get_sliding_window_size_in_chunks returns W with W*tpc >= "
               "max(sw, sw - 1 + e) (every token the next position attends or keeps) and (W-1)*tpc < that (no "
               "chunk more than needed); for chunked-local specs it is defined and covers attention_chunk_size "
               "tightly. Seed 002 / vLLM #41228, #51161."),
    reference=("kvref.impl.reference.offload.keys.get_sliding_window_size_in_chunks",
               "vllm.distributed.kv_transfer.kv_connector.v1.offloading.config.get_sliding_window_size_in_chunks"),
    bounds=(),
    claim=Claim("all", "covers tightly", _ints("sw extra chunk bs bpc"), _t6),
    search_hints=(dict(bs=16, bpc=4, sw=1024, chunk=8192),),
)


# ------------------------------------------------------------------------------------------- T7

def _t7(F, o, v):
    sw, extra, bs, k, B, M, c, n = (v[x] for x in "sw extra bs k B M c n".split())
    free, reserved, watermark = v["free"], v["reserved"], v["watermark"]
    hyps = _pos(sw, bs, k, B, M, n) + _nonneg(extra, c, free, reserved, watermark) + [c + n <= M]
    table_len = o.cdiv(c, bs)
    need_slot = o.min(c + n, M)
    cap = F.runtime_swa_cap(o, sw, extra, bs, k, B, M)
    predicted = F.step_predicted_blocks(o, need_slot, bs, table_len, cap)
    pulled = F.step_pulled_blocks(o, need_slot, bs, table_len)
    hyps.append(predicted + watermark <= free - reserved)  # allocate_slots' per-step check passed
    return hyps, o.And(pulled <= free, predicted == pulled)


T7 = Theorem(
    id="T7", name="predictor-equals-allocator",
    title="when the per-step check passes, allocate_new_blocks never runs out (no 'Cannot get N free blocks')",
    statement=("For a running sliding-window request at any step (c computed, n new, any cap), the number "
               "get_num_blocks_to_allocate predicts with apply_admission_cap=False equals the number "
               "allocate_new_blocks takes, so once allocate_slots' check passes, get_new_blocks cannot fail. "
               "Digest section 11.2 M3; the crash of vLLM PR 40027 / #45856."),
    reference=("kvref.impl.reference.single_type_manager.SingleTypeKVCacheManager.get_num_blocks_to_allocate",
               "kvref.impl.reference.single_type_manager.SingleTypeKVCacheManager.allocate_new_blocks",
               "vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager.get_num_blocks_to_allocate",
               "vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager.allocate_new_blocks"),
    bounds=("running request (fast path), no new prefix hits; the table covers the computed tokens",),
    claim=Claim("all", "predicted = pulled <= free", _ints("sw extra bs k B M c n free reserved watermark"), _t7),
    search_hints=(dict(bs=16, sw=1024, extra=0, k=1, B=2048, watermark=0, reserved=0),),
)


# ------------------------------------------------------------------------------------------- T8

def _t8(F, o, v):
    free, R, spec_step, full_need, n_new = (v[x] for x in "free R spec_step full_need n_new".split())
    hyps = _nonneg(free, R, spec_step, n_new) + [free >= R, full_need >= n_new, full_need <= free]
    reserved = F.async_load_reserved(o, R, spec_step)
    hyps.append(n_new <= free - reserved)  # allocate_slots(..., reserved_blocks=reserved) passed
    return hyps, free - n_new >= R


T8 = Theorem(
    id="T8", name="async-load-reservation",
    title="admitting an async KV load never takes blocks that in-flight prefills still need",
    statement=("If the free blocks cover what the in-flight prefills still need (R), then after admitting a "
               "request whose KV arrives asynchronously (allocate_slots with reserved_blocks = R + spec-decode "
               "step blocks), the free blocks still cover R: the parked load cannot starve the prefills already "
               "running (vLLM #45388, fixed by the reservation of #44560)."),
    reference=("kvref.impl.reference.kv_cache_manager.KVCacheManager.allocate_slots",
               "vllm.v1.core.sched.scheduler.Scheduler._inflight_prefill_reserved_blocks",
               "vllm.v1.core.kv_cache_manager.KVCacheManager.allocate_slots"),
    bounds=("the invariant free >= R holds before the admission (it does initially: R = 0)",),
    claim=Claim("all", "free after >= R", _ints("free R spec_step full_need n_new"), _t8),
)


# ------------------------------------------------------------------------------------------- T9

def _t9(F, o, v):
    nb, free, other, watermark, reserved, required, host_free = (
        v[x] for x in "nb free other watermark reserved required host_free".split())
    hyps = [nb >= 2, free <= nb - 1] + _nonneg(free, other, watermark, reserved, required, host_free)
    count = F.hisparse_source_admission(o, required, host_free, nb) + other
    refused = count + watermark > free - reserved  # allocate_slots returns None
    return hyps, o.And(o.Implies(required > host_free, refused),
                       o.Implies(required <= host_free, F.hisparse_source_admission(o, required, host_free, nb) == 0))


T9 = Theorem(
    id="T9", name="hisparse-host-refusal",
    title="a HiSparse request the host pool cannot back is refused, and host blocks never cost GPU blocks",
    statement=("On a HiSparse pool, when the host source needs more host blocks than its private pool has free, "
               "allocate_slots refuses the request whatever the GPU pool holds (at most num_gpu_blocks - 1 free: "
               "block 0 is the null block), the other groups' counts, the watermark and the reservation; when the "
               "host pool can back it, the source adds nothing to the GPU count (issue #23)."),
    reference=("kvref.spec.hisparse.source_admission_count",
               "kvref.impl.reference.hisparse_source_manager.HiSparseSourceManager.get_num_blocks_to_allocate",
               "vllm.v1.core.single_type_kv_cache_manager.HiSparseSourceManager.get_num_blocks_to_allocate",
               "vllm.v1.core.kv_cache_manager.KVCacheManager.allocate_slots"),
    bounds=("the GPU pool has its null block (num_gpu_blocks >= 2, free <= num_gpu_blocks - 1)",),
    claim=Claim("all", "refused when the host is short, else no GPU charge",
                _ints("nb free other watermark reserved required host_free"), _t9),
)


# ------------------------------------------------------------------------------------------ T10

def _frac_le(o, a, b):
    """``a <= b`` for fractions ``(num, den)`` with positive denominators."""
    return a[0] * b[1] <= b[0] * a[1]


def _frac_min(o, a, b):
    le = _frac_le(o, a, b)
    return o.ite(le, a[0], b[0]), o.ite(le, a[1], b[1])


def _t10(F, o, v, *, steady_within_window=True):
    nb, A, S, H, h = (v[x] for x in "nb A S H h".split())
    hyps = _nonneg(nb, H) + _pos(A, S, h) + ([S <= A] if steady_within_window else [])
    gpu = F.hisparse_steady_gpu(o, nb, A, S)
    steady = _frac_min(o, gpu, (H, h))
    admission = _frac_min(o, (nb, A), (H, h))  # get_max_concurrency_for_kv_cache_config with the host group
    return hyps, o.And(_frac_le(o, admission, steady), _frac_le(o, gpu, (nb, S)), gpu[0] >= 0)


T10 = Theorem(
    id="T10", name="hisparse-steady-state",
    title="HiSparse's steady-state concurrency is never below the admission figure, nor above the steady footprint",
    statement=("For a HiSparse pool of nb GPU blocks, a request needing A device blocks at admission and S at "
               "steady state (its resident groups pinned to the active tail, S <= A), and a host pool of H blocks "
               "with h per request: the HiSparseConnector's steady-state maximum concurrency is at least the "
               "engine's maximum concurrency min(nb/A, H/h) (the figure an operator reads can only grow once "
               "requests read from host), never negative, and its GPU part is at most nb/S (it never promises "
               "more requests than the pool holds at their steady footprint). Issue #22 (vLLM "
               "get_hisparse_steady_state_concurrency, get_max_concurrency_for_kv_cache_config)."),
    reference=("kvref.spec.planning_hisparse.hisparse_steady_state_concurrency",
               "kvref.spec.planning_hisparse.hisparse_max_concurrency",
               "vllm.v1.hisparse.layout.get_hisparse_steady_state_concurrency",
               "vllm.v1.core.kv_cache_utils.get_max_concurrency_for_kv_cache_config"),
    bounds=("a request's steady blocks are at most its admission blocks (S <= A: min(required, "
            "ACTIVE_TAIL_PAGES) per resident group)",),
    claim=Claim("all", "admission <= steady, steady GPU <= nb/S, non-negative", _ints("nb A S H h"), _t10),
    necessary=(Claim("steady-above-window", "steady blocks above the admission window (S > A)", _ints("nb A S H h"),
                     lambda F, o, v: _t10(F, o, v, steady_within_window=False)),),
)


# ------------------------------------------------------------------------------------------ T11

_PP_WORKERS = 3


def _t11(F, o, v, *, same_need=True):
    """Three pipeline workers: worker i has ``bpb_i`` bytes per block (its projected groups'
    widest), ``mem_i`` profiled bytes (or ``override × bpb_i``), and needs ``S_i`` blocks for one
    ``max_model_len`` request (the same on every worker: the projected groups keep the global
    groups' specs)."""
    override, override_set = v["override"], v["override_set"]
    hyps = _pos(override) + _nonneg(v["S0"])
    checks, own, memory = [], [], []
    for i in range(_PP_WORKERS):
        bpb, mem, need = v[f"bpb{i}"], v[f"mem{i}"], v[f"S{i}"]
        hyps += _pos(bpb) + _nonneg(mem, need)
        if same_need and i:
            hyps.append(need == v["S0"])
        m = o.ite(override_set, override * bpb, mem)
        memory.append(m)
        checks.append(F.check_passes(o, need * bpb, m - bpb))  # null block held back (PR 47272)
        own.append(o.fdiv(m, bpb))
    hyps.append(F.pp_workers_checked(o, checks))
    nb = F.pp_common_num_blocks(o, own)
    return hyps, o.And(*[v[f"S{i}"] <= nb - 1 for i in range(_PP_WORKERS)],
                       *[nb * v[f"bpb{i}"] <= memory[i] for i in range(_PP_WORKERS)])


_T11_VARS = {**_ints(" ".join(f"bpb{i} mem{i} S{i}" for i in range(_PP_WORKERS)) + " override"),
             "override_set": BOOL}

T11 = Theorem(
    id="T11", name="pipeline-common-pool",
    title="with pipeline parallelism, the common block count holds one max-length request on every worker",
    statement=("For three workers (PP stages / TP ranks) with any bytes per block bpb_i, profiled memory mem_i "
               "(or num_gpu_blocks_override x bpb_i) and S blocks one max_model_len request needs: if "
               "get_kv_cache_configs' per-worker check passes (S x bpb_i <= memory_i - bpb_i, the null block held "
               "back), then the smallest worker's block count nb = min_i memory_i // bpb_i, which every worker "
               "gets, leaves S <= nb - 1 usable blocks for the scheduler's request, and every worker's tensors "
               "(nb x bpb_i bytes) fit its memory. Issue #22 (vLLM get_kv_cache_configs)."),
    reference=("kvref.spec.planning_parallel.plan_kv_cache_workers",
               "vllm.v1.core.kv_cache_planning.get_kv_cache_configs"),
    bounds=("every worker needs the same blocks per max-length request (its groups are projections of the same "
            "global groups)",),
    claim=Claim("all", "S <= nb - 1 on every worker, nb x bpb_i <= memory_i", _T11_VARS, _t11),
    necessary=(Claim("different-needs", "workers needing different block counts", _T11_VARS,
                     lambda F, o, v: _t11(F, o, v, same_need=False)),),
)


THEOREMS: tuple[Theorem, ...] = (T1, T2, T3, T4, T5, T6, T7, T8, T9, T10, T11)
BY_ID = {t.id: t for t in THEOREMS}
BY_NAME = {t.name: t for t in THEOREMS}


def get_theorem(key: str) -> Theorem:
    """A theorem by id (``T3``) or name (``no-deadlock-at-startups-word``)."""
    from kvref.spec.errors import InvalidFieldError

    t = BY_ID.get(key.upper()) if isinstance(key, str) else None
    t = t or (BY_NAME.get(key) if isinstance(key, str) else None)
    if t is None:
        raise InvalidFieldError("theorem", key, "one of " + ", ".join(f"{x.id} ({x.name})" for x in THEOREMS))
    return t
