"""HiSparse startup sizing: kvref.spec.planning_hisparse vs vLLM 0.33.0's engine path (#22/#23)."""

from __future__ import annotations

import importlib
import inspect
import math
from collections import Counter

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from kvref.spec import InsufficientKVCacheError
from kvref.spec.errors import InvalidFieldError
from kvref.spec.planning_hisparse import (hisparse_max_concurrency, hisparse_steady_state_concurrency,
                                          plan_hisparse_kv_cache)
from tests.vllm_env import require_vllm

_SOURCE = [("l0", 1024, True), ("l1", 1024, False), ("l2", 1024, True)]
_INDEXER = [("i0", 2048), ("i1", 2048)]


def _plan(**kw):
    args = dict(source=_SOURCE, indexer=_INDEXER, block_size=16, top_k=64, device_buffer_size=None,
                host_budget=1 << 22, max_model_len=1024, available_memory=1 << 20, max_in_flight_tokens=2048)
    args.update(kw)
    return plan_hisparse_kv_cache(**args)


def test_steady_state_charges_running_requests_only_their_active_tail():
    # 100 blocks, a request admits with 30 and runs on 12: one admitted + 70 / 12 more
    assert hisparse_steady_state_concurrency(100, 30, 12, 10_000, 1) == 1 + 70 / 12
    assert hisparse_steady_state_concurrency(20, 30, 12, 10_000, 1) == 20 / 30  # below one window
    assert hisparse_steady_state_concurrency(100, 30, 12, 50, 10) == 5.0  # the host pool binds
    assert hisparse_max_concurrency(100, 30, 50, 10) == 100 / 30
    with pytest.raises(InvalidFieldError) as err:
        hisparse_steady_state_concurrency(100, 30, 31, 50, 10)
    assert err.value.field == "steady_blocks"


def test_a_plan_sizes_both_pools_and_lays_out_every_tensor():
    plan = _plan()
    plan.check_invariants()
    # the indexer group (2 x 2048) is the widest device group; hot pages (1024) divide it
    assert plan.bytes_per_block == 4096 and plan.num_blocks == (1 << 20) // 4096
    assert plan.host_block_stride == 3 * 1024 and plan.host_num_blocks == (1 << 22) // 3072
    # both index groups (2048 + 1024 bytes) fit the indexer's 4096-byte page: one hot group
    assert [g[0] for g in plan.device_groups] == ["indexer", "resident", "hot"]
    # host tensors: one per distinct spec (leaders l0 and l2 share one), layer-outermost
    host = [t for t in plan.tensors if t.host_resident]
    assert [t.layers for t in host] == [("l0", "l2"), ("l1",)]
    assert host[1].offset == 2 * 1024 * plan.host_num_blocks
    assert plan.blocks_per_request == (64, 64, 8)  # 1024 tokens / 16; top-k 64 x 2 rows / 16
    assert plan.steady_blocks_per_request == (64, 2, 8)
    assert plan.steady_state_concurrency > plan.max_concurrency


def test_rejections_name_their_rule():
    with pytest.raises(InvalidFieldError) as err:
        _plan(host_budget=None)
    assert err.value.field == "host_pool_gib"
    with pytest.raises(InvalidFieldError) as err:
        _plan(kv_cache_layout="LBNHC")
    assert err.value.field == "kv_cache_layout"
    with pytest.raises(InvalidFieldError) as err:
        _plan(host_budget=3072 * 65)  # 64 pages + null + tail = 66 blocks needed
    assert err.value.field == "host_budget"
    with pytest.raises(InsufficientKVCacheError) as err:
        _plan(available_memory=4096 * 100)
    assert err.value.reason == InsufficientKVCacheError.TOO_LONG and 0 < err.value.estimated_max_model_len < 1024
    # auto-fit stops where the host pool stops, not only where the GPU pool does
    assert _plan(host_budget=3072 * 34, auto_fit=True).max_model_len == 32 * 16


def _run(shrink: bool = True) -> Counter:
    """conform-planning's HiSparse sizing families at the fast-profile budget, derandomized."""
    from kvref.impl.vllm.planning import VllmPlanner
    from kvref.models.conformance.planning_hisparse import agree_hisparse_plan, hisparse_plan_families

    planner = VllmPlanner()
    seen: Counter = Counter()
    phases = list(Phase) if shrink else [Phase.explicit, Phase.generate]  # a planted fault: found, not shrunk

    def agree(case):
        out = agree_hisparse_plan(planner, case)
        seen[out.get("error", "ok")] += 1
        if "error" not in out:
            seen["two-host-tensors"] += sum(t[-1] for t in out["tensors"]) >= 2
            seen["steady-above-admission"] += out["steady_state_concurrency"] > out["max_concurrency"]

    for cases, n in hisparse_plan_families(lambda fast, ci: fast):
        settings(max_examples=n, derandomize=True, database=None, deadline=None, phases=phases)(
            given(case=cases)(agree))()
    return seen


@pytest.mark.vllm
def test_generated_cases_reach_every_sizing_path():
    require_vllm()
    seen = _run()
    assert {"ok", "too_long", "auto_fit_failed", "host_budget", "host_pool_gib", "kv_cache_layout"} <= set(seen), seen
    # several host tensors (offsets scale with the host pool) and a steady-state figure above admission's
    assert seen["ok"] >= 10 and seen["two-host-tensors"] >= 1 and seen["steady-above-admission"] >= 1, seen


def _planted(monkeypatch, module: str, name: str, old: str, new: str) -> None:
    """Replace ``old`` by ``new`` in vLLM's function ``module.name`` (a planted fault, this test only)."""
    mod = importlib.import_module(module)
    src = inspect.getsource(getattr(mod, name))
    assert src.count(old) == 1, old
    namespace = dict(vars(mod))
    exec(compile(src.replace(old, new), mod.__file__, "exec"), namespace)
    monkeypatch.setattr(mod, name, namespace[name])


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in _leaves(e)]
    return [exc]


def _assert_caught() -> None:
    """A generated run finds a HiSparse plan difference (alone, or among several distinct ones)."""
    with pytest.raises((AssertionError, BaseExceptionGroup)) as err:
        _run(shrink=False)
    assert any(isinstance(e, AssertionError) and "HiSparse plan" in str(e) for e in _leaves(err.value)), err.value


_LAYOUT = "vllm.v1.hisparse.layout"
_PLANNING = "vllm.v1.core.kv_cache_planning"


@pytest.mark.vllm
@pytest.mark.parametrize("module,name,old,new", [
    (_LAYOUT, "get_hisparse_steady_state_concurrency", "min(required, ACTIVE_TAIL_PAGES)",
     "min(required, ACTIVE_TAIL_PAGES + 1)"),
    ("vllm.v1.core.kv_cache_utils", "get_max_concurrency_for_kv_cache_config", "        limits.append(",
     "        (lambda limit: None)("),
    (_LAYOUT, "_build_hisparse_kv_cache_tensors", "            offset = (\n                byte_offset\n",
     "            offset = (\n                0\n"),
    (_PLANNING, "_get_kv_cache_bytes_per_block", "        if isinstance(group.kv_cache_spec, HiSparseHotSpec)",
     "        if False"),
])
def test_a_planted_fault_in_vllms_sizing_is_caught(monkeypatch, module, name, old, new):
    require_vllm()
    _planted(monkeypatch, module, name, old, new)
    _assert_caught()


def _auto_fit_case(host_budget, layout):
    from kvref.models.conformance.planning_hisparse import HiSparsePlanCase
    from kvref.spec import EngineConfig

    return HiSparsePlanCase(source=(("a", 64, True),), indexer=(("i", 128),), top_k=64, device_buffer_size=None,
                            host_budget=host_budget, config=EngineConfig(block_size=16, max_model_len="auto",
                                                                         derived_max_model_len=1024),
                            available_memory=1 << 22, kv_cache_layout=layout)


@pytest.mark.vllm
@pytest.mark.parametrize("host_budget,layout", [(None, "BLNHC"), (1024 * 20, "BLNHC"), (1 << 22, "LBNHC")])
def test_auto_fit_stops_where_the_host_pool_or_the_layout_does(monkeypatch, host_budget, layout):
    """vLLM's HiSparse ``fits`` builds the config at each length: a length the host pool (or a missing
    connector, or the layout) cannot take does not fit. Planted away (a failed build counted as a fit),
    auto-fit keeps a length the host cannot hold and the comparison fails."""
    require_vllm()
    from kvref.impl.vllm.planning import VllmPlanner
    from kvref.models.conformance.planning_hisparse import agree_hisparse_plan

    planner = VllmPlanner()
    case = _auto_fit_case(host_budget, layout)
    pristine = agree_hisparse_plan(planner, case)
    assert pristine.get("error", "ok") in ("ok", "auto_fit_failed"), pristine
    if host_budget == 1024 * 20:
        assert pristine["max_model_len"] == 18 * 16  # 20 host blocks: 18 pages + null + tail
    _planted(monkeypatch, _PLANNING, "_estimate_max_model_len_from_groups",
             "            except ValueError:\n                return False", "            except ValueError:\n                pass")
    with pytest.raises(AssertionError, match="HiSparse plan"):
        agree_hisparse_plan(planner, case)


@pytest.mark.vllm
def test_a_planted_fault_in_the_rule_is_caught(monkeypatch):
    require_vllm()
    from kvref.spec import planning_hisparse

    monkeypatch.setattr(planning_hisparse, "ACTIVE_TAIL_PAGES", 1)
    _assert_caught()


@settings(max_examples=200, derandomize=True, database=None, deadline=None)
@given(nb=st.integers(0, 500), a=st.integers(1, 60), s=st.integers(1, 60), host=st.integers(0, 500),
       h=st.integers(1, 60))
def test_t10s_encoding_is_the_spec_function(nb, a, s, host, h):
    """T10 (kvref.proofs) reasons about the spec's steady-state figure: the fraction it encodes, capped by
    the host pool, is exactly what hisparse_steady_state_concurrency computes."""
    from kvref.proofs.formulas import REFERENCE
    from kvref.proofs.ops import PyOps

    s = min(s, a)
    num, den = REFERENCE.hisparse_steady_gpu(PyOps, nb, a, s)
    # the same rational; the spec's float (1 + (nb - A) / S) may differ from num / den in the last bit
    assert math.isclose(min(num / den, host / h), hisparse_steady_state_concurrency(nb, a, s, host, h), rel_tol=1e-12)
