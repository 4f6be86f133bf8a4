"""Startup's word must hold at runtime: if startup sizing accepts a pool, one request of any length
up to ``max_model_len`` is admitted into it when empty and never runs out of blocks mid-prefill or
mid-decode.

This is the invariant vLLM broke in #39734 (the runtime gate charged sliding-window layers for the
whole sequence while startup sized them by the recycling bound: a request between the two waited
forever) and #35541 (``num_gpu_blocks_override`` ignored by the startup check). It is checked here
*dynamically*, against any implementation behind :class:`~kvref.impl.interface.KVCacheManagerLike`
— the reference, the torch implementation, or the vLLM installed on this machine, whose own spec
formulas then size the pool. Proofs of the same statement over all parameters live in
``kvref.proofs``; this check is what a vLLM developer runs against *their* checkout.

The pool is the smallest one startup accepts: ``num_blocks = 1 (null) + Σ_g pages_g(max_model_len)``
(docs/invariants.md S4/S5).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from types import SimpleNamespace

from kvref.impl.interface import KVCacheManagerLike, PoolConfig, make_manager
from kvref.impl.request import Request, RequestStatus
from kvref.spec import (
    ChunkedLocalAttentionSpec,
    EngineConfig,
    FullAttentionSpec,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

GROUP_KINDS = ("full", "sliding_window", "chunked_local", "mamba")


@dataclass(frozen=True)
class LivenessCase:
    """One generated configuration and the request to run through it."""

    block_size: int
    kinds: tuple[str, ...]
    max_model_len: int
    max_num_batched_tokens: int
    max_concurrent_batches: int
    sliding_window: int
    attention_chunk_size: int
    prompt_len: int
    #: sliding-window groups keep this many trailing tokens below the window (multi-module MTP /
    #: EAGLE re-prefill): startup's cap must count them, or the smallest accepted pool runs dry
    extra_retained_tokens: int = 0
    #: Mamba groups keep 1 + this many state blocks per request (speculative decoding: MTP on a
    #: hybrid such as Qwen3-Next); startup must size them so (PR 28176), or the gate never admits
    mamba_speculative_blocks: int = 0

    @property
    def enable_caching(self) -> bool:
        # vLLM requires Mamba's "align" mode for prefix caching; kvref models Mamba here in "none".
        return "mamba" not in self.kinds

    def specs(self) -> list[KVCacheSpec]:
        out: list[KVCacheSpec] = []
        common = dict(block_size=self.block_size, num_kv_heads=1, head_size=8, dtype="float16")
        for kind in self.kinds:
            if kind == "full":
                out.append(FullAttentionSpec(**common))
            elif kind == "sliding_window":
                out.append(SlidingWindowSpec(**common, sliding_window=self.sliding_window,
                                             extra_retained_tokens=self.extra_retained_tokens))
            elif kind == "chunked_local":
                out.append(ChunkedLocalAttentionSpec(**common, attention_chunk_size=self.attention_chunk_size))
            else:
                # With prefix caching off vLLM runs Mamba in "none" mode and sets its block size to
                # max_model_len (HybridAttentionMambaModelConfig), so one block holds the state.
                out.append(MambaSpec(block_size=self.max_model_len, shapes=((4, 8),), dtypes=("float32",),
                                     num_speculative_blocks=self.mamba_speculative_blocks))
        return out

    @property
    def scheduler_block_size(self) -> int:
        """lcm of the groups' block sizes, as vLLM's resolve_kv_cache_block_sizes returns it."""
        from math import lcm

        return lcm(*(s.block_size for s in self.specs()))

    def engine_config(self) -> EngineConfig:
        return EngineConfig(block_size=self.block_size, max_model_len=self.max_model_len,
                            max_num_batched_tokens=self.max_num_batched_tokens,
                            max_concurrent_batches=self.max_concurrent_batches,
                            enable_prefix_caching=self.enable_caching)

    def describe(self) -> str:
        return (f"groups={list(self.kinds)} block_size={self.block_size} max_model_len={self.max_model_len} "
                f"max_num_batched_tokens={self.max_num_batched_tokens} "
                f"concurrent_batches={self.max_concurrent_batches} sliding_window={self.sliding_window} "
                f"attention_chunk_size={self.attention_chunk_size} prompt_len={self.prompt_len}"
                + (f" extra_retained_tokens={self.extra_retained_tokens}" if self.extra_retained_tokens else "")
                + (f" mamba_speculative_blocks={self.mamba_speculative_blocks}" if self.mamba_speculative_blocks else ""))


@dataclass
class LivenessFailure:
    case: LivenessCase
    num_blocks: int
    step: int
    phase: str
    message: str
    pages_per_group: list[int] = field(default_factory=list)

    def render(self) -> str:
        return (f"{self.message} at step {self.step} ({self.phase}); pool of {self.num_blocks} blocks "
                f"(1 null + per-group startup bound {self.pages_per_group}); {self.case.describe()}")


def random_case(rng: random.Random) -> LivenessCase:
    """A random small configuration (mixes of full, sliding-window, chunked-local and Mamba groups)."""
    kinds = rng.choice([
        ("full",), ("sliding_window",), ("chunked_local",),
        ("full", "sliding_window"), ("full", "chunked_local"), ("full", "mamba"),
        ("full", "sliding_window", "sliding_window"), ("sliding_window", "full", "chunked_local"),
        # windows alone: a full-attention group's bound is reached only at max_model_len, and its
        # unused blocks mid-prefill hide a window group that holds more than startup sized it for
        ("sliding_window", "sliding_window"),
    ])
    max_model_len = rng.randint(1, 400)
    block_size = rng.choice([1, 2, 4, 8, 16])
    return LivenessCase(
        block_size=block_size, kinds=kinds, max_model_len=max_model_len,
        max_num_batched_tokens=rng.randint(1, 96), max_concurrent_batches=rng.choice([1, 2]),
        sliding_window=rng.randint(1, 80),
        # vLLM's local-attention backend asserts attn_chunk_size % block_size == 0
        # (make_local_attention_virtual_batches); the cap formula (no +1) relies on it.
        attention_chunk_size=block_size * rng.randint(1, max(1, 80 // block_size)),
        # one prompt in three is a whole max-length prefill: windows then slide under the largest
        # chunks, where a request holds the most blocks (a cap one block short shows only there)
        prompt_len=max_model_len if rng.randint(0, 2) == 0 else rng.randint(1, max_model_len),
        # five cases in eight keep extra trailing tokens below sliding windows (MTP); only a request
        # long enough to slide past them tells a cap that forgets them from one that counts them
        extra_retained_tokens=rng.choice((0, 0, 0, 1, 3, block_size, 2 * block_size + 1, 17)),
        # drawn last and only for Mamba cases, so the other cases of a seed stay as they were
        mamba_speculative_blocks=rng.choice((0, 1, 2)) if "mamba" in kinds else 0)


def startup_pages(kind: str, case: LivenessCase) -> list[int]:
    """Blocks per group one max-length request needs, by *that implementation's* formulas.

    For ``kind == "vllm"`` the installed vLLM's own spec classes compute it (so a vLLM checkout whose
    sizing and gate disagree is caught); otherwise kvref.spec does.
    """
    cfg = case.engine_config()
    specs = case.specs()
    if kind != "vllm":
        return [s.max_memory_usage_blocks(cfg) for s in specs]
    from kvref.impl.vllm import to_vllm_spec

    vcfg = SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=case.max_model_len),
        max_in_flight_tokens=cfg.max_in_flight_tokens,
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        cache_config=SimpleNamespace(mamba_cache_mode="none"),
        scheduler_config=SimpleNamespace(max_num_encoder_input_tokens=cfg.max_num_encoder_input_tokens),
    )
    out = []
    for s in specs:
        v = to_vllm_spec(s)
        out.append(-(-v.max_memory_usage_bytes(vcfg) // v.page_size_bytes))
    return out


def run_case(kind: str, case: LivenessCase) -> LivenessFailure | None:
    """Admit one request into the smallest accepted pool and run it to ``max_model_len`` tokens."""
    pages = startup_pages(kind, case)
    num_blocks = 1 + sum(pages)
    cfg = case.engine_config()
    pool = PoolConfig.off_plan(
        "the smallest pool startup accepts, counted by the implementation under test's own formulas",
        num_blocks=num_blocks,
        groups=tuple(KVCacheGroupSpec((f"layer{i}",), s) for i, s in enumerate(case.specs())),
        max_model_len=case.max_model_len, scheduler_block_size=case.scheduler_block_size,
        hash_block_size=case.scheduler_block_size if not case.enable_caching else case.block_size,
        max_in_flight_tokens=cfg.max_in_flight_tokens, enable_caching=case.enable_caching)
    mgr: KVCacheManagerLike = make_manager(kind, pool)
    req = Request("r0", [(7 * i + 3) % 1000 for i in range(case.prompt_len)],
                  max_tokens=max(1, case.max_model_len - case.prompt_len))
    fail = lambda step, phase, msg: LivenessFailure(case, num_blocks, step, phase, msg, pages)  # noqa: E731
    asynchronous = case.max_concurrent_batches > 1
    budget = case.max_num_batched_tokens
    step = 0
    # Prefill in chunks; with async scheduling the previous chunk is still in flight.
    mgr.get_computed_blocks(req)
    while req.num_computed_tokens < req.num_tokens:
        chunk = min(budget, req.num_tokens - req.num_computed_tokens)
        first = req.num_computed_tokens == 0
        out = mgr.allocate_slots(req, chunk, full_sequence_must_fit=first, has_scheduled_reqs=False)
        if out is None:
            what = ("the full-sequence admission gate rejected the request in an empty pool"
                    if first else "allocation failed mid-prefill")
            return fail(step, "admission" if first else "prefill", what)
        if first:
            req.status = RequestStatus.RUNNING
        req.num_computed_tokens += chunk
        req.num_in_flight_tokens = chunk if asynchronous else 0
        step += 1
    # Decode to max_model_len, one token per step.
    while req.num_tokens < case.max_model_len:
        req.num_in_flight_tokens = 0
        req.output_token_ids.append((11 * req.num_tokens) % 1000)
        out = mgr.allocate_slots(req, 1)
        if out is None:
            return fail(step, "decode", "allocation failed during decode")
        req.num_computed_tokens += 1
        req.num_in_flight_tokens = 1 if asynchronous else 0
        step += 1
    mgr.free(req)
    if mgr.get_num_free_blocks() != num_blocks - 1:
        return fail(step, "free", f"{mgr.get_num_free_blocks()} free blocks after freeing, expected {num_blocks - 1}")
    return None


def check_startup_liveness(kind: str, num_cases: int, seed: int = 0) -> tuple[int, list[LivenessFailure]]:
    """Run ``num_cases`` random cases against ``kind``; return (cases run, failures)."""
    rng = random.Random(seed)
    failures = []
    for _ in range(num_cases):
        failure = run_case(kind, random_case(rng))
        if failure is not None:
            failures.append(failure)
    return num_cases, failures
