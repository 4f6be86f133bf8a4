"""HiSparse pools with prefix caching on, vLLM 0.33.0's ``HiSparseCoordinator`` against the
reference's (issue #23): host pages are published once their write-backs complete, a later request
on the same prompt hits them and adopts their GPU copies, and a finished request's last write-backs
publish its sealed pages after it is gone. Every program compares every observable after every op
(the machine's ``observe``: tables, residency rows, both pools' free queues and published blocks,
the coordinator's page states, publications, GPU-copy index and retained host copies)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings

from kvref.models.hypothesis_runs.reproducible import same_inputs_in_every_process
from kvref.models.machines.hisparse_pool import (
    COPY_PREFIX,
    FINISH_IN_FLIGHT_PREFIX,
    LENGTHS,
    PROGRAMS,
    hisparse_pool_configs,
    run_hisparse_program,
)
from kvref.spec.hisparse import HiSparsePoolConfig
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

ROOMY = HiSparsePoolConfig(block_size=2, num_gpu_blocks=40, host_num_blocks=30, blocks_per_request=1,
                           num_resident_groups=1, max_model_len=32, max_in_flight_tokens=32, enable_caching=True)


def _vllm_pool():
    require_vllm()
    from kvref.impl.vllm.hisparse import VllmHiSparsePool

    return VllmHiSparsePool


def test_a_published_prefix_is_hit_and_its_gpu_copies_adopted_on_both_sides():
    """r0 writes back and publishes five pages while running; r1, on the same prompt, hits them on
    the host (the indexer's GPU hit agrees) and, in the step that admits it, points its host-only
    pages at r0's GPU blocks (pinning them again): same hit, ids and state on both sides."""
    seen = run_hisparse_program(ROOMY, [20, 20, 20], COPY_PREFIX + [("update", 1, 1, 0, 0, False)], _vllm_pool())
    assert seen["host_published"] and seen["cache_hit"] == 1 and seen["copy_adopted"] == 1, dict(seen)


def test_a_finished_request_publishes_after_its_last_write_back():
    """r0 is finished while its write-backs are in flight: both coordinators keep its sealed host
    blocks and publish them when the last one completes, so r1 hits them. (The reference asked the
    request ``is_finished()`` where kvref's Request has a property: freeing raised TypeError.)"""
    seen = run_hisparse_program(ROOMY, [20, 20, 20], FINISH_IN_FLIGHT_PREFIX, _vllm_pool())
    assert seen["free_finished"] == 1 and seen["detached_published"] == 1 and seen["cache_hit"] == 1, dict(seen)


def test_a_preempted_request_drops_its_publication():
    """A preempted request's planned write-backs do not prove its KV was computed: both drop the
    publication, so its pages are not published when the transfers complete and nothing is hit."""
    ops = [("require_hot", 0, 1, 0, 0, False), ("schedule", 0, 11, 0, 0, False), ("offload", 0, 1, 0, 0, False),
           ("free", 0, 4, 0, 0, False), ("complete", 0, 1, 0, 0, True), ("schedule", 1, 11, 0, 0, False)]
    seen = run_hisparse_program(ROOMY, [20, 20, 20], ops, _vllm_pool())
    assert seen["free_preempted"] == 1 and seen["cache_hit"] == 0 and not seen["host_published"], dict(seen)


def test_generated_programs_with_caching_reach_publication_hits_and_copies():
    """A fixed-seed run (the same under every profile) of generated programs reaches, with caching
    on, host publication, prefix hits, adopted GPU copies, a finished request's detached
    publication and preempted frees."""
    make = _vllm_pool()
    seen: Counter = Counter()

    @settings(max_examples=120, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(hisparse_pool_configs().filter(lambda c: c.enable_caching), LENGTHS, PROGRAMS)
    def run(config, lengths, ops):
        seen.update(run_hisparse_program(config, lengths, ops, make))

    with same_inputs_in_every_process():
        run()
    for path in ("cache_blocks", "host_published", "cache_hit", "copy_adopted", "detached_published",
                 "free_finished", "free_preempted", "transfers_done", "unpinned"):
        assert seen[path] > 0, f"{path} never reached: {dict(seen)}"


def test_generated_programs_with_caching_agree():
    make = _vllm_pool()

    @settings(max_examples=profile_examples(30, 150), deadline=None)
    @given(hisparse_pool_configs().filter(lambda c: c.enable_caching), LENGTHS, PROGRAMS)
    def run(config, lengths, ops):
        run_hisparse_program(config, lengths, ops, make)

    run()


# ---------------------------------------------------------------- planted faults in vLLM's coordinator
# Each wraps one of vLLM's own HiSparseCoordinator methods in-process (undone by monkeypatch) and
# requires the comparison to find it on the hand programs above.

def _fault_no_copies_recorded(coordinator_cls, monkeypatch):
    """Published host pages never index their GPU copies, so later hits read from host only."""
    monkeypatch.setattr(coordinator_cls, "_record_copies", lambda self, request_id, num_computed_tokens: None)


def _fault_hit_not_adopted(coordinator_cls, monkeypatch):
    """A host hit never schedules the adoption of its pages' GPU copies."""
    original = coordinator_cls.commit_computed_blocks

    def commit(self, request_id, num_host_pages):
        original(self, request_id, num_host_pages)
        if request_id in self.request_states:
            self.request_states[request_id].pages_to_adopt = 0

    monkeypatch.setattr(coordinator_cls, "commit_computed_blocks", commit)


def _fault_finished_publication_dropped(coordinator_cls, monkeypatch):
    """A finished request's publication is dropped on free as if it were preempted."""
    original = coordinator_cls.free

    def free(self, request_id):
        state = self.request_states.get(request_id)
        if state is not None:
            state.publication = None
        original(self, request_id)

    monkeypatch.setattr(coordinator_cls, "free", free)


@pytest.mark.parametrize("fault, prefix", [(_fault_no_copies_recorded, COPY_PREFIX),
                                           (_fault_hit_not_adopted, COPY_PREFIX),
                                           (_fault_finished_publication_dropped, FINISH_IN_FLIGHT_PREFIX)])
def test_a_planted_fault_in_vllms_publication_paths_is_found(fault, prefix, monkeypatch):
    from kvref.models.machines.hisparse_pool import HiSparseDivergence

    make = _vllm_pool()
    from vllm.v1.hisparse.coordinator import HiSparseCoordinator

    fault(HiSparseCoordinator, monkeypatch)
    with pytest.raises(HiSparseDivergence):
        run_hisparse_program(ROOMY, [20, 20, 20], prefix + [("update", 1, 1, 0, 0, False)], make)


def test_host_copy_on_write_is_held_until_the_worker_reports_it():
    """A partial host hit's copy-on-write (set up as vLLM's own test does: a shared host block
    marked as the request's partial tail) is drained by ``take_host_block_copies`` with both
    endpoints held past the request's free, and released by ``release_completed_host_copies``:
    same pairs, same host free queue and counts on both sides after every step."""
    from kvref.impl.reference.hisparse_pool import HiSparsePool

    make = _vllm_pool()
    config = HiSparsePoolConfig(block_size=2, num_gpu_blocks=12, host_num_blocks=6, blocks_per_request=1,
                                num_resident_groups=1, max_model_len=16, max_in_flight_tokens=16)
    pools = (HiSparsePool(config), make(config))
    for pool in pools:
        source = pool.managers[0]
        block = source.block_pool.get_new_blocks(1)[0]
        source.req_to_blocks["cow"] = [block]
        source._partial_hit_reqs["cow"] = (0, block)
        source.allocate_new_blocks("cow", 2, 2)
    assert [p.managers[0].take_new_block_ids() for p in pools] == [[], []]  # host blocks are never zeroed
    copies = [p.take_host_block_copies() for p in pools]
    assert copies[0] == copies[1] and len(copies[0]) == 1
    for pool in pools:
        pool.managers[0].free("cow")
    assert pools[0].observe() == pools[1].observe() and pools[0].observe()["retained_copies"] == [copies[0][0][1]]
    pools[0].check_invariants()  # M16 counts the retained endpoints, M19 keeps them referenced
    for pool in pools:
        pool.release_completed_host_copies([copies[0][0][1]])
    assert pools[0].observe() == pools[1].observe() and not pools[0].observe()["retained_copies"]
    assert pools[0].host_pool.get_num_free_blocks() == config.host_num_blocks - 1
    pools[0].check_invariants()
