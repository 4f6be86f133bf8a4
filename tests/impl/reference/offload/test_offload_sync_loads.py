"""Synchronous loads of the OffloadingConnector scheduler reference (``sync_load_budget_bytes``,
:mod:`kvref.impl.reference.offload.sync_loads`): a hit within the step's byte budget is loaded
before the forward pass and the request runs in the same step."""

from __future__ import annotations

import pytest

from kvref.impl.reference.offload.sync_loads import SyncLoadBudget
from kvref.models.offload.offloading_connector_world import OffloadingConfig, OffloadingWorld
from kvref.spec.errors import InvalidFieldError

PROMPT = list(range(100, 118))  # 18 tokens: 4 full blocks of 4


def _cached_world(budget: int) -> OffloadingWorld:
    """A world whose CPU tier holds PROMPT's 4 chunks and whose GPU prefix cache is empty."""
    w = OffloadingWorld(OffloadingConfig(block_size=4, num_gpu_blocks=24, num_cpu_chunks=32,
                                         sync_load_budget_bytes=budget))
    r0 = w.add_request(PROMPT)
    w.step(32)
    while w.jobs:
        w.complete(0, 2)
    w.finish(r0, aborted=False)
    w.step(4)
    assert w.reset_gpu_prefix_cache()
    return w


def test_a_hit_within_the_budget_loads_synchronously_and_runs_at_once():
    w = _cached_world(budget=16 * 8)  # 16 tokens x 8 bytes (one full-attention group)
    r1 = w.add_request(PROMPT + [5])
    r2 = w.add_request(PROMPT + [6])
    loads, _, _, lookups = w.step(8)
    # r1's blocks are hashed at allocation (a synchronous load): r2 hits them on the GPU at once
    assert lookups == ((r1, 0, 16), (r2, 16, 0))
    assert w.sync_loads == [(r1, 16, True)]
    assert w.reqs[r1].phase == "running" and w.reqs[r1].computed == 16 + 3
    (job, rid, keys, blocks, _), = loads
    assert rid == r1 and w.b.conn._jobs[job].is_sync_load and w.b.conn._batch_load_jobs == {}
    assert not w.b.conn._chunks_being_loaded, "a synchronous copy ends before anyone else looks"
    assert w.hit_sources[-1] == (r1, (("host", 16),))


def test_a_hit_over_the_budget_loads_asynchronously():
    w = _cached_world(budget=16 * 8 - 1)
    r1 = w.add_request(PROMPT + [5])
    loads, _, _, lookups = w.step(8)
    assert lookups == ((r1, 0, 16),) and w.sync_loads == [] and w.reqs[r1].phase == "loading"
    (job, _, keys, _, _), = loads
    assert not w.b.conn._jobs[job].is_sync_load and w.b.conn._chunks_being_loaded == set(keys)


def test_a_hit_that_leaves_nothing_to_compute_stays_asynchronous():
    w = _cached_world(budget=10**6)
    r1 = w.add_request(PROMPT[:16])  # the 16-token hit is the whole request
    _, _, _, lookups = w.step(8)
    assert lookups == ((r1, 0, 16),) and w.sync_loads == [] and w.reqs[r1].phase == "loading"
    budget = SyncLoadBudget(100, 8)
    assert not budget.reserve("a", 0, 16, 16) and budget.reserve("a", 0, 8, 16) and budget.used_bytes == 64
    assert not budget.reserve("b", 0, 8, 16), "over the step's budget"
    budget.end_step()
    assert budget.reserved == set() and budget.used_bytes == 0


def test_bad_budget_is_named():
    with pytest.raises(InvalidFieldError, match="sync_load_budget_bytes"):
        SyncLoadBudget(-1, 8)
    with pytest.raises(InvalidFieldError, match="kv_bytes_per_token"):
        SyncLoadBudget(8, "8")
