"""``has_pending_push_work`` of the OffloadingConnector scheduler reference: the engine keeps stepping
while a job is unreported or a reset fence still counts down (vLLM
``OffloadingConnectorScheduler.has_pending_push_work``)."""

from __future__ import annotations

from kvref.models.offload.offloading_connector_world import OffloadingConfig, OffloadingWorld


def _world_with_a_store(workers: int = 2) -> OffloadingWorld:
    w = OffloadingWorld(OffloadingConfig(block_size=4, num_workers=workers))
    w.add_request(list(range(100, 113)))
    w.step(16)  # the prompt's three full blocks become one store job each step; two workers must report
    assert w.jobs, "the prompt's store must be in flight"
    return w


def test_pending_while_a_job_is_unreported():
    w = _world_with_a_store()
    assert w.b.conn.has_pending_push_work()
    j = sorted(w.jobs)[0]
    w.complete(0, 1)  # one of two workers: still pending
    assert j in w.jobs and w.b.conn.has_pending_push_work()
    while w.jobs:
        w.complete(0, 2)
    assert not w.b.conn.has_pending_push_work()
    assert w.push_work[-1] is False and True in w.push_work


def test_a_reset_fence_keeps_the_engine_stepping_until_late_reports_arrive():
    w = _world_with_a_store()
    jobs = sorted(w.jobs)
    w.reset()
    conn = w.b.conn
    assert conn._jobs == {} and conn._reset_fence
    assert conn.has_pending_push_work()  # no job left, but the flushed ones are not reported yet
    conn.update_connector_output({j: 2 for j in jobs})
    assert not conn._reset_fence and not conn.has_pending_push_work()
