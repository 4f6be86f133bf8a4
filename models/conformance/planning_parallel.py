"""Multi-worker startup planning: vLLM 0.33.0's ``get_global_kv_cache_groups`` +
``get_kv_cache_configs`` over several workers vs :mod:`kvref.spec.planning_parallel` (#22).

Generated pipeline-parallel splits (1-4 stages, each reported by 1-8 TP ranks), per-worker memory
around each worker's own boundary, overrides, auto-fit, ``max_tp_shards``, EAGLE drafter layers,
attention-free models and a layer reported differently by two workers. Every observable is compared: the global groups,
each worker's projected groups, bytes per block, block count (the smallest worker's for all),
KV cache tensors (sizes, layers, strides and offsets, re-planned at the common block count) and
``kv_tp_replicas``, ``max_model_len`` after auto-fit, the scheduler's
groups, block sizes, alignment and capacity; or the verdict (which rule refuses, with vLLM's
estimated maximum length). Run inside ``conform-planning``.
"""

from __future__ import annotations

from typing import Any, Callable

from kvref.models.strategies.planning_parallel import SHAPES, ParallelPlanCase, parallel_plan_cases

#: the shapes a run must have planned at least once (a fast run meets each; see :func:`parallel_plan_families`)
PATHS = ("pp_ok", "pp_shrink", "tp_replicated", "free", "mismatch", "pp_refused", "eagle")


def agree_parallel(planner: Any, case: ParallelPlanCase, seen: set[str] | None = None) -> None:
    """vLLM's and kvref's multi-worker plans for ``case`` are the same (AssertionError naming the field)."""
    from kvref.impl.vllm.planning_parallel import kvref_workers_outcome, plan_workers

    theirs = plan_workers(planner, case.workers, case.config, case.available_memory, case.extra_retained_tokens,
                          case.kv_cache_layout, case.tensor_parallel_size, case.max_tp_shards, case.draft_layers)
    ours = kvref_workers_outcome(planner, case.workers, case.config, case.available_memory, case.kv_cache_layout,
                                 case.tensor_parallel_size, case.max_tp_shards, case.draft_layers)
    assert ours.key() == theirs.key(), f"accept/reject: kvref {ours.key()} vs vLLM {theirs.key()}\n{case}"
    assert set(ours.fields) == set(theirs.fields), (sorted(ours.fields), sorted(theirs.fields), case)
    for name, want in theirs.fields.items():
        if name == "kv_cache_tensors":  # per worker, by tensor index and field (#22)
            from kvref.impl.vllm.planning import tensor_divergence

            assert len(ours.fields[name]) == len(want), (name, case)
            for worker, (got, expected) in enumerate(zip(ours.fields[name], want)):
                diff = tensor_divergence(got, expected)
                assert diff is None, f"worker {worker}: {diff}\n{case}"
        assert ours.fields[name] == want, f"{name}: kvref {ours.fields[name]!r} != vLLM {want!r}\n{case}"
    if case.shape == "free":  # vLLM's public per-layer check has nothing to check either
        from kvref.impl.vllm.planning import kvref_per_layer_outcome

        theirs_check = planner.check_per_layer({}, case.config, case.available_memory[0], case.kv_cache_layout)
        ours_check = kvref_per_layer_outcome({}, case.config, case.available_memory[0], case.kv_cache_layout)
        assert ours_check.key() == theirs_check.key(), f"per-layer check: kvref {ours_check.key()} vs vLLM " \
                                                       f"{theirs_check.key()}\n{case}"
    if seen is not None:
        seen.update(_paths(case, theirs))


def _paths(case: ParallelPlanCase, outcome: Any) -> set[str]:
    if case.shape in ("free", "mismatch"):
        return {case.shape} if outcome.status in ("ok", "invalid") else set()
    if outcome.status != "ok":
        return {"pp_refused"} if len(case.workers) > 1 and outcome.status == "insufficient" else set()
    out = set()
    stages = {tuple(w) for w in case.workers}
    if len(stages) > 1:
        out.add("pp_ok")
        if len({b for b in outcome.fields["tensor_bytes"] for b in b}) > 1 or any(
                not g for w in outcome.fields["worker_groups"] for g, _, _ in w):
            out.add("pp_shrink")
    if any(r > 1 for r in outcome.fields["kv_tp_replicas"]):
        out.add("tp_replicated")
    if any(eagle for _, _, eagle in outcome.fields["global_groups"]):
        out.add("eagle")
    return out


def parallel_plan_families(examples: Callable[[int, int], int]) -> list[tuple[Any, int]]:
    """(strategy, examples) pairs: a mixed run, then each shape alone (a short run meets each)."""
    return ([(parallel_plan_cases(), examples(30, 200))]
            + [(parallel_plan_cases(shape), examples(12 if shape == "tp" else 8, 30)) for shape in dict.fromkeys(SHAPES)]
            # stages that split a uniform-type or packed group (the projection keeps a part of its specs)
            + [(parallel_plan_cases("pp", family), examples(6, 20)) for family in ("uniform_type", "packed")])
