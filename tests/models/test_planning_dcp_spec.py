"""resolve_dcp_kv_cache_spec: a group's block scaled to the tokens it spans under DCP (#22)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from kvref.spec.block_sizes import resolve_dcp_kv_cache_spec
from kvref.spec.errors import InvalidFieldError
from kvref.spec.kv_cache_interface import MambaSpec, MLAAttentionSpec, UniformTypeKVCacheSpecs
from tests.vllm_env import require_vllm


def test_sharded_specs_scale_with_every_layer_and_replicated_ones_do_not():
    a = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype="uint8")
    b = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=128, dtype="uint8")
    uniform = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": a, "b": b})
    scaled = resolve_dcp_kv_cache_spec(uniform, 4)
    assert scaled.block_size == 64 and {s.block_size for s in scaled.kv_cache_specs.values()} == {64}
    assert resolve_dcp_kv_cache_spec(a, 1) is a
    mamba = MambaSpec(block_size=16, shapes=((4,),), dtypes=("float16",))
    assert resolve_dcp_kv_cache_spec(mamba, 4) is mamba  # replicated state: one block per rank
    with pytest.raises(InvalidFieldError) as err:
        resolve_dcp_kv_cache_spec(a, 0)
    assert err.value.field == "dcp_world_size"


def _run(examples: int) -> int:
    """conform-planning's comparison (every planned field, the DCP views included) on generated layer sets,
    all under DCP > 1 (conform-planning draws DCP 2 or 4 in one case in five)."""
    from kvref.impl.vllm.planning import VllmPlanner, kvref_outcome
    from kvref.models.strategies.planning import plan_cases

    planner = VllmPlanner()
    scaled = [0]

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate])
    @given(case=plan_cases("random"), dcp=st.sampled_from([2, 4]))
    def run(case, dcp):
        case = dataclasses.replace(case, config=dataclasses.replace(case.config, dcp_world_size=dcp))
        theirs = planner.plan(case.layers, case.config, case.available_memory, case.extra_retained_tokens,
                              case.kv_cache_layout)
        ours = kvref_outcome(planner, case.layers, case.config, case.available_memory, case.kv_cache_layout)
        assert ours.key() == theirs.key()
        for name, want in theirs.fields.items():
            assert ours.fields[name] == want, f"{name}: kvref {ours.fields[name]!r} != vLLM {want!r}"
        if theirs.status != "ok":
            return
        views = theirs.fields["dcp_specs"]
        scaled[0] += any(v is not None and isinstance(v, planner.kci.UniformTypeKVCacheSpecs)
                         and v.block_size != g.block_size for v, (_, g) in zip(views, theirs.fields["groups"]))

    run()
    return scaled[0]


@pytest.mark.vllm
def test_generated_plans_scale_uniform_type_groups_under_dcp():
    require_vllm()
    assert _run(60) >= 1  # a uniform-type group (mixed MLA heads) scaled under DCP > 1


@pytest.mark.vllm
def test_a_planted_fault_in_vllms_dcp_spec_is_caught(monkeypatch):
    require_vllm()
    from vllm.v1.core import kv_cache_utils

    old = "                name: resolve_dcp_kv_cache_spec(layer_spec, dcp_world_size)\n"
    src = inspect.getsource(kv_cache_utils.resolve_dcp_kv_cache_spec)
    assert src.count(old) == 1
    namespace = dict(vars(kv_cache_utils))
    exec(compile(src.replace(old, "                name: layer_spec\n"), kv_cache_utils.__file__, "exec"), namespace)
    monkeypatch.setattr(kv_cache_utils, "resolve_dcp_kv_cache_spec", namespace["resolve_dcp_kv_cache_spec"])
    with pytest.raises(AssertionError, match="dcp_specs"):
        _run(60)
