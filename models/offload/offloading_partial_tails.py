"""Generated traces for the OffloadingConnector's partial tails (#22).

vLLM turns partial tails on only for a full-attention + Mamba "align" pool whose blocks are wider
than the request hashes, with one block a chunk (``SchedulerOffloadConfig.supports_partial_tail``).
There the prompt's last hash boundary inside a block is stored (the COW-ed state and the attention
block holding it), and a later request with the same prefix finds it past the complete chunks,
once the GPU prefix cache no longer holds it. The general traces of conform-offload draw such a pool
one configuration in twelve and rarely come back to a stored prompt after the GPU forgot it, so these
traces force the pool shape and lean on the operations that make a partial tail a hit: drains
(the stores complete), GPU prefix-cache resets while idle, arrivals of the shared prefixes at
lengths whose last hash boundary falls inside a block.

Each trace runs on the reference and the installed vLLM's connector, compared after every operation
(every job, key, block, chunk state, KV event, hit source and metric of
:class:`~kvref.models.offload.offloading_connector_world.OffloadingWorld`).
"""

from __future__ import annotations

import random
from collections import Counter

from kvref.models.offload.offloading_connector_world import OffloadingConfig, OffloadingWorld, random_transfer_params
from kvref.models.offload.world_common import OffloadInvariantError

#: operation kinds (the 9-tuples of :mod:`kvref.models.offload.traces`): ``cload`` with its flag set
#: is an idle GPU prefix-cache reset, which turns the next arrival's prefix into a CPU lookup;
#: ``prefix`` (:func:`apply_partial_tail_op`) is an arrival of an earlier prompt cut at its partial tail
KINDS = ["step"] * 7 + ["add"] * 3 + ["prefix"] * 2 + ["drain"] * 4 + ["cload"] * 4 + ["cstore"] * 2 + \
    ["abort", "preempt", "reset"]

#: what the partial-tail traces reached on the reference, summed over runs (the check's summary)
COVERAGE: Counter = Counter()


def partial_tail_config(rng: random.Random) -> OffloadingConfig:
    """A random pool with partial tails: FA + Mamba "align", 8- or 4-token blocks, hashes of half or a
    quarter block, CPU pools from tight to roomy, events and worker counts as conform-offload draws,
    and one time in three requests' ``kv_transfer_params`` (load caps cut the tail lookup; store caps
    only those vLLM ignores or reads as none here: a positive cap below a prompt's tail makes vLLM
    0.33.0 assert, :func:`_without_store_cap`)."""
    bs, hbs = rng.choice([(8, 4), (8, 2), (4, 2)])
    params = tuple(_without_store_cap(random_transfer_params(rng)) for _ in range(rng.randint(2, 4))) \
        if rng.random() < 1 / 3 else ()
    return OffloadingConfig(block_size=bs, hash_block_size=hbs, blocks_per_chunk=1, mamba_align=True, max_model_len=64,
                            num_gpu_blocks=rng.randint(32, 48) * 8 // bs, num_cpu_chunks=rng.choice([3, 6, 12, 24, 48]),
                            cache_policy=rng.choice(["lru", "arc"]), num_workers=rng.randint(1, 2),
                            offload_prompt_only=rng.random() < 0.7,
                            store_threshold=rng.choice([0, 0, 0, 2]),
                            kv_events=rng.choice(["off", "placeholder", "self_describing", "self_describing"]),
                            kv_transfer_params=params)


def _without_store_cap(params: dict | None) -> dict | None:
    """``params`` less a positive ``max_offload_tokens``: vLLM 0.33.0's partial-tail store asserts
    ``boundary <= max_offload_tokens`` and the engine dies (docs/differences.md; the directed test
    ``test_vllm_asserts_on_a_store_cap_below_a_partial_tail`` keeps that visible)."""
    if params and type(params.get("max_offload_tokens")) is int and params["max_offload_tokens"] > 0:
        params = {k: v for k, v in params.items() if k != "max_offload_tokens"}
    return params


def _op(rng: random.Random, kind: str, **fixed) -> tuple:
    """One 9-tuple ``(kind, family, prompt_len, tail, chunk, repeat, pick, count, flag)``: shared
    prefixes mostly (families 0 and 1), prompt lengths around block edges."""
    op = dict(kind=kind, fam=rng.choice([0, 0, 1, 1, 2]), n=rng.choice([5, 9, 10, 11, 13, 14, 18, 20, 21, 27, 30]),
              tail=rng.choice([0, 0, 1, 2, 3]), chunk=rng.choice([8, 16, 64, 64]), rep=rng.randint(1, 4),
              pick=rng.randint(0, 99), count=rng.randint(1, 2), flag=rng.random() < 0.6)
    op.update(fixed)
    return tuple(op.values())


def partial_tail_ops(rng: random.Random, n: int) -> list[tuple]:
    """About ``n`` operations in rounds: one or two arrivals, a step, up to two more arrivals (their
    lookups meet the tails still being stored), steps enough to finish them, every job completed, the GPU prefix cache reset (the engine is idle then, mostly), then a few random
    operations (:data:`KINDS`) - so the next round's arrivals look their prefixes up in the CPU pool,
    partial tails included."""
    ops: list[tuple] = []
    while len(ops) < n:
        ops += [_op(rng, rng.choice(["add", "add", "prefix"])) for _ in range(rng.randint(1, 2))]
        ops += [_op(rng, "step", rep=rng.randint(1, 4))]
        # arrivals while the first ones' tails are still being stored (lookups that must wait)
        ops += [_op(rng, rng.choice(["add", "prefix"])) for _ in range(rng.randint(0, 2))]
        ops += [_op(rng, "step", rep=4) for _ in range(rng.randint(2, 4))]
        ops += [_op(rng, "drain"), _op(rng, "cload", flag=True)]
        ops += [_op(rng, rng.choice(KINDS)) for _ in range(rng.randint(0, 4))]
    return ops


def apply_partial_tail_op(w: OffloadingWorld, op: tuple):
    """:func:`~kvref.models.offload.traces.apply_offloading_op`, plus ``prefix``: a new request for
    an earlier prompt cut at its last hash boundary inside the prompt (where its partial tail was
    stored) - the whole new prompt then ends on a stored tail, which a hit must never cover (the
    last prompt token is computed) - half the time followed by ``tail`` tokens of its own."""
    from kvref.models.offload.traces import apply_offloading_op

    if op[0] != "prefix":
        return apply_offloading_op(w, op)
    w.check_started()
    _, _, _, tail, _, _, pick, _, flag = op
    if not w.order:
        return None
    prompt = w.prompts[w.order[pick % len(w.order)]]
    h = w.cfg.tokens_per_hash()
    cut = (len(prompt) - 1) // h * h
    if cut == 0:
        return None
    return w.add_request(prompt[:cut] + ([9] * tail if flag else []))


def partial_tail_cases(seed: int, n: int) -> list[tuple[OffloadingConfig, list[tuple]]]:
    """``n`` (config, ops) pairs drawn from ``seed``."""
    rng = random.Random(f"offload-partial-tails-{seed}")
    return [(partial_tail_config(rng), partial_tail_ops(rng, rng.randint(30, 50))) for _ in range(n)]


def run_partial_tail_traces(cases, backends: tuple[str, ...] = ("reference", "vllm"), digest=None) -> dict[str, int]:
    """Run every case on ``backends``, compared after every operation; raise
    :class:`OffloadInvariantError` at the first difference (or a content-model breach on one backend
    only). Returns ``{"traces", "ops"}``; :data:`COVERAGE` gains what the reference world reached.
    ``digest`` (a hashlib object), when given, is fed each finished reference world's job metadata
    and KV events: a fingerprint of the whole trace (the reproducibility test compares it)."""
    cases = list(cases)
    for i, (cfg, _) in enumerate(cases):
        if not isinstance(cfg, OffloadingConfig) or not cfg.hash_block_size:
            raise OffloadInvariantError(f"case {i}: not a partial-tail configuration: {cfg!r}")

    def count(w: OffloadingWorld) -> None:
        _count(w)
        if digest is not None:
            digest.update(repr((w.metas, w.kv_events)).encode())

    return run_compared_traces(cases, backends, "partial-tail", count)


def run_compared_traces(cases, backends: tuple[str, ...], what: str, count=None) -> dict[str, int]:
    """Run every (config, ops) case on ``backends`` with :func:`apply_partial_tail_op`, compared
    after every operation (the step outputs and everything :meth:`OffloadingWorld.observe` shows);
    raise :class:`OffloadInvariantError` naming ``what`` trace at the first difference, an
    assertion of either side, or a content-model breach on one backend only. ``count(world)`` is
    called with each finished reference world. Returns ``{"traces", "ops"}``."""
    traces = ops_run = 0
    for i, (cfg, ops) in enumerate(cases):
        worlds = [OffloadingWorld(cfg, b, strict=False) for b in backends]
        traces += 1
        for j, op in enumerate(ops):
            try:
                outs = [apply_partial_tail_op(w, op) for w in worlds]
            except KeyError:
                break  # vLLM 0.33.0's KeyError after a connector reset (docs/offload.md), as conform-offload
            except AssertionError as exc:
                raise OffloadInvariantError(f"{what} trace {i} op {j} {op}: {type(exc).__name__}: {exc}; "
                                            f"config {cfg}") from exc
            ops_run += 1
            if len(worlds) > 1:
                a, b = worlds[0].observe(), worlds[1].observe()
                if outs[0] != outs[1] or a != b:
                    diff = "the step outputs" if outs[0] != outs[1] else \
                        "the observed " + ", ".join(k for k in a if a[k] != b.get(k))
                    raise OffloadInvariantError(f"{what} trace {i} op {j} {op}: {diff} differ; config {cfg}")
        if len({tuple(w.violations) for w in worlds}) > 1:
            raise OffloadInvariantError(f"{what} trace {i}: the content model breaks on one backend only: "
                                        f"{[w.violations[:2] for w in worlds]}; config {cfg}")
        if count is not None:
            count(worlds[0])
    return {"traces": traces, "ops": ops_run}


def _count(w: OffloadingWorld) -> None:
    """Partial-tail stores (one job holding every group's key at one hash), their flushes, and loads
    that read a partial tail (a key of the Mamba group off the block grid)."""
    mamba = len(w.cfg.kvref_groups()) - 1
    stores = {j: keys for m in w.metas for j, _, keys, _, _ in m[1]}
    tails = {j for j, keys in stores.items() if len(keys) > 1 and len({bytes(k[:-4]) for k in keys}) == 1}
    COVERAGE["tail_stores"] += len(tails)
    COVERAGE["tail_flushes"] += len({j for m in w.metas for j in m[2]} & tails)
    tail_keys = {bytes(k) for j in tails for k in stores[j]}
    COVERAGE["tail_loads"] += sum(any(bytes(k) in tail_keys and int.from_bytes(k[-4:], "big") == mamba for k in keys)
                                  for m in w.metas for _, _, keys, _, _ in m[0])

