"""The waiting queues alone (issue #22): vLLM 0.33.0's ``FCFSRequestQueue`` /
``PriorityRequestQueue`` against the reference ``WaitingQueue`` on generated operation sequences
(``scheduler_queue`` run, part of ``conform-scheduler``), refusals included; planted queue faults
in vLLM must diverge; the reference refuses bad calls with ``InvalidFieldError`` and changes nothing."""

from __future__ import annotations

import pytest

from kvref.impl.reference.scheduler_queue import WaitingQueue
from kvref.impl.request import Request
from kvref.spec.errors import InvalidFieldError
from tests.vllm_env import require_vllm

#: the derandomized histories the tests run (the check draws 20 at fast, 80 at ci)
EXAMPLES = 20


@pytest.mark.vllm
def test_queue_histories_match_vllm_and_reach_every_refusal():
    require_vllm()
    from kvref.models.machines.scheduler_queue import run_queue_machine

    run = run_queue_machine(EXAMPLES, reproducible=True)
    assert run.ok, run.failure
    assert run.traces == EXAMPLES
    for path in ("removed_one", "remove_absent_refused", "pop_empty_refused", "peek_empty_refused",
                 "prepended_several", "unknown_policy_refused"):
        assert run.coverage.get(path, 0) > 0, (path, run.coverage)


@pytest.mark.vllm
@pytest.mark.parametrize("fault", ["fcfs_prepend_keeps_order", "priority_remove_without_heapify"])
def test_planted_vllm_queue_faults_diverge(fault, monkeypatch):
    require_vllm()
    import vllm.v1.core.sched.request_queue as rq

    from kvref.models.machines.scheduler_queue import run_queue_machine

    if fault == "fcfs_prepend_keeps_order":  # extend instead of extendleft: skipped requests go to the back
        monkeypatch.setattr(rq.FCFSRequestQueue, "prepend_requests", lambda self, rs: self.extend(rs))
    else:  # the heap left unordered after a removal
        monkeypatch.setattr(rq.PriorityRequestQueue, "remove_request", lambda self, r: self._heap.remove(r))
    run = run_queue_machine(EXAMPLES, reproducible=True, shrink=False)
    assert not run.ok
    assert "queue order vLLM" in run.failure, run.failure


def _req(rid: str, priority: int = 0) -> Request:
    return Request(rid, (1, 2), max_tokens=1, priority=priority)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_reference_refuses_empty_pops_and_absent_removals_unchanged(policy):
    q = WaitingQueue(policy)
    for call in (q.pop_request, q.peek_request):
        with pytest.raises(InvalidFieldError, match="empty waiting queue"):
            call()
    a, b = _req("a"), _req("b")
    q.add_request(a)
    with pytest.raises(InvalidFieldError, match="request"):
        q.remove_request(b)
    assert [r.request_id for r in q] == ["a"]
    q.add_request(b)
    q.remove_request(a)
    assert [r.request_id for r in q] == ["b"]
    q.check_invariants()


def test_reference_refuses_an_unknown_policy():
    with pytest.raises(InvalidFieldError, match="policy"):
        WaitingQueue("lifo")
