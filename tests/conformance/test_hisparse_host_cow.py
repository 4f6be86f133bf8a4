"""HiSparse host copy-on-write on generated programs, vLLM 0.33.0's ``HiSparseSourceManager``
against the reference's (issue #23): with prefix caching on, a hit that ends inside the host
source's last hit block makes the source copy that block on write. The machine compares the pending
pairs (ids and both endpoints' ref counts) after every op, the pairs drained for the worker
(``take_host_block_copies``) and, through ``observe``, the retained endpoints and the host free
queue until the worker's report releases them."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings

from kvref.models.hypothesis_runs.reproducible import same_inputs_in_every_process
from kvref.models.machines.hisparse_pool import (
    HOST_COW_PREFIX,
    LENGTHS,
    PROGRAMS,
    HiSparseDivergence,
    hisparse_pool_configs,
    run_hisparse_program,
)
from kvref.spec.hisparse import HiSparsePoolConfig
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

ROOMY = HiSparsePoolConfig(block_size=2, num_gpu_blocks=40, host_num_blocks=30, blocks_per_request=1,
                           num_resident_groups=1, max_model_len=32, max_in_flight_tokens=32, enable_caching=True)
#: r1's partial host hit, its copy pending over a step, drained for the worker, then r1 freed while
#: the worker has not reported the copy, and a second drain (nothing left)
COW_PROGRAM = HOST_COW_PREFIX + [("update", 1, 1, 0, 0, False), ("host_copies", 0, 1, 0, 0, False),
                                 ("free", 1, 1, 0, 0, False), ("host_copies", 0, 1, 0, 0, False)]


def _vllm_pool():
    require_vllm()
    from kvref.impl.vllm.hisparse import VllmHiSparsePool

    return VllmHiSparsePool


def test_generated_programs_reach_host_copy_on_write():
    """A fixed-seed run (the same under every profile) of generated programs with caching on makes
    partial host hits, holds their copy-on-write pairs pending (compared after every op) and drains
    them for the worker."""
    make = _vllm_pool()
    seen: Counter = Counter()

    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(hisparse_pool_configs().filter(lambda c: c.enable_caching and c.block_size > 1), LENGTHS, PROGRAMS)
    def run(config, lengths, ops):
        seen.update(run_hisparse_program(config, lengths, ops, make))

    with same_inputs_in_every_process():
        run()
    for path in ("partial_host_hit", "host_cow_pending", "host_copies"):
        assert seen[path] > 0, f"{path} never reached: {dict(seen)}"


def test_the_hand_program_drains_one_copy_after_a_pending_step():
    seen = run_hisparse_program(ROOMY, [20, 20, 20], COW_PROGRAM, _vllm_pool())
    assert seen["partial_host_hit"] == 1 and seen["host_copies"] == 1 and seen["host_cow_pending"] >= 2, dict(seen)


# ---------------------------------------------------------------- planted faults in vLLM's COW path
# Each wraps vLLM's own HiSparseSourceManager in-process (undone by monkeypatch); the comparison must
# find it on the hand program.

def _fault_copy_not_pinned(source_cls, monkeypatch):
    """The copy does not take its extra ref, so a same-step free could recycle it before the copy."""
    original = source_cls._apply_cow

    def apply_cow(self, request_id, block_idx, source_block, cow_block):
        original(self, request_id, block_idx, source_block, cow_block)
        cow_block.ref_cnt -= 1

    monkeypatch.setattr(source_cls, "_apply_cow", apply_cow, raising=False)


def _fault_copies_lost(source_cls, monkeypatch):
    """The drain hands the worker nothing: the shared block's tail is never copied."""
    def take(self):
        self._pending_cow_copies = []
        return []

    monkeypatch.setattr(source_cls, "take_host_cow_copies", take)


def _fault_copy_from_wrong_block(source_cls, monkeypatch):
    """The pair names the request's previous block as the copy's source."""
    original = source_cls._apply_cow

    def apply_cow(self, request_id, block_idx, source_block, cow_block):
        original(self, request_id, block_idx, source_block, cow_block)
        if block_idx > 0:
            src, dst = self._pending_cow_copies[-1]
            self._pending_cow_copies[-1] = (self.req_to_blocks[request_id][block_idx - 1], dst)

    monkeypatch.setattr(source_cls, "_apply_cow", apply_cow, raising=False)


@pytest.mark.parametrize("fault", [_fault_copy_not_pinned, _fault_copies_lost, _fault_copy_from_wrong_block])
def test_a_planted_fault_in_vllms_host_copy_on_write_is_found(fault, monkeypatch):
    make = _vllm_pool()
    from vllm.v1.core.single_type_kv_cache_manager import HiSparseSourceManager

    fault(HiSparseSourceManager, monkeypatch)
    with pytest.raises(HiSparseDivergence):
        run_hisparse_program(ROOMY, [20, 20, 20], COW_PROGRAM, make)
