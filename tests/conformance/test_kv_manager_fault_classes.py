"""The KV-manager machine's generators reach the fault classes issue #13 found escaping.

Measured on vLLM source faults (docs/vllm_mutants.md), the conformance checks missed changes on
paths the generated traces rarely or never took: KV-connector loads (external computed tokens
after a prefix hit on a hybrid pool; asynchronous loads that hold blocks, ``delay_cache_blocks``),
admission at the pool's boundary (the reservation for in-flight prefills), spec-decode steps of
requests admitted with a hit on pools of three groups, several requests preempted in a row. Each
test runs the reference-vs-vLLM machine on a few traces and asserts, with a counter that can be
zero, that the path was taken *and* compared (a vacuous generator fails here).
"""

from __future__ import annotations

import pytest
from kvref.models.machines.kv_cache_manager import run_machine
from kvref.models.strategies.pools import HYBRID_GROUP_SETS
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_adapter():
    require_vllm()
    import kvref.impl.vllm.kv_cache_manager as adapter  # imports vLLM once per module

    return adapter


def _run(examples: int, counters: tuple[str, ...], **machine_kwargs):
    """Fixed seeds (the counters are a property of the generators on these traces, not of luck);
    a rare path gets up to three batches before it is called unreached (swarm testing leaves some
    batches without a rule the path needs)."""
    total: dict[str, int] = dict.fromkeys(counters, 0)
    for seed in (1, 2, 3):
        run = run_machine(("reference", "vllm"), examples, seed=seed, shrink=False, **machine_kwargs)
        assert run.ok, run.failure
        for c in counters:
            total[c] += getattr(run.stats, c)
        if all(total.values()):
            break
    return total


def test_connector_paths_are_reached_on_hybrid_pools(vllm_adapter):
    """Async loads start and complete, external tokens follow a hit on >= 2 groups, admissions are
    decided with at most one block to spare, several running requests are preempted newest first."""
    groups = tuple(g for g in HYBRID_GROUP_SETS if "mamba" not in g)  # FA+Mamba pools cache nothing: no hits
    st = _run(profile_examples(40, 80), ("async_loads", "loads_done", "external_hybrid", "boundary_admissions",
                                         "preemption_storms"), group_sets=groups)
    assert all(st.values()), st


def test_spec_decode_hits_on_three_group_pools(vllm_adapter):
    """EAGLE pools of three groups: prefix hits found by the hybrid coordinator with the last
    matched block dropped (vLLM's ``use_eagle``), compared block for block with the reference."""
    st = _run(profile_examples(40, 80), ("prefix_hits",), group_sets=("fa+swa+swa",), eagle="always")
    assert st["prefix_hits"] > 0, st


def test_pools_include_extra_retained_windows_and_near_full_sizes():
    """The pool strategy draws sliding windows with MTP's extra retained tokens, and pools sized
    right at one max-length request (where admission is decided by a block)."""
    from hypothesis import find, settings

    from kvref.models.strategies.pools import pool_configs
    from kvref.spec.kv_cache_interface import SlidingWindowSpec

    quick = settings(max_examples=500, database=None)
    find(pool_configs(group_sets=("fa+swa",)), lambda p: any(
        isinstance(g.kv_cache_spec, SlidingWindowSpec) and g.kv_cache_spec.extra_retained_tokens > 0
        for g in p.groups), settings=quick)
    find(pool_configs(group_sets=("fa",)), lambda p: p.num_blocks == -(-p.max_model_len // p.groups[0].kv_cache_spec.block_size),
         settings=quick)
