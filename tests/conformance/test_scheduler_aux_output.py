"""vLLM 0.33.0's aux-output (routed-experts) connector in lock step with the reference's
(models/machines/scheduler_aux_output.py, issue #22): the runs agree and reach retention, release
and both external-hit outcomes; a planted reference fault in retention or in the external-hit cap
makes them diverge."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvref.impl.reference import scheduler_aux_output as aux_mod
from kvref.models.machines.scheduler_aux_output import (
    run_aux_output_connector_machine,
    run_aux_output_machine,
)

SEED = 1
#: the connector run's seed: its five traces keep external hits, drop others and hold an async load
CONNECTOR_SEED = 0


def test_lock_step_without_connector_agrees_and_retains():
    run = run_aux_output_machine(3, seed=SEED, shrink=False)
    assert run.ok, run.failure
    assert run.coverage["aux_retained_hashes"] > 0 and run.coverage["aux_finished_events"] > 0


def test_lock_step_beside_connector_agrees_and_caps_both_ways():
    run = run_aux_output_connector_machine(5, seed=CONNECTOR_SEED, shrink=False)
    assert run.ok, run.failure
    c = run.coverage
    assert c["aux_external_kept"] > 0 and c["aux_external_dropped"] > 0 and c["aux_retained_hashes"] > 0
    assert c["aux_async_loads_held"] > 0


def test_planted_fault_retention_ignores_gpu_cached_check_diverges(monkeypatch):
    """Retaining every computed block, GPU-cached or not (vLLM retains only blocks whose routing the
    worker still holds), lets later hits count blocks vLLM forgot."""
    def retain_all(self, request):
        rid = request.request_id
        self.loading.pop(rid, None)
        from itertools import islice

        for block, keys in islice(self._kv_blocks(self._hashes(request)), request.num_computed_tokens // self.block_size):
            if block not in self.kv_cached:
                self.kv_cached[block] = keys
                self.retained_hashes.extend(keys)
        self._release_unheld()
        if rid in self.sent_hash_counts:
            self.finished_requests[rid] = self._take_new_hashes(request, request.num_computed_tokens)
            del self.sent_hash_counts[rid]

    monkeypatch.setattr(aux_mod.AuxOutputControl, "request_finished", retain_all)
    run = run_aux_output_machine(3, seed=SEED, shrink=False)
    assert not run.ok and run.signature is not None and "aux-output connector" in run.failure


def test_planted_fault_cap_forgets_block_alignment_diverges(monkeypatch):
    """Keeping an unaligned external hit (vLLM drops it: the routing store is per block) changes
    the admissions the schedulers compare."""
    def unaligned_cap(self, request, num_local, num_external):
        return num_external if num_local + num_external <= self.max_cache_hit(request) else 0

    monkeypatch.setattr(aux_mod.AuxOutputControl, "cap_external_hit", unaligned_cap)
    run = run_aux_output_connector_machine(5, seed=CONNECTOR_SEED, shrink=False)
    assert not run.ok and run.signature is not None




def test_planted_vllm_fault_retention_without_gpu_cached_check_diverges(monkeypatch):
    """The same fault planted in vLLM itself: its ``request_finished`` retains every computed block
    (its GPU-cached check answers yes while it retains); the retained keys differ from the
    reference's."""
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

    real = AuxOutputSchedulerConnector.request_finished

    def request_finished(self, request):
        self._gpu_cached = lambda block_hash: True  # an instance attribute, only while retaining
        try:
            return real(self, request)
        finally:
            del self._gpu_cached

    monkeypatch.setattr(AuxOutputSchedulerConnector, "request_finished", request_finished)
    run = run_aux_output_machine(3, seed=SEED, shrink=False)
    assert not run.ok and "aux-output connector" in run.failure
