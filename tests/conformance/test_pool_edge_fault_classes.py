"""The vLLM-facing checks reach the pool's exact edge, where three escaped fault classes live.

Issue #13's campaign (docs/vllm_mutants.md) found faults that change nothing while the pool has
blocks to spare:

* a predictor that counts fewer blocks than the allocation then takes (PR 40027 / #45856: the
  admission cap also clamping a step's need): only an operation that needs exactly the free blocks,
  or one more, tells the two apart;
* one group's allocation taking another group's cache hits before they are touched (vLLM #33775:
  external-token blocks allocated group by group): only a hybrid pool whose free queue has a later
  group's hits right where the first group allocates;
* a sliding-window admission cap forgetting ``extra_retained_tokens`` (multi-module MTP): only a
  request that slides past them on the smallest pool startup accepts.

Each test plants the fault in the installed vLLM *test-locally* (monkeypatch, undone after the
test) and asserts the check flags it, on fixed seeds with Hypothesis' inputs independent of what
the process imported (``same_inputs_in_every_process``): if the generators stop reaching the edge,
these fail. The same runs pass on the unpatched vLLM (no false positive).
"""

from __future__ import annotations

import pytest
from kvref.models.hypothesis_runs.reproducible import same_inputs_in_every_process

from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_mods():
    require_vllm()
    from kvref.impl.vllm.loader import load_vllm

    load_vllm()  # imports vLLM once per module
    from vllm.v1 import kv_cache_interface
    from vllm.v1.core import kv_cache_coordinator, single_type_kv_cache_manager

    return kv_cache_coordinator, single_type_kv_cache_manager, kv_cache_interface


def _machine(group_sets: tuple[str, ...], examples: int, seeds: tuple[int, ...]):
    """(seed, failure) of the first seed whose reference-vs-vLLM run fails, else (None, None)."""
    from kvref.models.machines.kv_cache_manager import run_machine

    for seed in seeds:
        with same_inputs_in_every_process():
            run = run_machine(("reference", "vllm"), examples, seed=seed, shrink=False, group_sets=group_sets)
        if not run.ok:
            return seed, run.failure
    return None, None


def _clean_passes(group_sets: tuple[str, ...], examples: int, seed: int) -> None:
    seed_, failure = _machine(group_sets, examples, (seed,))
    assert seed_ is None, f"clean vLLM flagged (a false positive): {failure}"


# -- the planted faults (our own code standing in for the pre-fix logic; vLLM's methods untouched) --

def _pre33775(self, request_id, new_computed_blocks, num_local_computed_tokens, num_external_computed_tokens,
              skip_zeroing_group_ids=()):
    """Before #33775: each group touches its hits, then at once allocates its external blocks."""
    if any(request_id in m.num_cached_block for m in self.single_type_managers):
        return
    for i, m in enumerate(self.single_type_managers):
        m.add_local_computed_blocks(request_id, new_computed_blocks[i], num_local_computed_tokens,
                                    num_external_computed_tokens)
        if num_external_computed_tokens > 0:
            m.allocate_external_computed_blocks(request_id, num_local_computed_tokens, num_external_computed_tokens,
                                                record_for_zeroing=i not in skip_zeroing_group_ids)


HYBRID = ("fa+fa", "fa+swa", "fa+chunked", "fa+swa+swa")
WINDOWED = ("swa", "fa+swa", "fa+chunked", "fa+swa+swa")


def test_external_blocks_taking_a_later_groups_hits_is_flagged(vllm_mods, monkeypatch):
    """vLLM #33775 re-planted: the machine builds the setting (cached prefix on every group, the
    free queue drained up to it, a connector follow-up with a long external tail) and vLLM's own
    state shows a block in two groups' tables, or the block ids differ."""
    coordinator, _, _ = vllm_mods
    monkeypatch.setattr(coordinator.KVCacheCoordinator, "allocate_new_computed_blocks", _pre33775)
    seed, failure = _machine(HYBRID, 10, (0, 1, 2))
    assert seed is not None, "the pre-#33775 coordinator was not flagged: the full-pool follow-ups stopped reaching it"
    assert "admit" in failure
    monkeypatch.undo()
    _clean_passes(HYBRID, 10, seed)


def test_step_need_clamped_by_the_admission_cap_is_flagged(vllm_mods, monkeypatch):
    """PR 40027 / #45856 re-planted: every predictor call clamps by the admission cap, so an
    allocation takes more blocks than were checked. Admissions decided at the exact edge (the
    largest reservation that fits, or one more; fillers) make vLLM admit what the reference refuses,
    or raise 'Cannot get N free blocks'."""
    _, stm, _ = vllm_mods
    original = stm.SingleTypeKVCacheManager.get_num_blocks_to_allocate

    def capped_every_step(self, *args, **kwargs):
        kwargs["apply_admission_cap"] = True
        return original(self, *args, **kwargs)

    monkeypatch.setattr(stm.SingleTypeKVCacheManager, "get_num_blocks_to_allocate", capped_every_step)
    seed, _ = _machine(WINDOWED, 10, (0, 1, 2))
    assert seed is not None, "a step predictor clamped by the cap was not flagged: nothing reached the pool's edge"
    monkeypatch.undo()
    _clean_passes(WINDOWED, 10, seed)


def test_machine_reaches_the_edge_paths(vllm_mods):
    """The aimed paths run and are compared: edge reservations, filler-made full pools, #33775's
    setting (counters that can be zero)."""
    from kvref.models.machines.kv_cache_manager import run_machine

    with same_inputs_in_every_process():
        run = run_machine(("reference", "vllm"), 10, seed=0, shrink=False, group_sets=HYBRID)
    assert run.ok, run.failure
    st = run.stats
    assert st.edge_reservations > 0 and st.edge_fills > 0 and st.full_pool_follow_ups > 0, st
    assert st.rules.get("step", 0) > 0 and st.external_hybrid > 0, st.rules


def test_window_cap_forgetting_extra_retained_tokens_is_flagged_by_startup_liveness(vllm_mods, monkeypatch):
    """The sliding-window cap without ``extra_retained_tokens`` sizes startup's smallest pool (and
    the admission gate) a few blocks short; a max-length request with MTP's retained tokens then
    runs it dry. Startup-liveness draws such windows; the clean vLLM serves every case."""
    from kvref.models.conformance.startup_liveness import check_startup_liveness

    _, _, kci = vllm_mods
    assert check_startup_liveness("vllm", 60, seed=0)[1] == []

    def cap_without_extra(self, max_in_flight_tokens, max_model_len):
        tokens = min(self.sliding_window - 1 + max_in_flight_tokens, max_model_len)
        return -(-tokens // self.block_size) + 1

    monkeypatch.setattr(kci.SlidingWindowSpec, "max_admission_blocks_per_request", cap_without_extra)
    _, failures = check_startup_liveness("vllm", 60, seed=0)
    assert failures, "a window cap without extra_retained_tokens passed startup-liveness"
    assert any(f.case.extra_retained_tokens > 0 for f in failures)
