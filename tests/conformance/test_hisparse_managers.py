"""vLLM 0.33.0's HiSparse managers against the reference's (issue #23): generated programs on
HiSparse pools (host source, indexer, resident and hot groups) run on vLLM's own managers with its
``HiSparseCoordinator`` bound, compared after every operation (counts per group, new block ids,
tables and residency rows, both pools' free counts and queues, hot_required / has_hot)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings

from kvref.models.hypothesis_runs.reproducible import same_inputs_in_every_process
from kvref.models.machines.hisparse_pool import LENGTHS, PROGRAMS, hisparse_pool_configs, run_hisparse_program
from kvref.spec.hisparse import HiSparsePoolConfig
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm



def _vllm_pool():
    require_vllm()
    from kvref.impl.vllm.hisparse import VllmHiSparsePool

    return VllmHiSparsePool


def test_generated_programs_agree():
    make = _vllm_pool()

    @settings(max_examples=profile_examples(60, 300), deadline=None)
    @given(hisparse_pool_configs(), LENGTHS, PROGRAMS)
    def run(config, lengths, ops):
        run_hisparse_program(config, lengths, ops, make)

    run()


def test_generated_programs_reach_every_hisparse_path():
    """A fixed-seed run reaches host exhaustion (the source's admission sentinel), host-prefix
    hits, imports, hot regions, transitions, adopted and dropped resident pages and frees, and the
    coordinator's paths: write-backs planned, sent and completed, import restores, clean pages
    unpinned, completed and failed imports, residency updates, row mirrors and fully resident steps,
    whatever the profile. (A page lost to the pool's reuse is rarer: see the next test.)"""
    make = _vllm_pool()
    seen: Counter = Counter()

    @settings(max_examples=300, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(hisparse_pool_configs(), LENGTHS, PROGRAMS)
    def run(config, lengths, ops):
        seen.update(run_hisparse_program(config, lengths, ops, make))

    with same_inputs_in_every_process():
        run()
    for path in ("refused_host", "refused_gpu", "refused_gate", "admit", "grow", "host_hit", "import",
                 "hot_allocated", "transition", "adopt", "drop", "free",
                 # the coordinator's write-back and residency (#23)
                 "advance", "transfers_sent", "transfers_done", "restores_sent", "unpinned",
                 "import_done", "import_failed", "residency_updates", "mirrors", "all_resident",
                 # the coordinator's entry points probed after each program, planning write-backs (#22)
                 "probes", "probe_transfers",
                 # straggler worker reports: a transfer's later enqueue report, one after it completed
                 "straggler_report", "straggler_after_done"):
        assert seen[path] > 0, f"{path} never reached: {dict(seen)}"


def test_a_reused_unpinned_block_loses_the_page_on_both_sides():
    """A request with its hot region writes back eight pages; all but the active tail are unpinned
    (free, at the back of the queue, still read); a second request's allocation takes the free front
    and then the oldest unpinned block: both coordinators drop that page from the reader's row, mark
    it stale for the worker and ask for a hot region, with equal state after every op."""
    make = _vllm_pool()
    config = HiSparsePoolConfig(block_size=1, num_gpu_blocks=25, host_num_blocks=20, blocks_per_request=1,
                                num_resident_groups=1, max_model_len=16, max_in_flight_tokens=16)
    ops = [("require_hot", 0, 1, 0, 0, False), ("schedule", 0, 8, 0, 0, False), ("offload", 0, 1, 0, 0, False),
           ("complete", 0, 1, 0, 0, True), ("update", 1, 1, 0, 0, False), ("residency", 0, 1, 0, 0, False),
           ("schedule", 1, 4, 0, 0, False), ("residency", 0, 1, 0, 0, False), ("schedule", 0, 1, 0, 0, False)]
    seen = run_hisparse_program(config, [8, 4, 4], ops, make)
    assert seen["transfers_done"] == 8 and seen["unpinned"] == 1 and seen["page_lost"] == 1, dict(seen)


def test_cold_request_has_no_hot_table():
    """vLLM's hot manager creates a request's table only with its region: a cold admission leaves
    none (the reference first created an empty one; the state comparison caught it)."""
    make = _vllm_pool()
    config = HiSparsePoolConfig(block_size=1, num_gpu_blocks=3, host_num_blocks=2, blocks_per_request=1,
                                num_resident_groups=1, max_model_len=4, max_in_flight_tokens=4)
    vllm_pool = make(config)
    seen = run_hisparse_program(config, [1], [("schedule", 0, 1, 0, 0, False)], make)
    assert seen["admit"] == 1
    vllm_pool.allocate("r0", 1, 0, 0)
    assert "r0" not in vllm_pool.observe()["tables"][3]


def test_host_exhaustion_refuses_with_the_sentinel():
    """The source adds ``num_gpu_blocks + 1`` once the host pool cannot back the pages."""
    make = _vllm_pool()
    config = HiSparsePoolConfig(block_size=2, num_gpu_blocks=20, host_num_blocks=3, blocks_per_request=1,
                                num_resident_groups=1, max_model_len=16, max_in_flight_tokens=16)
    pool = make(config)
    counts = pool.get_num_blocks_to_allocate("r0", 6, 0, 0, False)
    assert counts[0] == 21 and counts[1] == 3
    assert pool.get_num_blocks_to_allocate("r0", 4, 0, 0, False)[0] == 0


def test_probed_entry_points_agree_on_a_host_only_layout_and_an_unknown_request():
    """The end-of-program probes alone on a hand program: a host-only layout plans nothing for a
    running request, vLLM's coordinator and the reference's alike; on a resident layout an import
    completed for a request with no host table restores nothing, and write-back planned past a
    request's computed tokens (its re-prefillable tail) plans the same transfers on both sides."""
    from kvref.spec.hisparse import HiSparsePoolConfig

    make = _vllm_pool()
    for groups in (0, 1):
        config = HiSparsePoolConfig(block_size=2, num_gpu_blocks=30, host_num_blocks=30, blocks_per_request=1,
                                    num_resident_groups=groups, max_model_len=16, max_in_flight_tokens=16)
        seen = run_hisparse_program(config, [12, 8, 8], [("schedule", 0, 9, 0, 0, False)], make)
        assert seen["admit"] == 1 and seen["probes"] == 4, dict(seen)
        # host-only: nothing to write back; resident: the probe writes back the pages the schedule did not
        assert (seen["probe_transfers"] > 0) == bool(groups), dict(seen)


def _straggler_program(make) -> Counter:
    """The last hand program (run by conform-kv-manager every time): straggler reports on a pool
    where r0's 11-token prefill writes back several pages, then r0 freed."""
    from kvref.models.machines.hisparse_pool import HAND_PROGRAMS, STRAGGLER_PREFIX

    config, lengths, ops = HAND_PROGRAMS[-1]
    assert ops == STRAGGLER_PREFIX
    return run_hisparse_program(config, lengths, ops + [("free", 0, 1, 0, 0, False)], make)


def test_straggler_reports_agree():
    """Workers reporting a write-back a step apart (TP > 1): the first enqueue report fixes how
    many must complete, a later one does not change it, and a report for a completed transfer is
    ignored; both sides agree after every report (and the fixed-seed run above reaches both)."""
    seen = _straggler_program(_vllm_pool())
    assert seen["straggler_report"] == 2 and seen["straggler_after_done"] == 1, dict(seen)
    assert seen["transfers_done"] > 0, dict(seen)


def test_a_later_enqueue_report_overwriting_the_expected_count_is_found(monkeypatch):
    """vLLM's first-report-counts rule dropped: a straggler's enqueue report resets how many
    workers must complete the transfer, so the page is released at another step than the reference's."""
    make = _vllm_pool()
    from vllm.v1.hisparse.coordinator import HiSparseCoordinator

    def update_spills(self, enqueued_counts, completed_counts):
        for spill_id, count in enqueued_counts.items():
            if (pending := self.pending_spills.get(spill_id)) is not None:
                pending.expected_worker_completions = count
        for spill_id, count in completed_counts.items():
            if (pending := self.pending_spills.get(spill_id)) is not None:
                pending.worker_completions += count
        self._apply_enqueued_spills()
        self._complete_host_writes()

    monkeypatch.setattr(HiSparseCoordinator, "update_spills", update_spills)
    with pytest.raises(AssertionError):
        _straggler_program(make)
