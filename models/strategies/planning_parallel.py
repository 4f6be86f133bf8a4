"""Hypothesis strategies for multi-worker startup planning (pipeline + tensor parallel, #22).

A case is a model from :func:`~kvref.models.strategies.planning.layer_sets` cut into 1-4
contiguous pipeline stages, each reported by ``tp`` workers (TP ranks report the same layers), a
per-worker memory drawn near that worker's own enough-memory boundary (so the smallest worker —
not always the first — decides the common block count, auto-fit and the verdict), and each
attention layer's ``max_tp_shards`` (one value per model, as vLLM's MLA layers all say 1).
Rarer shapes: an attention-free model (no layer on any worker), and a layer reported with a
different spec by a second worker (vLLM refuses it).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from hypothesis import strategies as st

from kvref.spec import AUTO, AttentionSpec, EngineConfig, KVCacheSpec, KVRefError
from kvref.spec.planning_packed import get_kv_cache_groups_for_layout
from kvref.spec.planning_parallel import project_kv_cache_groups_to_worker
from kvref.spec.pool_sizing import group_blocks_per_request, pool_bytes_per_block

from .planning import FAMILIES, LAYOUTS, engine_configs, layer_sets, with_extra_retained

#: what a case stresses: "pp" (stages), "tp" (replicas), "autofit" (each stage fits another length),
#: "free" (attention-free), "mismatch" (a layer two workers report differently)
SHAPES = ("pp", "pp", "pp", "pp", "tp", "tp", "autofit", "free", "mismatch")
#: TP cases draw attention-only models (a Mamba layer is never replicated, so its gcd is always 1)
_TP_FAMILIES = ("uniform", "uniform_type", "fa_swa", "fa_chunked", "mla", "cross", "hidden")


@dataclass(frozen=True)
class ParallelPlanCase:
    shape: str
    family: str
    workers: list[dict[str, KVCacheSpec]]
    config: EngineConfig
    available_memory: list[int]
    extra_retained_tokens: int
    kv_cache_layout: str = "LBNHC"
    tensor_parallel_size: int = 1
    max_tp_shards: dict[str, int] = field(default_factory=dict)
    draft_layers: tuple[str, ...] | None = None  # EAGLE drafter layers under use_eagle_block_drop()


def _worker_need(layers, worker, config, layout) -> tuple[int, int] | None:
    """(bytes per block, blocks one request needs) of one worker's projection, by kvref."""
    try:
        groups = get_kv_cache_groups_for_layout(layers, config.disable_hybrid_kv_cache_manager, layout)
        projected = project_kv_cache_groups_to_worker(groups, worker)
        m = config.resolved_max_model_len
        return pool_bytes_per_block(projected), sum(group_blocks_per_request(g.kv_cache_spec, config, m)
                                                    for g in projected)
    except (KVRefError, AssertionError):
        return None


@st.composite
def stage_split(draw, names: list[str]) -> list[list[str]]:
    """``names`` cut into 1-4 contiguous non-empty stages (vLLM's PP partitions layers in order)."""
    k = draw(st.integers(1, min(4, len(names))))
    cuts = sorted(draw(st.lists(st.integers(1, len(names) - 1), min_size=k - 1, max_size=k - 1, unique=True))) \
        if len(names) > 1 and k > 1 else []
    bounds = [0, *cuts, len(names)]
    return [names[a:b] for a, b in zip(bounds, bounds[1:])]


@st.composite
def parallel_plan_cases(draw, shape: str | None = None, family: str | None = None) -> ParallelPlanCase:
    shape = shape or draw(st.sampled_from(SHAPES))
    mamba_mode = draw(st.sampled_from(("none", "align", "all")))
    families = _TP_FAMILIES if shape == "tp" else FAMILIES
    family, layers = draw(layer_sets(family or draw(st.sampled_from(families)), mamba_mode))
    extra = draw(st.sampled_from((0,) * 6 + (1, 3)))
    layers = with_extra_retained(layers, extra)
    config = draw(engine_configs(mamba_mode))
    if shape == "autofit":
        config = replace(config, max_model_len=AUTO, derived_max_model_len=draw(st.sampled_from((4096, 32768, 131072))),
                         num_gpu_blocks_override=None)
    layout = draw(st.sampled_from(("BLHNC", "BLNHC") if family == "packed" and draw(st.integers(0, 3)) else LAYOUTS))
    if shape == "tp" and family != "packed":
        layout = "LBNHC"
    tp = draw(st.sampled_from((2, 4, 8))) if shape == "tp" else draw(st.sampled_from((1, 1, 1, 2)))
    if shape == "tp":  # DCP-sharded caches are never TP replicas
        config = replace(config, dcp_world_size=draw(st.sampled_from((1, 1, 2))))
    if shape == "free":
        workers = [{} for _ in range(draw(st.integers(1, 4)))]
        memory = [draw(st.integers(0, 1 << 30)) for _ in workers]
        if draw(st.booleans()):
            config = replace(config, num_gpu_blocks_override=draw(st.integers(1, 64)))
        return ParallelPlanCase(shape, "free", workers, config, memory, 0, layout, tp)
    stages = draw(stage_split(list(layers)))
    ranks = tp if shape == "tp" else draw(st.sampled_from((1, 1, 2)))
    workers = [{n: layers[n] for n in stage} for stage in stages for _ in range(ranks)]
    if shape == "mismatch":
        # a second worker reports one of its layers with another block size
        i = draw(st.integers(0, len(workers) - 1))
        name = draw(st.sampled_from(sorted(workers[i])))
        try:
            other = replace(workers[i][name], block_size=workers[i][name].block_size * 2)
        except KVRefError:  # a padded page too small for twice the tokens
            other = replace(workers[i][name], dcp_sharded=not workers[i][name].dcp_sharded)
        workers.append({name: other})
    # vLLM's MLA layers say 1; more shards than TP ranks is clamped to one replica
    if shape == "tp" and config.dcp_world_size > 1:  # fewer shards than ranks: replicas unless DCP-sharded
        shards = draw(st.sampled_from((1, max(1, tp // 2))))
    else:
        shards = draw(st.sampled_from((None, 1, max(1, tp // 2), tp, 2 * tp, 4 * tp) if shape == "tp"
                                      else (None, None, 1, 1, 2, 4)))
    max_tp_shards = {n: shards for n, s in layers.items()
                     if shards is not None and isinstance(s, AttentionSpec)}
    memory = []
    # else each worker near its own boundary, mostly above it (TP cases: replicas need a plan that starts)
    anywhere = shape != "tp" and draw(st.integers(0, 5)) == 0
    short = draw(st.integers(-1, len(workers) * 3)) if shape != "tp" else -1  # this worker gets a block too few
    for i, w in enumerate(workers):
        need = _worker_need(layers, w, config, layout)
        if need is None or need[0] == 0 or anywhere:
            memory.append(draw(st.integers(0, 1 << 34)))
        elif shape == "autofit":  # room for a fraction of one model-length request: each fits its own length
            memory.append(need[0] * (2 + draw(st.integers(0, max(need[1] - 1, 0)))))
        else:
            bpb, blocks = need
            spare = -1 if i == short else draw(st.sampled_from((0, 0, 1, 2, 5, 40)))
            m = bpb * (blocks + 1 + spare) + draw(st.sampled_from((0, 0, 1, bpb - 1)))
            memory.append(max(m, 0))
    if draw(st.integers(0, 4)) == 0:
        need = _worker_need(layers, workers[0], config, layout)
        if need is not None:
            config = replace(config, num_gpu_blocks_override=max(1, need[1] + 1 + draw(st.integers(-2, 2))))
    # an EAGLE drafter's layers (vLLM marks their groups is_eagle_group), sometimes none of them
    draft = (tuple(draw(st.lists(st.sampled_from(sorted(layers)), max_size=2, unique=True)))
             if draw(st.integers(0, 3)) == 0 else None)
    return ParallelPlanCase(shape, family, workers, config, memory, extra, layout, tp, max_tp_shards, draft)
