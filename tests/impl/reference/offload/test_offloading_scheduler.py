"""OffloadingConnector scheduler reference: engine traces under the content model, fences, bad input."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvref.impl.reference.offload.cpu_offloading_manager import CPUOffloadingManager
from kvref.impl.reference.offload.keys import OffloadStateError
from kvref.impl.reference.offload.offloading_scheduler import OffloadingConnectorScheduler, OffloadingStep
from kvref.models.offload.offloading_connector_world import OffloadingConfig, OffloadingWorld
from kvref.spec.errors import InvalidFieldError, KVRefError
from kvref.spec.kv_cache_interface import MambaSpec
from tests.conftest import profile_examples
from kvref.models.offload.traces import apply_offloading_op, random_ops


@settings(max_examples=profile_examples(30, 120))
@given(seed=st.integers(0, 2**32 - 1), bpc=st.sampled_from([1, 2]), sw=st.sampled_from([None, 4, 8]),
       workers=st.integers(1, 2), cpu=st.sampled_from([2, 6, 32]))
def test_engine_traces_keep_the_offload_invariants(seed, bpc, sw, workers, cpu):
    """Content model + check_invariants after every call: stores read full computed blocks, no
    source is overwritten without its job flushed, SW sources fenced from creation, one load or
    only stores per request; after draining every transfer nothing stays pinned or fenced."""
    rnd = random.Random(seed)
    w = OffloadingWorld(OffloadingConfig(block_size=4, blocks_per_chunk=bpc, num_gpu_blocks=rnd.randint(10, 18),
                                         num_cpu_chunks=cpu, sliding_window=sw, num_workers=workers))
    for op in random_ops(rnd, rnd.randint(20, 60)):
        if op[0] == "reset" and sw is not None:
            continue  # a connector reset with running SWA requests breaks the model in 0.33.0 (offload.md)
        apply_offloading_op(w, op)
    for rid in w.live():
        w.finish(rid)
    w.step(4)
    while w.jobs:
        w.complete(0, 2)
    w.b.check_invariants()
    conn = w.b.conn
    assert conn._jobs == {} and conn._block_id_to_pending_jobs == {} and conn._req_status == {}
    assert all(ref == 0 for _, ref in w.b.manager.chunk_state().values())


def _conn():
    w = OffloadingWorld(OffloadingConfig(block_size=4, num_workers=2))
    return w, w.b.conn


def test_bad_construction():
    m = CPUOffloadingManager(4)
    spec = OffloadingConfig().kvref_groups()[0].kv_cache_spec
    with pytest.raises(InvalidFieldError, match="blocks_per_chunk"):
        OffloadingConnectorScheduler([spec], m, 4, blocks_per_chunk=0)
    with pytest.raises(InvalidFieldError, match="manager"):
        OffloadingConnectorScheduler([spec], object(), 4)
    with pytest.raises(InvalidFieldError, match="block_size"):
        OffloadingConnectorScheduler([spec], m, 2)
    mamba = MambaSpec(block_size=4, shapes=((1,),), dtypes=("float32",))
    with pytest.raises(InvalidFieldError, match="specs"):
        OffloadingConnectorScheduler([mamba], m, 4)


def test_bad_completions_change_nothing():
    w, conn = _conn()
    w.add_request(list(range(100, 113)))
    w.step(16)  # store job 0
    assert sorted(conn._jobs) == [0]
    for jobs, what in [({5: 1}, "unknown"), ({0: 3}, "more than"), ({0: 0}, "completed_jobs")]:
        with pytest.raises(KVRefError, match=what):
            conn.update_connector_output(jobs)
        assert conn._jobs[0].pending_count == 2
    conn.update_connector_output({0: 2})
    with pytest.raises(OffloadStateError, match="already complete"):
        conn.update_connector_output({0: 1})
    conn.check_invariants()


def test_requests_finishing_twice_or_unknown_are_rejected():
    w, conn = _conn()
    rid = w.add_request(list(range(100, 113)))
    req = w.reqs[rid].req
    with pytest.raises(OffloadStateError, match="already known"):
        conn.on_new_request(req)
    conn.request_finished(req)
    with pytest.raises(OffloadStateError, match="already finished"):
        conn.request_finished(req)
    with pytest.raises(OffloadStateError, match="already finished"):
        conn.get_num_new_matched_tokens(req, 0)
    with pytest.raises(OffloadStateError, match="unknown"):
        conn.build_connector_meta(OffloadingStep(scheduled=[("nobody", None, True)]))
    with pytest.raises(InvalidFieldError, match="step"):
        conn.build_connector_meta(None)


def test_second_reset_before_a_step_is_rejected():
    w, conn = _conn()
    w.add_request(list(range(100, 113)))
    w.step(16)
    conn.reset_cache()
    with pytest.raises(OffloadStateError, match="reset"):
        conn.reset_cache()
    assert conn.build_connector_meta(OffloadingStep()).jobs_to_flush == {0}
    conn.reset_cache()  # delivered: allowed again
