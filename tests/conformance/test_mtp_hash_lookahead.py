"""Issue #23: multi-module MTP with lookahead block hashes vs vLLM 0.33.0 on generated pools. vLLM's
``num_hash_lookahead_tokens`` is its ``num_prefill_lookahead_tokens`` (the number of speculative
tokens under multi-module MTP), so every block's hash also covers the next n >= 2 tokens and a hit
needs them known. The KV-manager machine draws n with the prefill lookahead on EAGLE pools and
compares hashes, KV events, hits, block ids and the free queue with vLLM's ``KVCacheManager`` after
every op (pools of one sliding-window group keep a lookahead of 1: vLLM's IndexError there,
docs/coverage.md)."""

from __future__ import annotations

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from kvref.models.conformance.differential import Divergence
from kvref.models.machines.kv_cache_manager import kv_cache_manager_machine
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

GROUP_SETS = ("fa", "fa+swa", "fa+fa", "swa", "fa+chunked")


def _machine():
    require_vllm()
    return kv_cache_manager_machine(("reference", "vllm"), group_sets=GROUP_SETS, eagle="always",
                                    prefill_lookahead=True, hash_lookahead_always=True)


def test_generated_pools_reach_multi_token_hash_lookahead_with_hits():
    """A fixed-seed run (the same under every profile): pools hashing a lookahead of 2 or more
    tokens are drawn, and requests hit their blocks, everything compared with vLLM after every op."""
    machine = _machine()
    run_state_machine_as_test(machine, settings=settings(max_examples=12, stateful_step_count=30, deadline=None,
                                                         derandomize=True, database=None))
    pools = machine.stats.hash_lookahead_pools
    assert sum(c for n, c in pools.items() if n >= 2) > 0, pools
    assert machine.stats.hash_lookahead_hits > 0, (pools, machine.stats.prefix_hits)


def test_a_pool_of_one_sliding_window_group_keeps_a_lookahead_of_one():
    """vLLM's lookup on such a pool raises IndexError under a lookahead of 2 or more
    (docs/coverage.md): the machine keeps those pools at 1 and still runs them against vLLM."""
    require_vllm()
    machine = kv_cache_manager_machine(("reference", "vllm"), group_sets=("swa",), eagle="always",
                                       prefill_lookahead=True, hash_lookahead_always=True)
    run_state_machine_as_test(machine, settings=settings(max_examples=8, stateful_step_count=30, deadline=None,
                                                         derandomize=True, database=None))
    pools = machine.stats.hash_lookahead_pools
    assert pools.get(1, 0) > 0 and not any(n >= 2 for n in pools), pools
    assert set(machine.stats.prefill_lookahead_pools) <= {0, 1}, machine.stats.prefill_lookahead_pools


def test_a_reference_hashing_one_lookahead_token_is_caught(monkeypatch):
    """A reference whose hashes cover only the first lookahead token (EAGLE's setting) diverges from
    vLLM on the same generated run."""
    from kvref.impl.reference import block_hash

    original = block_hash.RequestBlockHasher.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.num_hash_lookahead_tokens = min(self.num_hash_lookahead_tokens, 1)

    monkeypatch.setattr(block_hash.RequestBlockHasher, "__init__", init)
    machine = _machine()
    with pytest.raises(Divergence):  # found, not shrunk
        run_state_machine_as_test(machine, settings=settings(
            max_examples=12, stateful_step_count=30, deadline=None, derandomize=True, database=None,
            report_multiple_bugs=False, phases=(Phase.explicit, Phase.generate)))
