"""Exhaustive conformance: every transition of a scope's state graph, replayed on vLLM 0.33.0 and
on the torch KV cache manager in lock step with the reference."""

from __future__ import annotations

import pytest

from kvref.models.explorer.conformance import explore_conformance
from kvref.models.explorer.kv import SCOPES
from kvref.models.mutants.catalogue import CATALOGUE
from kvref.spec.errors import InvalidFieldError
from tests.vllm_env import require_vllm


@pytest.mark.parametrize("name", ["whole-prompts", "swa", "chunked", "small", "default"])
def test_torch_agrees_with_the_reference_on_every_transition(name):
    res = explore_conformance(name, targets=("torch",))
    assert res.ok, res.summary()
    assert res.complete and res.states == explore_states(name)
    # every edge is on some replayed path: the calls cover at least every transition
    assert res.calls >= res.transitions and res.coverage.get("complete", 0) > 0


def explore_states(name: str) -> int:
    from kvref.models.explorer.kv import explore_scope

    return explore_scope(name).states


@pytest.mark.vllm
@pytest.mark.parametrize("name", ["tight", "small", "swa", "chunked", "whole-prompts", "twins", "default", "full"])
def test_vllm_agrees_with_the_reference_on_every_transition(name):
    require_vllm()
    res = explore_conformance(name, targets=("vllm",))
    assert res.ok, res.summary()
    assert res.complete and res.calls >= res.transitions


def test_a_fault_in_the_reference_shows_as_a_divergence_with_its_path():
    """Not vacuous: a reference manager that frees a request head first disagrees with torch,
    and the report names the shortest path the replays met it on."""
    with CATALOGUE["manager.free_head_first"].applied():
        res = explore_conformance("small", targets=("torch",))
    assert not res.ok
    path, message = res.divergence
    assert "free_block_queue" in message and "reference vs torch" in message
    assert path and path[0][0] == "arrive"
    assert "DIVERGENCE" in res.summary()


@pytest.mark.vllm
def test_a_scheduler_fault_diverges_from_vllm():
    """A scheduler mutant runs in every reference-scheduler target, so only vLLM's own scheduler
    can tell: it must."""
    require_vllm()
    with CATALOGUE["sched.budget_off_by_one"].applied():
        res = explore_conformance("small", targets=("vllm",))
    assert not res.ok and "vllm" in res.divergence[1]


def test_bad_arguments_are_rejected_with_the_field_named():
    with pytest.raises(InvalidFieldError, match="targets"):
        explore_conformance("small", targets=("tpu",))
    with pytest.raises(InvalidFieldError, match="targets"):
        explore_conformance("small", targets=())
    with pytest.raises(InvalidFieldError, match="scope"):
        explore_conformance("nope")
    with pytest.raises(InvalidFieldError, match="scope"):
        explore_conformance(3)


def test_max_states_stops_early_and_says_so():
    res = explore_conformance(SCOPES["default"], targets=("torch",), max_states=50)
    assert res.ok and not res.complete and res.states == 50 and "stopped early" in res.summary()
