"""The OffloadingConnector's fence over the step's copy-on-write destinations (issue #22).

vLLM's ``SchedulerOutput.kv_cache_block_copies`` (sub-block Mamba hits copy a state into a fresh
block before the forward pass) reach the connector, which counts each destination as a block the
step writes: a store job still reading that block is flushed first, as for a re-allocated block
(the fence of vLLM #41228). The offload worlds hand the step's pairs to both connectors; here a
finished request's store is still pending when its source block becomes a copy's destination. The
fault planted in vLLM's own source (the copies ignored) must be flagged, the clean vLLM agree."""

from __future__ import annotations

import pytest

from tests.conformance.offloading_faults import offloading_scheduler_class, planted_edit
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


def _flushes(backend: str) -> list:
    """Each step's (store jobs, flushed jobs) when the store's first source is copied into."""
    from kvref.models.offload.offloading_connector_world import OffloadingConfig, OffloadingWorld

    w = OffloadingWorld(OffloadingConfig(block_size=4, num_gpu_blocks=24, num_cpu_chunks=16), backend, strict=False)
    rid = w.add_request(list(range(100, 113)))
    out = [w.step(16)]
    stores = out[0][1]
    assert stores, "the prompt's chunks were not stored: the trace cannot reach the fence"
    w.finish(rid, aborted=False)  # the store still runs; its sources go back to the free queue
    out.append(w.step(16))
    real = w.b.release_kv_cache_block_copies
    source = stores[0][3][0]
    w.b.release_kv_cache_block_copies = lambda: [(20, source)] + real()  # the block is a copy's destination
    out.append(w.step(16))
    return [(m[1], m[2]) for m in out]


def test_both_flush_a_store_whose_source_is_a_copy_destination():
    require_vllm()
    ref, theirs = _flushes("reference"), _flushes("vllm")
    assert ref == theirs, (ref, theirs)
    job = ref[0][0][0][0]
    assert ref[1][1] == [] and ref[2][1] == [job], ref  # flushed in the copy's step, not before


def test_a_connector_that_ignores_the_copies_is_flagged():
    require_vllm()
    with planted_edit(offloading_scheduler_class(), "_update_req_states",
                      "for copy in scheduler_output.kv_cache_block_copies or ():", "for copy in ():"):
        theirs = _flushes("vllm")
    assert _flushes("reference") != theirs and theirs[2][1] == [], theirs
