"""Hypothesis strategies for KV cache pools and the requests that run on them.

Pools are small on purpose (a few dozen blocks, block sizes 1-8, ``max_model_len`` ≤ 96) so that
a 30-step trace exhausts the pool, evicts cached blocks, slides windows and preempts: the
interesting paths of vLLM's block pool need pressure, not size.

Group sets (``GROUP_SETS``): uniform full attention (one group, or two FA groups with different
block sizes), FA + sliding window, FA + chunked-local, FA + SWA + SWA, SWA alone, and FA + Mamba
with prefix caching off (``mamba_cache_mode="none"``, optional speculative state blocks),
FA + Mamba ``"align"`` with caching on (the Mamba block equal to ``hash_block_size``) and FA +
Mamba ``"align"`` with a Mamba block 2-4x ``hash_block_size`` (``fa+mamba_fine``: fine-grained
partial hits, copy-on-write of shared partial tails, hand-over of a producer's tail). Mamba
"align" groups get prefill checkpoint blocks one time in two. FA + R-SWA (``fa+rswa``: the
gap between the prompt and the decode window is freed) and FA + a circular buffer (``fa+ring``:
one uncached ring block per request).

The scheduler and hash block sizes are the ones startup resolves for the drawn groups
(:func:`kvref.spec.resolve_kv_cache_block_sizes`, what :func:`~kvref.spec.plan_kv_cache` calls),
and a pool that startup would build exactly as drawn comes through :func:`plan_kv_cache` and
:meth:`PoolConfig.from_plan`; every other one comes through :meth:`PoolConfig.off_plan`, naming
what startup would not do (both by :meth:`PoolConfig.through_plan`) (#26: the strategy took an lcm of its own and sometimes doubled it unsaid).
The draws are the same either way, so the machines exercise the same pools.
"""

from __future__ import annotations

import dataclasses
import random

from hypothesis import strategies as st

from kvref.impl.interface import PoolConfig
from kvref.spec import EngineConfig, resolve_kv_cache_block_sizes
from kvref.spec.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    RSWASpec,
    SlidingWindowSpec,
)

GROUP_SETS = ("fa", "fa+fa", "fa+swa", "fa+chunked", "fa+swa+swa", "swa", "fa+mamba", "fa+mamba_align",
              "fa+mamba_fine", "fa+rswa", "fa+ring")
#: group sets with more than one group (run by vLLM's HybridKVCacheCoordinator when caching)
HYBRID_GROUP_SETS = tuple(g for g in GROUP_SETS if "+" in g)

_DTYPES = ("float16", "bfloat16", "float32", "fp8")


@st.composite
def attention_kwargs(draw, block_size: int) -> dict:
    return dict(block_size=block_size, num_kv_heads=draw(st.integers(1, 2)), head_size=draw(st.sampled_from((1, 4))),
                dtype=draw(st.sampled_from(_DTYPES)))


@st.composite
def pool_configs(draw, group_sets: tuple[str, ...] = GROUP_SETS, min_blocks: int = 4, max_blocks: int = 48,
                 caching: bool | None = None, eagle: bool | str = True, retention: bool | str = False) -> PoolConfig:
    """A ``PoolConfig`` that vLLM 0.33.0 accepts (its coordinator's divisibility asserts hold).

    ``eagle``: False never, True sometimes (1 in 6), ``"always"`` every pool that allows it.
    ``retention``: draw ``prefix_cache_retention_interval`` for caching pools with a sliding-window
    or Mamba group (issue #23): False never (dense), True one pool in two, ``"always"`` every such
    pool (0 or 1-4 scheduler blocks); other pools stay dense.
    """
    kind = draw(st.sampled_from(group_sets))
    names = kind.split("+")
    hash_bs = draw(st.sampled_from((1, 2, 4)))
    enable_caching = draw(st.integers(0, 4)) > 0 if caching is None else caching
    if "mamba" in names:
        enable_caching = False  # Mamba prefix caching needs mamba_cache_mode="align"
    if "mamba_align" in names or "mamba_fine" in names:
        enable_caching = True
    # Block sizes: multiples of hash_block_size. Unitary with caching needs hash == block size;
    # chunked-local needs every block size == scheduler_block_size.
    same_bs = len(names) == 1 or "chunked" in names or draw(st.integers(0, 2)) == 0
    base = hash_bs * (1 if len(names) == 1 and enable_caching else draw(st.sampled_from((1, 2))))
    sizes = [base if same_bs else hash_bs * draw(st.sampled_from((1, 2, 4))) for _ in names]
    groups = []
    for i, (name, bs) in enumerate(zip(names, sizes)):
        layer = (f"layer_{i}",)
        if name == "fa":
            spec = FullAttentionSpec(**draw(attention_kwargs(bs)))
        elif name == "swa":
            # extra_retained_tokens: multi-module MTP keeps blocks below the window (five in eight;
            # a block's worth or more moves the admission cap by a block whatever the alignment)
            spec = SlidingWindowSpec(**draw(attention_kwargs(bs)), sliding_window=draw(st.integers(1, 4 * bs + 3)),
                                     extra_retained_tokens=draw(st.sampled_from((0, 0, 0, 1, 2, 5, bs, bs + 1))))
        elif name == "chunked":
            chunk = draw(st.one_of(st.integers(1, 4).map(lambda k: k * bs), st.integers(1, 4 * bs)))
            spec = ChunkedLocalAttentionSpec(**draw(attention_kwargs(bs)), attention_chunk_size=chunk)
        elif name == "rswa":  # windows from none to a few blocks: decode past prompt + window frees the gap
            spec = RSWASpec(**draw(attention_kwargs(bs)), rswa_window=draw(st.sampled_from((0, 1, bs, 2 * bs + 1, 9))))
        elif name == "ring":
            spec = CircularBufferSpec(**draw(attention_kwargs(bs)))
        elif name == "mamba":
            spec = MambaSpec(block_size=bs, shapes=((2, 3), (4,)), dtypes=("float16", "float32"),
                             num_speculative_blocks=draw(st.sampled_from((0, 0, 1, 2))))
        else:  # mamba_align: one state block per hash block; mamba_fine: 2-4 hash blocks (partial hits)
            sizes[i] = bs = hash_bs * (draw(st.sampled_from((2, 4))) if name == "mamba_fine" else 1)
            # prefill checkpoints: one extra block exports the state at the prompt's boundary
            # from inside a chunk, on the backend's alignment grid (vLLM sets both together)
            checkpoint = draw(st.sampled_from((None, None, 1, hash_bs)))
            spec = MambaSpec(block_size=bs, shapes=((2, 3), (4,)), dtypes=("float16", "float32"),
                             mamba_cache_mode="align", num_prefill_checkpoint_blocks=int(checkpoint is not None),
                             prefill_checkpoint_alignment=checkpoint,
                             # MTP/EAGLE state blocks: relocated to the table's end as the state moves
                             num_speculative_blocks=draw(st.sampled_from((0, 0, 0, 1, 2))))
        groups.append(KVCacheGroupSpec(layer, spec))
    # Startup's block sizes (resolve_kv_cache_block_sizes): the lcm of the group block sizes; a
    # hashing hybrid pool hashes at the drawn size, the user's prefix_match_unit (it divides every
    # group's block size); a single hashing group at its block size, which the draw made it.
    hybrid_hashing = len(names) > 1 and enable_caching
    engine = EngineConfig(enable_prefix_caching=enable_caching, prefix_match_unit=hash_bs if hybrid_hashing else None,
                          mamba_cache_mode="align" if "mamba_align" in names or "mamba_fine" in names else "none")
    sbs, startup_hash_bs = resolve_kv_cache_block_sizes(tuple(groups), engine)
    off_plan = []  # what startup would not do, for PoolConfig.off_plan's why
    if startup_hash_bs != hash_bs:
        off_plan.append(f"prefix caching off yet hashing every {hash_bs} tokens (startup: {startup_hash_bs})")
    if len(names) > 1 and "chunked" not in names and draw(st.sampled_from((1, 1, 2))) == 2:
        sbs *= 2
        off_plan.append("scheduler_block_size twice startup's lcm of the group block sizes (hits and admission on "
                        "a grid coarser than any group's block, the coordinator's divisibility rules still holding)")
    max_model_len = draw(st.integers(8, 96))
    # The in-flight budget the window/chunk admission caps are computed with. None (a whole request)
    # never lets a cap bind; small budgets make long requests run at the cap, where a predictor that
    # clamps more (or less) than the allocation takes shows (PR 40027).
    max_in_flight = draw(st.one_of(st.none(), st.integers(1, 64), st.sampled_from((1, 2, 4, 8))))
    watermark = draw(st.sampled_from((0.0, 0.0, 0.0, 0.05, 0.1)))
    # Pressure: from a pool too small for one max-length request to about two of them; one pool in
    # four sits right at one max-length request (+-2 blocks), where admission caps, reservations
    # and evictions are decided by a block (faults there pass on roomier pools).
    one_request = sum(-(-max_model_len // bs) for bs in sizes)
    hi = max(min_blocks, min(max_blocks, 2 * one_request + 2))
    if draw(st.integers(0, 3)) == 0:
        num_blocks = min(hi, max(min_blocks, one_request + draw(st.integers(-2, 2), label="near_full")))
    else:
        num_blocks = draw(st.integers(min_blocks, hi))
    # EAGLE drafting: hits drop their last block (vLLM asserts it is not combined with chunked-local).
    # Pools of >= 3 groups get it one time in two: the hybrid coordinator's hit search then iterates
    # over groups with the dropped block (spec-decode hits on hybrid pools, issue #13).
    odds = 1 if len(names) >= 3 else 5
    use_eagle = bool(eagle) and "chunked" not in names and (eagle == "always" or draw(st.integers(0, odds)) == 0)
    retention_interval = None
    sparse = any(isinstance(g.kv_cache_spec, (SlidingWindowSpec, MambaSpec)) for g in groups)
    if retention and sparse and enable_caching and (retention == "always" or draw(st.booleans())):
        # 0: only replay boundaries and junctions; k scheduler blocks: also one tail per k blocks
        retention_interval = sbs * draw(st.sampled_from((0, 0, 1, 2, 3, 4)), label="retention_blocks")
    fields = dict(num_blocks=num_blocks, groups=tuple(groups), max_model_len=max_model_len,
                  scheduler_block_size=sbs, hash_block_size=hash_bs, max_in_flight_tokens=max_in_flight,
                  enable_caching=enable_caching, watermark=watermark, use_eagle=use_eagle,
                  prefix_cache_retention_interval=retention_interval)
    return _pool(fields, engine, off_plan)


def _pool(fields: dict, engine: EngineConfig, off_plan: list[str]) -> PoolConfig:
    """The drawn pool through :meth:`PoolConfig.from_plan` where :func:`plan_kv_cache` builds it as
    drawn (each group one layer, ``num_gpu_blocks_override`` the block count, the in-flight budget one
    batch of ``max_num_batched_tokens``), else through :meth:`PoolConfig.off_plan` saying why not."""
    if fields["max_in_flight_tokens"] is None:
        off_plan.append("no scheduler behind it (max_in_flight_tokens None: a whole request in flight)")
    if fields["prefix_cache_retention_interval"] is not None:
        off_plan.append("sparse prefix-cache retention, which kvref's plan does not carry")
    engine = dataclasses.replace(engine, max_model_len=fields["max_model_len"],
                                 max_num_batched_tokens=fields["max_in_flight_tokens"] or 1,
                                 num_gpu_blocks_override=fields["num_blocks"])
    planned = ("num_blocks", "groups", "max_model_len", "scheduler_block_size", "hash_block_size",
               "max_in_flight_tokens", "enable_caching")
    return PoolConfig.through_plan({k: fields[k] for k in planned}, engine,
                                   "generated pools aim at admission edges startup never sizes", off_plan,
                                   {k: v for k, v in fields.items() if k not in planned})


#: small vocabulary so unrelated prompts still collide on short blocks now and then
TOKENS = st.integers(0, 7)


def tokens_from_seed(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(8) for _ in range(n)]


@st.composite
def prompts(draw, max_model_len: int, known: list[list[int]]) -> list[int]:
    """A prompt of 1..max_model_len-1 tokens; often a prefix of a known sequence plus a new tail.

    New tokens come from a drawn seed rather than token by token: a 40-step trace of 64-token
    prompts would otherwise exhaust Hypothesis's data buffer. Seed 0 is what shrinking reaches.
    """
    limit = max(1, min(max_model_len - 1, 64))
    cut = 0
    base: list[int] = []
    if known and draw(st.integers(0, 2)) > 0:
        base = draw(st.sampled_from(known))
        # Often the whole known sequence (a multi-turn follow-up), else a random cut.
        cut = min(len(base), limit) if draw(st.booleans()) else draw(st.integers(0, min(len(base), limit)))
    tail = draw(st.integers(0 if cut else 1, limit - cut))
    seed = draw(st.integers(0, 2**16))
    return list(base[:cut]) + tokens_from_seed(seed, tail)


CACHE_SALTS = st.sampled_from((None, None, None, None, "salt-a", "salt-b"))
