"""Issue #23: Mamba "align" boundary-state hand-offs against vLLM 0.33.0.

vLLM's scheduler drains ``KVCacheManager.take_boundary_state_offloads()`` every step (the
committed boundary snapshots of Mamba "align" groups and the copy-on-write target of a sub-block
partial hit, by block id) and asks ``finalize_partial_tail_offloads(request)`` before freeing a
finishing KV producer. The reference models both; the conformance harness drains them after every
step and at every finish on both and compares them (``models/conformance/differential.py``).
"""

from __future__ import annotations

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from kvref.impl.reference.kv_cache_manager import KVCacheManager
from kvref.models.conformance.differential import Divergence
from kvref.models.machines.kv_cache_manager import kv_cache_manager_machine
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

MAMBA_ALIGN = ("fa+mamba_align", "fa+mamba_fine")


@pytest.fixture(scope="module")
def vllm_loaded():
    require_vllm()


def _machine():
    return kv_cache_manager_machine(("reference", "vllm"), group_sets=MAMBA_ALIGN)


def test_hand_offs_match_vllm(vllm_loaded):
    """Generated FA + Mamba "align" traces (whole-block and fine-grained hashing): the hand-offs
    drained after every step and the partial tails at every finish equal vLLM's; derandomized, so
    hand-offs are always reached."""
    machine = _machine()
    run_state_machine_as_test(machine, settings=settings(
        max_examples=profile_examples(30, 120), stateful_step_count=40, deadline=None, derandomize=True,
        database=None))
    assert machine.stats.boundary_state_offloads > 0


def test_dropped_hand_offs_are_caught(vllm_loaded, monkeypatch):
    """A reference that never hands a boundary state over diverges from vLLM."""
    monkeypatch.setattr(KVCacheManager, "take_boundary_state_offloads", lambda self: {})
    with pytest.raises(Divergence, match="take_boundary_state_offloads"):
        run_state_machine_as_test(_machine(), settings=settings(
            max_examples=profile_examples(30, 120), stateful_step_count=40, deadline=None, derandomize=True,
            database=None, phases=(Phase.generate,)))
