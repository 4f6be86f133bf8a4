"""HiSparse startup layout: the spec's rules vs vLLM 0.33.0's v1/hisparse/layout.py (#22/#23)."""

from __future__ import annotations

import inspect
from collections import Counter

import pytest
from hypothesis import given, settings

from kvref.spec.errors import InvalidFieldError
from kvref.spec.hisparse_layout import hisparse_host_num_blocks, hot_group_layers, lay_out_hisparse_groups
from tests.vllm_env import require_vllm


def test_packing_keeps_index_groups_whole_and_within_the_indexer_page():
    layers = [("a", 8, True), ("b", 8, False), ("c", 8, True), ("d", 8, True)]
    assert hot_group_layers(layers, 16) == [["a", "b"], ["c", "d"]]
    assert hot_group_layers(layers, 15) == [["a", "b"], ["c"], ["d"]]  # one index group alone may exceed it


def test_mixed_pages_in_one_hot_group_and_a_short_host_pool_are_rejected_by_field():
    with pytest.raises(InvalidFieldError) as err:
        lay_out_hisparse_groups([("a", 8, True), ("b", 4, True)], 16, 2, 1)
    assert err.value.field == "source_layers"
    assert hisparse_host_num_blocks(16 * 10, 16, False, 16, 2) == (10, 16)  # 8 pages + null + tail
    with pytest.raises(InvalidFieldError) as err:
        hisparse_host_num_blocks(16 * 9, 16, False, 16, 2)
    assert err.value.field == "host_budget"


def _run(examples: int) -> Counter:
    from kvref.models.conformance.hisparse_layout import agree_layout, layout_cases, rejection_field

    seen: Counter = Counter()

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None)
    @given(case=layout_cases())
    def run(case):
        out = agree_layout(case)
        seen[rejection_field(out["error"]) if "error" in out else f"ok:{out['device_groups']}"] += 1

    run()
    return seen


@pytest.mark.vllm
def test_generated_cases_reach_every_layout_path():
    require_vllm()
    seen = _run(40)  # the fast-profile budget conform-planning gives this family
    assert {"indexer_page", "device_buffer_size", "source_layers", "host_budget", "ok:3"} <= set(seen), seen
    assert any(k.startswith("ok:") and int(k[3:]) >= 5 for k in seen), seen  # >= 2 hot groups laid out


def _planted(monkeypatch, name: str, old: str, new: str) -> None:
    """Replace ``old`` by ``new`` in vLLM's layout function ``name`` (a planted fault, this test only)."""
    from vllm.v1.hisparse import layout

    src = inspect.getsource(getattr(layout, name))
    assert src.count(old) == 1, old
    namespace = dict(vars(layout))
    exec(compile(src.replace(old, new), layout.__file__, "exec"), namespace)
    monkeypatch.setattr(layout, name, namespace[name])


@pytest.mark.vllm
@pytest.mark.parametrize("name,old,new", [
    ("_lay_out_hisparse_groups", "current_page + unit_page > indexer_page", "current_page + unit_page >= indexer_page"),
    ("_lay_out_hisparse_groups", "if layer_spec.is_index_group_leader or not hot_units:", "if not hot_units:"),
    ("create_hisparse_layout", "gpu_block_size) + 2", "gpu_block_size) + 1"),
])
def test_a_planted_fault_in_vllms_layout_is_caught(monkeypatch, name, old, new):
    require_vllm()
    _planted(monkeypatch, name, old, new)
    with pytest.raises(AssertionError, match="HiSparse layout"):
        _run(200)


@pytest.mark.vllm
def test_a_planted_fault_in_the_rule_is_caught(monkeypatch):
    require_vllm()
    from kvref.spec import hisparse_layout

    real = hisparse_layout.hot_group_layers
    monkeypatch.setattr(hisparse_layout, "hot_group_layers", lambda layers, page: real(layers, page - 1))  # ">=" for ">"
    with pytest.raises(AssertionError, match="HiSparse layout"):
        _run(200)


def test_first_group_rules_in_vllms_order():
    from kvref.spec.hisparse_layout import check_hisparse_first_group

    assert check_hisparse_first_group([16, 16], [None, None], []) == 16
    for args, field in [(([16, 32], ["deepseek_v4"], ["x"]), "block_size"),  # the uniform-type group comes first
                        (([16, 16], [None, "deepseek_v4"], ["x"]), "model_version"),
                        (([16], [None], ["model.layers.9.attn"]), "layers")]:
        with pytest.raises(InvalidFieldError) as err:
            check_hisparse_first_group(*args)
        assert err.value.field == field


@pytest.mark.vllm
def test_flawed_first_groups_are_refused_by_the_same_rule():
    """Two block sizes, a DeepSeek-V4 MLA layer or a full-attention layer in the first group: vLLM's
    partition refuses each, and kvref names the same rule (derandomized, conform-planning's budget)."""
    require_vllm()
    from kvref.models.conformance.hisparse_layout import agree_layout, flawed_layout_cases, rejection_field

    seen: Counter = Counter()

    @settings(max_examples=10, derandomize=True, database=None, deadline=None)
    @given(case=flawed_layout_cases())
    def run(case):
        out = agree_layout(case)
        seen[rejection_field(out["error"]) if "error" in out else "ok"] += 1

    run()
    assert set(seen) == {"block_size", "model_version", "layers"}, seen
