"""HiSparse startup sizing: vLLM 0.33.0's engine path vs :mod:`kvref.spec.planning_hisparse` (#22/#23).

Generated sparse-MLA models (source layers with index-group leaders, indexer layers), hot-buffer
settings, host pools (or no HiSparseConnector), device memory around one request's need,
``num_gpu_blocks_override``, auto-fit, the step budget and the KV-cache layout. vLLM plans them
through ``get_global_kv_cache_groups`` → ``get_kv_cache_configs`` → ``update_kv_cache_capacity``
(:mod:`kvref.impl.vllm.planning_hisparse`) and the spec predicts every observable: the device
groups, bytes per block, GPU and host block counts, host stride, max_model_len after auto-fit,
every ``KVCacheTensor`` (layers, size, strides, offset, host residency), max concurrency, KV-cache
size in tokens and the HiSparseConnector's steady-state concurrency; or which rule rejects the
setting (with vLLM's estimated maximum length). Run inside ``conform-planning``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from hypothesis import strategies as st

from kvref.spec import EngineConfig, InsufficientKVCacheError
from kvref.spec.errors import InvalidFieldError
from kvref.spec.mathutil import cdiv
from kvref.spec.planning_hisparse import plan_hisparse_kv_cache

_REASONS = {InsufficientKVCacheError.AUTO_FIT_FAILED: "auto_fit_failed",
            InsufficientKVCacheError.NO_MEMORY: "no_memory", InsufficientKVCacheError.TOO_LONG: "too_long"}


@dataclass(frozen=True)
class HiSparsePlanCase:
    source: tuple[tuple[str, int, bool], ...]  # (name, head_size, is_index_group_leader)
    indexer: tuple[tuple[str, int], ...]  # (name, head_size)
    top_k: int
    device_buffer_size: int | None
    host_budget: int | None
    config: EngineConfig
    available_memory: int
    kv_cache_layout: str


#: one flaw per rejected case, so every rule of vLLM's HiSparse startup is met in a short run
FLAWS = ("no_indexer", "device_buffer", "mixed_heads", "short_host", "exact_host", "no_connector", "layout",
         "memory", "override")


@st.composite
def hisparse_plan_cases(draw, flaw: str | None = "any") -> HiSparsePlanCase:
    """``flaw=None``: a deployment that starts (uniform source heads, an indexer, a valid hot buffer, a
    host pool with room, memory for several requests, a block-outermost layout), so the pools, tensors
    and both concurrency figures are compared; one of :data:`FLAWS`: that deployment with the flaw, so
    its rule is met; ``"any"``: four in ten without a flaw, the rest with any one."""
    if flaw == "any":
        flaw = None if draw(st.integers(0, 9)) < 4 else draw(st.sampled_from(FLAWS))
    elif flaw is not None and flaw not in FLAWS:
        raise InvalidFieldError("flaw", flaw, "None, 'any' or one of " + ", ".join(FLAWS))
    block_size = draw(st.sampled_from([16, 64]))
    heads = draw(st.sampled_from([(32, 64), (64, 128)] if flaw == "mixed_heads" else [(64,), (128,)]))
    n = draw(st.integers(2 if flaw == "mixed_heads" else 1, 5))
    source = tuple((f"model.layers.{i}.attn", draw(st.sampled_from(heads)), i == 0 or draw(st.booleans()))
                   for i in range(n))
    indexer = tuple((f"model.layers.{i}.indexer", draw(st.sampled_from([64, 96, 128, 192])))
                    for i in range(0 if flaw == "no_indexer" else draw(st.integers(1, 3))))
    top_k = draw(st.sampled_from([8, 64, 512]))
    buffer = draw(st.sampled_from([1, top_k - 1, 32769]) if flaw == "device_buffer" else
                  st.one_of(st.none(), st.integers(top_k, 4096), st.sampled_from([top_k, 32768])))
    # auto-fit meets the host pool and the layout in its length test (vLLM's HiSparse ``fits``)
    auto = draw(st.integers(0, 3)) < (2 if flaw in ("short_host", "no_connector", "layout") else 1)
    mml = draw(st.one_of(st.integers(1, 4096), st.sampled_from([1, 16, 64, 1024])))
    override = draw(st.one_of(st.none(), st.none(), st.none(), st.integers(1000, 2000)))
    config = EngineConfig(block_size=block_size, max_model_len="auto" if auto else mml, derived_max_model_len=mml,
                          max_num_batched_tokens=draw(st.sampled_from([1, 16, 100, 2048, 8192])),
                          max_concurrent_batches=draw(st.sampled_from([1, 1, 2])),
                          num_gpu_blocks_override=draw(st.integers(1, 8)) if flaw == "override" else override)
    source_page = block_size * sum(h for _, h, _ in source)
    host_need = source_page * (cdiv(mml, block_size) + 2)
    host_budget = (None if flaw == "no_connector" else host_need if flaw == "exact_host" else
                   draw(st.integers(0, host_need - 1)) if flaw == "short_host" else
                   draw(st.integers(host_need, 256 * host_need)))
    # device memory: room for several requests (blocks at most the widest group), or about one
    block_guess = block_size * max(sum(h for _, h, _ in source), sum(h for _, h in indexer), 1)
    blocks_need = (n + 1) * cdiv(mml, block_size) + n * cdiv(buffer or 2 * top_k, block_size) + 1
    low, high = (0, 2 * blocks_need) if flaw == "memory" else (blocks_need, draw(st.sampled_from([8, 32])) * blocks_need)
    available = block_guess * draw(st.integers(low, high)) + draw(st.integers(0, block_guess))
    layout = draw(st.sampled_from(["BHLNC", "LBNHC", "LBHNC"] if flaw == "layout" else ["BLNHC", "BLHNC"]))
    return HiSparsePlanCase(source, indexer, top_k, buffer, host_budget, config, available, layout)


def hisparse_plan_families(examples: Callable[[int, int], int]) -> list[tuple[Any, int]]:
    """(strategy, example count) per family, ``examples(fast, ci)`` sizing each: deployments that start,
    then every flaw alone, so each rule of vLLM's HiSparse startup is met in every run (a short run of
    ``"any"`` meets a given flaw a handful of times at most)."""
    return [(hisparse_plan_cases(None), examples(16, 80))] + [(hisparse_plan_cases(f), examples(3, 12)) for f in FLAWS]


def kvref_hisparse_plan(case: HiSparsePlanCase) -> dict[str, Any]:
    """The spec's plan of ``case`` in the driver's normalised form, or the rule that rejects it."""
    bs = case.config.block_size
    try:
        plan = plan_hisparse_kv_cache(
            [(name, bs * head, leader) for name, head, leader in case.source],
            [(name, bs * head) for name, head in case.indexer], bs, case.top_k, case.device_buffer_size,
            case.host_budget, case.config.resolved_max_model_len, case.available_memory,
            max_in_flight_tokens=case.config.max_in_flight_tokens,
            num_gpu_blocks_override=case.config.num_gpu_blocks_override, auto_fit=case.config.auto_fit,
            kv_cache_layout=case.kv_cache_layout)
    except InsufficientKVCacheError as exc:
        return {"error": _REASONS[exc.reason], "estimated_max_model_len": exc.estimated_max_model_len}
    except InvalidFieldError as exc:
        return {"error": exc.field, "estimated_max_model_len": 0}
    plan.check_invariants()
    return {
        "device_groups": tuple((kind, tuple(f"{n}" for n in names), page, blocks)
                               for kind, names, page, blocks in plan.device_groups),
        "bytes_per_block": plan.bytes_per_block, "num_blocks": plan.num_blocks,
        "host_num_blocks": plan.host_num_blocks, "host_block_stride": plan.host_block_stride,
        "max_model_len": plan.max_model_len,
        "tensors": tuple((t.size, t.layers, t.layer_stride, t.block_stride, t.offset, t.host_resident)
                         for t in plan.tensors),
        "max_concurrency": plan.max_concurrency, "kv_cache_size_tokens": plan.kv_cache_size_tokens,
        "steady_state_concurrency": plan.steady_state_concurrency,
    }


def agree_hisparse_plan(planner: Any, case: HiSparsePlanCase) -> dict[str, Any]:
    """Assert vLLM and the spec size ``case`` identically (every observable); return vLLM's outcome."""
    from kvref.impl.vllm.planning_hisparse import vllm_hisparse_plan

    theirs = vllm_hisparse_plan(planner, case.source, case.indexer, case.config.block_size, case.top_k,
                                case.device_buffer_size, case.host_budget, case.config, case.available_memory,
                                case.kv_cache_layout)
    ours = kvref_hisparse_plan(case)
    if "error" in theirs or "error" in ours:
        assert ours == theirs, f"HiSparse plan: kvref {ours} vs vLLM {theirs}\n{case}"
        return theirs
    for key, want in theirs.items():
        assert ours[key] == want, f"HiSparse plan {key}: kvref {ours[key]!r} != vLLM {want!r}\n{case}"
    return theirs
