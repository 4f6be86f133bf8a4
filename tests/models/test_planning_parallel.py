"""kvref.spec.planning_parallel: vLLM's startup sizing over several workers (pipeline + tensor
parallel, #22), without vLLM: one worker is the single-worker plan, the smallest worker decides,
projections keep every group, TP replicas, refusals, and T11's encoding is the spec's rule."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvref.models.strategies.planning import plan_cases
from kvref.proofs.ops import PyOps
from kvref.proofs.theorems import _PP_WORKERS, T11
from kvref.proofs.formulas import REFERENCE
from kvref.spec import (
    AUTO,
    EngineConfig,
    FullAttentionSpec,
    InsufficientKVCacheError,
    InvalidFieldError,
    KVRefError,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    plan_kv_cache,
)
from kvref.spec.planning_parallel import (
    kv_cache_groups_tp_replicas,
    merge_worker_kv_cache_specs,
    plan_kv_cache_workers,
    project_kv_cache_groups_to_worker,
)
from kvref.spec.pool_sizing import group_blocks_per_request
from tests.conftest import profile_examples

FA = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float16")  # 8 KiB page
SWA = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype="float16", sliding_window=64)
MLA = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype="float16")
CFG = EngineConfig(max_model_len=256, max_num_batched_tokens=64)


def _stages(*counts: int, spec=FA) -> list[dict]:
    """Contiguous stages of ``counts`` layers each."""
    out, i = [], 0
    for n in counts:
        out.append({f"l{i + j}": spec for j in range(n)})
        i += n
    return out


@settings(max_examples=profile_examples(40, 150), deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(case=plan_cases())
def test_one_worker_is_the_single_worker_plan(case):
    """``plan_kv_cache_workers([layers])`` accepts and refuses exactly what ``plan_kv_cache`` does,
    with the same block count, length, groups and scheduler figures."""
    def attempt(fn, *args, **kw):
        try:
            return fn(*args, **kw), None
        except KVRefError as exc:
            return None, (type(exc).__name__, getattr(exc, "reason", None), getattr(exc, "estimated_max_model_len", None))

    single, refused = attempt(plan_kv_cache, case.layers, case.config, case.available_memory,
                              kv_cache_layout=case.kv_cache_layout)
    multi, refused_multi = attempt(plan_kv_cache_workers, [case.layers], case.config, [case.available_memory],
                                   kv_cache_layout=case.kv_cache_layout)
    assert refused == refused_multi
    if single is None:
        return
    multi.check_invariants()
    [worker] = multi.workers
    assert (multi.num_blocks, multi.max_model_len) == (single.num_blocks, single.max_model_len)
    assert worker.groups == multi.global_groups == single.groups
    assert worker.bytes_per_block == single.bytes_per_block and worker.tensor_bytes == single.num_blocks * single.bytes_per_block
    assert multi.scheduler_groups == single.scheduler_groups
    assert (multi.scheduler_block_size, multi.hash_block_size, multi.max_concurrency) == (
        single.scheduler_block_size, single.hash_block_size, single.max_concurrency)
    assert worker.kv_tp_replicas == 1


def test_the_smallest_worker_sets_every_workers_block_count():
    # stage 0: 2 layers (16 KiB/block), stage 1: 3 layers (24 KiB/block); one request needs 16 blocks
    stages = _stages(2, 3)
    plan = plan_kv_cache_workers(stages, CFG, [100 * 16384, 40 * 24576])
    plan.check_invariants()
    assert [w.bytes_per_block for w in plan.workers] == [16384, 24576]
    assert [w.own_num_blocks for w in plan.workers] == [100, 40]
    assert plan.num_blocks == 40
    assert [w.tensor_bytes for w in plan.workers] == [40 * 16384, 40 * 24576]  # stage 0 shrunk, not its own 100
    summary = plan.to_dict()
    assert summary["num_blocks"] == 40 and [w["own_num_blocks"] for w in summary["workers"]] == [100, 40]
    # the same stage 1 with one block too few for a request is refused, although stage 0 has plenty
    with pytest.raises(InsufficientKVCacheError) as err:
        plan_kv_cache_workers(stages, CFG, [100 * 16384, 16 * 24576])
    assert err.value.reason == InsufficientKVCacheError.TOO_LONG and err.value.estimated_max_model_len == 15 * 16


def test_auto_fit_takes_the_tightest_stage():
    cfg = EngineConfig(max_model_len=AUTO, derived_max_model_len=4096, max_num_batched_tokens=64)
    plan = plan_kv_cache_workers(_stages(1, 1, 1), cfg, [65 * 8192, 11 * 8192, 33 * 8192])
    assert plan.auto_fitted and plan.max_model_len == 10 * 16  # stage 1: 11 blocks, one is the null block
    plan.check_invariants()


def test_override_sizes_every_worker_by_its_own_block():
    cfg = EngineConfig(max_model_len=256, max_num_batched_tokens=64, num_gpu_blocks_override=20)
    plan = plan_kv_cache_workers(_stages(1, 2), cfg, [0, 0])  # profiled memory is ignored
    assert [w.memory_bytes for w in plan.workers] == [20 * 8192, 20 * 16384] and plan.num_blocks == 20


def test_projection_keeps_every_group_and_a_uniform_type_part():
    stages = [{"a": FA, "b": SWA, "c": SWA}, {"d": FA}]  # stage 1 holds no sliding-window layer
    plan = plan_kv_cache_workers(stages, CFG, [1 << 24, 1 << 24])
    assert len(plan.global_groups) == 2
    assert [g.layer_names for g in plan.global_groups] == [("a", "d"), ("b", "c")]
    empty = [g for g in plan.workers[1].groups if not g.layer_names]
    assert len(empty) == 1 and isinstance(empty[0].kv_cache_spec, SlidingWindowSpec)
    # its blocks still count in stage 1's need (vLLM sums every projected group)
    need = sum(group_blocks_per_request(g.kv_cache_spec, CFG, 256) for g in plan.workers[1].groups)
    assert need == sum(group_blocks_per_request(g.kv_cache_spec, CFG, 256) for g in plan.global_groups)
    wide = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=64, dtype="float16")
    groups = plan_kv_cache_workers([{"x": FA}, {"y": wide}], CFG, [1 << 24] * 2).global_groups
    [group] = groups
    assert isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs)
    [part] = project_kv_cache_groups_to_worker(groups, {"y": wide})
    assert part.layer_names == ("y",) and set(part.kv_cache_spec.kv_cache_specs) == {"y"}


@pytest.mark.parametrize("tp,dcp,shards,spec,want", [
    (4, 1, 1, MLA, 4),  # MLA: one copy per rank group
    (4, 1, 2, FA, 2),
    (2, 1, 8, FA, 1),  # more shards than ranks: clamped to one replica
    (4, 2, 1, FA, 1),  # DCP-sharded under DCP > 1: never a replica
    (4, 1, None, FA, 1),  # unknown: not replicated
])
def test_tp_replicas(tp, dcp, shards, spec, want):
    layers = {"l0": spec, "l1": spec}
    cfg = EngineConfig(max_model_len=256, max_num_batched_tokens=64, dcp_world_size=dcp)
    plan = plan_kv_cache_workers([layers] * tp, cfg, [1 << 24] * tp, tensor_parallel_size=tp,
                                 max_tp_shards={} if shards is None else {n: shards for n in layers})
    assert [w.kv_tp_replicas for w in plan.workers] == [want] * tp


def test_tp_replicas_gcd_and_non_attention():
    mamba = MambaSpec(block_size=16, shapes=((2, 8),), dtypes=("float16",))
    groups = plan_kv_cache_workers([{"a": MLA, "m": mamba}], CFG, [1 << 24]).global_groups
    assert kv_cache_groups_tp_replicas(groups, 4, 1, {"a": 1}) == 1  # the Mamba state is sharded
    assert kv_cache_groups_tp_replicas((), 4) == 1
    # a projected group without layers here takes its global group's first layer's shards
    [group] = plan_kv_cache_workers([{"a": MLA}], CFG, [1 << 24]).global_groups
    [empty] = project_kv_cache_groups_to_worker([group], {})
    assert kv_cache_groups_tp_replicas([empty], 8, 1, {"a": 2}, global_groups=[group]) == 4
    with pytest.raises(InvalidFieldError):
        kv_cache_groups_tp_replicas([empty], 8, 1, {"a": 2}, global_groups=[group, group])


def test_attention_free_model_has_one_null_block():
    plan = plan_kv_cache_workers([{}, {}], CFG, [0, 123])
    assert plan.global_groups == () and plan.num_blocks == 1 and plan.max_concurrency is None
    assert [w.kv_tp_replicas for w in plan.workers] == [1, 1]
    plan.check_invariants()


@pytest.mark.parametrize("workers,memory,field", [
    ([{"l0": FA}, {"l0": SWA}], [1 << 20] * 2, "kv_cache_specs[1]['l0']"),  # one layer, two specs
    ([{"l0": FA}, {}], [1 << 20] * 2, "kv_cache_specs[1]"),  # a stage without layers
    ([], [], "kv_cache_specs"),
    ([{"l0": FA}], [1, 2], "available_memory"),
    ([{"l0": FA}], [-1], "available_memory[0]"),
    ([{"l0": "x"}], [1], "kv_cache_specs[0]"),
])
def test_bad_workers_are_refused_naming_the_field(workers, memory, field):
    with pytest.raises(InvalidFieldError) as err:
        plan_kv_cache_workers(workers, CFG, memory)
    assert err.value.field == field


def test_merge_keeps_first_occurrence_order():
    assert list(merge_worker_kv_cache_specs([{"b": FA}, {"a": FA, "b": FA}])) == ["b", "a"]


@settings(max_examples=profile_examples(60, 200), deadline=None, database=None, derandomize=True)
@given(bpb=st.lists(st.integers(1, 64), min_size=_PP_WORKERS, max_size=_PP_WORKERS),
       mem=st.lists(st.integers(0, 4096), min_size=_PP_WORKERS, max_size=_PP_WORKERS),
       need=st.integers(0, 40), override=st.one_of(st.none(), st.integers(1, 64)))
def test_t11s_encoding_is_the_spec_rule(bpb, mem, need, override):
    """T11 (kvref.proofs) reasons about plan_kv_cache_workers' rule: on workers of ``bpb_i`` bytes per
    block (i full-attention layers of a 1-byte-per-token page) the plan starts exactly when the
    encoded per-worker checks pass, and then gives the encoded common block count."""
    spec = FullAttentionSpec(block_size=1, num_kv_heads=1, head_size=1, dtype="int8", head_size_v=0)  # 1 B page
    stages, i = [], 0
    for b in bpb:
        stages.append({f"l{i + j}": spec for j in range(b)})
        i += b
    cfg = EngineConfig(max_model_len=max(need, 1), max_num_batched_tokens=64, num_gpu_blocks_override=override)
    values = {**{f"bpb{i}": b for i, b in enumerate(bpb)}, **{f"mem{i}": m for i, m in enumerate(mem)},
              **{f"S{i}": max(need, 1) for i in range(_PP_WORKERS)}, "override": override or 1,
              "override_set": override is not None}
    o = PyOps
    memory = [(override * b if override else m) for b, m in zip(bpb, mem)]
    checks = [REFERENCE.check_passes(o, max(need, 1) * b, m - b) for b, m in zip(bpb, memory)]
    encoded_ok = REFERENCE.pp_workers_checked(o, checks)
    try:
        plan = plan_kv_cache_workers(stages, cfg, mem)
    except InsufficientKVCacheError:
        assert not encoded_ok
        return
    assert encoded_ok
    assert plan.num_blocks == REFERENCE.pp_common_num_blocks(o, [m // b for b, m in zip(bpb, memory)])
    hyps_ok, goal_ok = T11.claim.evaluate(REFERENCE, values)
    assert hyps_ok and goal_ok


def test_eagle_groups_are_those_holding_a_draft_layer():
    stages = [{"a": FA, "b": SWA, "c": SWA}, {"d": FA}]
    plan = plan_kv_cache_workers(stages, CFG, [1 << 24] * 2, draft_layers=["d"])
    assert [(g.layer_names, g.is_eagle_group) for g in plan.global_groups] == [(("a", "d"), True), (("b", "c"), False)]
    # the flag travels with the projection (stage 0 holds none of the draft's layers) and to the scheduler
    assert [g.is_eagle_group for g in plan.workers[0].groups] == [True, False]
    assert [g.is_eagle_group for g in plan.scheduler_groups] == [True, False]
    assert not any(g.is_eagle_group for g in plan_kv_cache_workers(stages, CFG, [1 << 24] * 2).global_groups)
    with pytest.raises(InvalidFieldError):
        plan_kv_cache_workers(stages, CFG, [1 << 24] * 2, draft_layers="d")
