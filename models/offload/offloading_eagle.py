"""Generated traces for the OffloadingConnector on pools with an EAGLE/MTP drafter group (#22).

A KV cache group holding the drafter's layers (vLLM ``KVCacheGroupSpec.is_eagle_group``) is
volatile at its tail: the drafter's KV of the last accepted position is rewritten when a draft is
rejected. vLLM's OffloadingConnector therefore

* looks such a group up one chunk past the boundary and pops its last hit chunk (a window one
  chunk longer for a sliding-window drafter group), re-popping when a non-drafter group tightens the
  boundary (``_lookup_complete_chunks``; issue #52735: without the widened query the pop could push
  the boundary under a coarser group's chunk and zero the whole hit);
* does not store the group's last offloadable chunk while the request decodes, and stores it once
  the request finished (``RequestOffloadState.storable_chunks``, #52735: a chunk skipped without
  the cursor holding back would leave a permanent hole in the prefix);
* masks a sliding-window drafter group's stores with the EAGLE run (a block longer, ending a block
  later) and keeps no final-segment tail for it.

The GPU cache runs with ``use_eagle`` and drops a hit's last block of that group. The traces are
the partial-tail traces' rounds (shared-prefix arrivals, drains, idle GPU prefix-cache resets, so
arrivals look their prefixes up in the CPU pool) on FA pools and FA + sliding-window pools with
the drafter on either group, decode tokens offloaded mostly; each is
compared with the installed vLLM after every operation.
"""

from __future__ import annotations

import random
from collections import Counter

from kvref.models.offload.offloading_connector_world import OffloadingConfig, OffloadingWorld, random_transfer_params
from kvref.models.offload.offloading_partial_tails import partial_tail_ops, run_compared_traces
from kvref.models.offload.world_common import OffloadInvariantError

#: what the EAGLE traces reached on the reference, summed over runs (the check's summary)
COVERAGE: Counter = Counter()


def eagle_config(rng: random.Random) -> OffloadingConfig:
    """A random pool with a drafter group: FA alone, or beside a sliding window (one to four
    blocks, MTP's extra retained tokens one time in three), the drafter on either group, one
    time in five none flagged (speculative decoding whose drafter is not annotated: the GPU drops in
    every group, the connector treats none as a drafter); no chunked-local group (EAGLE refuses
    chunked local attention with prefix caching); one, two or four blocks a chunk; decode tokens offloaded
    three times in four; CPU pools from tight to roomy; events and worker counts as conform-offload draws; requests'
    ``kv_transfer_params`` one time in two, one of them a chunk-aligned ``max_load_tokens`` cap (it
    ends the hit inside the keys, where the drafter group's widened query reaches a chunk further
    than the cap)."""
    bpc = rng.choice([1, 1, 2, 4])  # 4: a segment longer than a drafter window's run (a real EAGLE mask)
    sw = rng.choice([None, 4, 8, 12, 16])
    cfg = OffloadingConfig(
        block_size=4, blocks_per_chunk=bpc, max_model_len=128, num_gpu_blocks=rng.randint(30, 44),
        num_cpu_chunks=rng.choice([3, 6, 12, 24, 48]), sliding_window=sw,
        extra_retained_tokens=rng.choice([0, 0, 3]) if sw else 0,
        cache_policy=rng.choice(["lru", "arc"]), num_workers=rng.randint(1, 2),
        offload_prompt_only=rng.random() < 0.25, store_threshold=rng.choice([0, 0, 0, 2]),
        kv_events=rng.choice(["off", "placeholder", "self_describing"]),
        kv_transfer_params=({"max_load_tokens": 4 * bpc * rng.randint(1, 3)},)
        + tuple(random_transfer_params(rng) for _ in range(rng.randint(1, 3))) if rng.random() < 1 / 2 else ())
    eagle_group = rng.randrange(len(cfg.kvref_groups()))
    # drawn from a generator seeded by rng's state, rng not advanced: the other draws stay as they were
    if random.Random(hash(rng.getstate()[1])).random() < 1 / 5:
        # speculative decoding, no group flagged: the GPU drops in every group, the connector in none
        return OffloadingConfig(**{**vars(cfg), "speculative_eagle": True})
    return OffloadingConfig(**{**vars(cfg), "eagle_group": eagle_group})


def eagle_cases(seed: int, n: int) -> list[tuple[OffloadingConfig, list[tuple]]]:
    """``n`` (config, ops) pairs drawn from ``seed``."""
    rng = random.Random(f"offload-eagle-{seed}")
    return [(eagle_config(rng), partial_tail_ops(rng, rng.randint(30, 50))) for _ in range(n)]


def run_eagle_traces(cases, backends: tuple[str, ...] = ("reference", "vllm")) -> dict[str, int]:
    """Every case on ``backends``, compared after every operation
    (:func:`~kvref.models.offload.offloading_partial_tails.run_compared_traces`); raises
    :class:`OffloadInvariantError` at the first difference. :data:`COVERAGE` gains what the
    reference worlds reached."""
    cases = list(cases)
    for i, (cfg, _) in enumerate(cases):
        if not isinstance(cfg, OffloadingConfig) or (cfg.eagle_group is None and not cfg.speculative_eagle):
            raise OffloadInvariantError(f"case {i}: no drafter group: {cfg!r}")
    return run_compared_traces(cases, backends, "EAGLE", _count)


def _count(w: OffloadingWorld) -> None:
    """Loads and stores that hold a key of the drafter group (none flagged: of any group)."""
    g = w.cfg.eagle_group
    for m in w.metas:
        for kind, jobs in (("eagle_loads", m[0]), ("eagle_stores", m[1])):
            COVERAGE[kind] += sum(any(g is None or int.from_bytes(bytes(k[-4:]), "big") == g for k in keys)
                                  for _, _, keys, _, _ in jobs)


#: what the EAGLE + partial-tail traces reached on the reference, summed over runs
TAIL_COVERAGE: Counter = Counter()


def eagle_partial_tail_config(rng: random.Random) -> OffloadingConfig:
    """A partial-tail pool (:func:`~kvref.models.offload.offloading_partial_tails.partial_tail_config`:
    full attention + Mamba "align", blocks wider than the hashes, one block a chunk) whose
    full-attention group holds the drafter. vLLM then keys that group's partial tail at its EAGLE
    proof margin past the boundary (one hash: these pools' hits are fine-grained), searches two
    blocks past the complete hit (the bridge chunk is the drafter's popped one), and stores a tail
    only for a request that loaded from the CPU tier, once the step computes its proof."""
    from kvref.models.offload.offloading_partial_tails import partial_tail_config

    cfg = partial_tail_config(rng)
    return OffloadingConfig(**{**vars(cfg), "eagle_group": 0})


def eagle_partial_tail_cases(seed: int, n: int) -> list[tuple[OffloadingConfig, list[tuple]]]:
    """``n`` (config, ops) pairs drawn from ``seed``: the partial-tail traces' rounds (arrivals of
    earlier prompts cut at their tails, drains, idle GPU prefix-cache resets)."""
    rng = random.Random(f"offload-eagle-partial-tails-{seed}")
    return [(eagle_partial_tail_config(rng), eagle_partial_tail_ops(rng, rng.randint(30, 50))) for _ in range(n)]


def eagle_partial_tail_ops(rng: random.Random, n: int) -> list[tuple]:
    """About ``n`` operations in rounds over one shared prefix family: three waves of arrivals, each
    run to the end, its jobs completed and the GPU prefix cache reset. A tail is stored only by a
    request that loaded from the CPU tier, so it takes two waves to store one (the first stores the
    complete chunks, the second loads them and hands its tail over) and a third to look it up (and
    the bridge chunk before it); a few random operations (:data:`~.offloading_partial_tails.KINDS`)
    between rounds."""
    from kvref.models.offload.offloading_partial_tails import KINDS, _op

    ops: list[tuple] = []
    while len(ops) < n:
        fam = rng.choice([0, 1])
        for _ in range(3):
            ops += [_op(rng, "add", fam=fam) for _ in range(rng.randint(1, 2))]
            ops += [_op(rng, "step", rep=4) for _ in range(rng.randint(2, 4))]
            ops += [_op(rng, "drain"), _op(rng, "cload", flag=True)]
        ops += [_op(rng, rng.choice(KINDS)) for _ in range(rng.randint(0, 3))]
    return ops


def run_eagle_partial_tail_traces(cases, backends: tuple[str, ...] = ("reference", "vllm"),
                                  digest=None) -> dict[str, int]:
    """Every case on ``backends``, compared after every operation (jobs, keys, blocks, chunk states,
    KV events, hit sources, metrics); raises :class:`OffloadInvariantError` at the first difference.
    :data:`TAIL_COVERAGE` gains the reference connector's partial-tail counts (tail hits, those
    loading the bridge chunk, stores, stores skipped for the margin). ``digest``: as
    :func:`~kvref.models.offload.offloading_partial_tails.run_partial_tail_traces`."""
    cases = list(cases)
    for i, (cfg, _) in enumerate(cases):
        if not isinstance(cfg, OffloadingConfig) or cfg.eagle_group is None or not cfg.hash_block_size:
            raise OffloadInvariantError(f"case {i}: not an EAGLE partial-tail configuration: {cfg!r}")

    def count(w: OffloadingWorld) -> None:
        _count(w)
        TAIL_COVERAGE.update(w.b.conn.partial_tail_counts)
        if digest is not None:
            digest.update(repr((w.metas, w.kv_events)).encode())

    return run_compared_traces(cases, backends, "EAGLE partial-tail", count)
