"""Generated traces for the OffloadingConnector under sparse prefix-cache retention (#22).

vLLM's ``prefix_cache_retention_interval`` (``CacheConfig``) thins out what sliding-window groups
cache: dense (None) keeps the tail a hit needs at every chunk boundary; ``0`` only the tails at the
request's *reachable boundaries* - its replay boundary ``num_prompt_tokens - 1`` and the
shared-prefix junction the GPU cache's lookup reported (``Request.shared_prefix_boundary``, where a
sliding-window group's hit stopped short of the full-attention one); ``k > 0`` those plus one tail
per ``k``-token segment. The OffloadingConnector reads the same value
(``SchedulerOffloadConfig.from_spec``): its store mask is the GPU cache's
``SlidingWindowManager.reachable_block_mask`` with the retention interval and those boundaries, a
request's final partial segment is no longer stored for its own sake (no store horizon), and the
finished-request tail reconsideration of the dense case is off. ``from_spec`` refuses a negative
interval and one that is not a multiple of a windowed group's chunk.

Two parts, each compared with the installed vLLM:

* :func:`retention_refusal_cases` / :func:`compare_refusals`: connector configurations (pool
  shapes, chunk sizes, intervals valid and not) - whether each side refuses, and why (negative, or
  which chunk the interval must divide);
* :func:`retention_cases` / :func:`run_retention_traces`: FA + sliding-window (+ chunked-local)
  pools with an interval, on the partial-tail traces' rounds of shared-prefix arrivals, drains and
  idle GPU prefix-cache resets (the next arrivals then look their prefixes up in the CPU pool, where
  only the retained tails can serve the window), compared after every operation.
"""

from __future__ import annotations

import random
import re
from collections import Counter

from kvref.impl.reference.offload.cpu_offloading_manager import CPUOffloadingManager
from kvref.impl.reference.offload.offloading_scheduler import OffloadingConnectorScheduler
from kvref.models.offload.offloading_connector_world import OffloadingConfig, OffloadingWorld
from kvref.models.offload.offloading_partial_tails import partial_tail_ops, run_compared_traces
from kvref.models.offload.world_common import OffloadInvariantError
from kvref.spec.errors import InvalidFieldError

#: what the retention traces reached on the reference, summed over runs (the check's summary)
COVERAGE: Counter = Counter()


def retention_config(rng: random.Random) -> OffloadingConfig:
    """A random FA + sliding-window pool (a chunked-local group one time in three) with a retention
    interval: 0 (only the reachable boundaries) half the time, else one to four chunks; windows of
    one to four blocks with MTP's ``extra_retained_tokens`` one time in two, one or two blocks a
    chunk, CPU pools from tight to roomy, events and worker counts as conform-offload draws."""
    bpc = rng.choice([1, 1, 2])
    tpc = 4 * bpc
    return OffloadingConfig(
        block_size=4, blocks_per_chunk=bpc, max_model_len=128, num_gpu_blocks=rng.randint(30, 44),
        num_cpu_chunks=rng.choice([3, 6, 12, 24, 48]), sliding_window=rng.choice([4, 8, 12, 16]),
        extra_retained_tokens=rng.choice([0, 0, 1, 3]), attention_chunk_size=rng.choice([None, None, 8, 16]),
        cache_policy=rng.choice(["lru", "arc"]), num_workers=rng.randint(1, 2),
        offload_prompt_only=rng.random() < 0.6, store_threshold=rng.choice([0, 0, 0, 2]),
        kv_events=rng.choice(["off", "placeholder", "self_describing"]),
        prefix_cache_retention_interval=rng.choice([0, 0, 0, tpc, 2 * tpc, 3 * tpc, 4 * tpc]))


def retention_cases(seed: int, n: int) -> list[tuple[OffloadingConfig, list[tuple]]]:
    """``n`` (config, ops) pairs drawn from ``seed``."""
    rng = random.Random(f"offload-retention-{seed}")
    return [(retention_config(rng), partial_tail_ops(rng, rng.randint(30, 50))) for _ in range(n)]


def run_retention_traces(cases, backends: tuple[str, ...] = ("reference", "vllm")) -> dict[str, int]:
    """Every case on ``backends``, compared after every operation
    (:func:`~kvref.models.offload.offloading_partial_tails.run_compared_traces`); raises
    :class:`OffloadInvariantError` at the first difference. :data:`COVERAGE` gains what the
    reference worlds reached."""
    cases = list(cases)
    for i, (cfg, _) in enumerate(cases):
        if not isinstance(cfg, OffloadingConfig) or cfg.prefix_cache_retention_interval is None:
            raise OffloadInvariantError(f"case {i}: no retention interval: {cfg!r}")
    return run_compared_traces(cases, backends, "retention", _count)


def _count(w: OffloadingWorld) -> None:
    """Junctions the GPU lookup reported, and stores of the sliding-window group."""
    COVERAGE["junctions"] += sum(bool(getattr(r.req, "shared_prefix_boundary", 0)) for r in w.reqs.values())
    COVERAGE["swa_stores"] += sum(any(int.from_bytes(bytes(k[-4:]), "big") == 1 for k in keys)
                                  for m in w.metas for _, _, keys, _, _ in m[1])


# --- configuration refusals ------------------------------------------------------------------

def retention_refusal_cases(rng: random.Random, n: int) -> list[OffloadingConfig]:
    """``n`` connector configurations: full attention alone, beside a sliding window, a chunked-local
    group or a Mamba "align" group; one to three blocks a chunk; intervals None, negative, 0, a block,
    a chunk, a chunk and a block, two chunks."""
    out = []
    for _ in range(n):
        bpc = rng.randint(1, 3)
        tpc = 4 * bpc
        shape = rng.choice(["fa", "swa", "local", "mamba", "swa+local"])
        kw: dict = dict(block_size=4, blocks_per_chunk=bpc, num_gpu_blocks=24)
        if "swa" in shape:
            kw["sliding_window"] = rng.choice([4, 8, 12])
        if "local" in shape:
            kw["attention_chunk_size"] = rng.choice([8, 16])
        if shape == "mamba":
            kw["mamba_align"] = True
        kw["prefix_cache_retention_interval"] = rng.choice([None, -tpc, -4, 0, 4, tpc, tpc + 4, 2 * tpc])
        out.append(OffloadingConfig(**kw))
    return out


def reference_refusal(cfg: OffloadingConfig) -> str | None:
    """Why kvref's connector refuses ``cfg`` (its :class:`InvalidFieldError`), or None."""
    specs = [g.kv_cache_spec for g in cfg.kvref_groups()]
    try:
        OffloadingConnectorScheduler(specs, CPUOffloadingManager(4, "lru"), cfg.tokens_per_hash(), cfg.blocks_per_chunk,
                                     retention_interval=cfg.prefix_cache_retention_interval)
    except InvalidFieldError as exc:
        return str(exc)
    return None


def refusal_kind(message: str | None) -> tuple | None:
    """A refusal reduced to what both sides say: None (accepted), ``("negative",)``, ``("chunk", n)``
    (the interval must be a multiple of ``n`` tokens) or ``("other", message)``."""
    if message is None:
        return None
    if "non-negative" in message:
        return ("negative",)
    m = re.search(r"tokens_per_chunk[ =(]*(\d+)", message)
    return ("chunk", int(m.group(1))) if m else ("other", message)


def compare_refusals(cases, vllm_refusal=None) -> dict[str, int]:
    """Each configuration on kvref's connector and vLLM's ``from_spec`` (``vllm_refusal(cfg)``, by
    default :func:`kvref.impl.vllm.offload.vllm_offloading_config_refusal`): both must accept, or
    refuse for the same reason. Raises :class:`OffloadInvariantError` at the first that differs.
    Returns ``{"configs", "refused"}``."""
    if vllm_refusal is None:
        from kvref.impl.vllm.offload import vllm_offloading_config_refusal as vllm_refusal
    refused = 0
    for i, cfg in enumerate(cases):
        ref = refusal_kind(reference_refusal(cfg))
        theirs = refusal_kind(vllm_refusal(cfg))
        if ref != theirs:
            raise OffloadInvariantError(f"retention config {i}: kvref {'accepts' if ref is None else 'refuses ' + str(ref)}"
                                        f", vLLM {'accepts' if theirs is None else 'refuses ' + str(theirs)}; "
                                        f"config {cfg}")
        refused += ref is not None
    return {"configs": len(cases), "refused": refused}
