"""The waiting queue: FCFS (a deque) or PRIORITY (ordered by ``(priority, arrival_time, request_id)``).

vLLM's ``FCFSRequestQueue`` is a deque where a preempted request is *prepended* (it goes back to
the head, see ``Scheduler._preempt_request``), and its ``PriorityRequestQueue`` is a heap where
"prepend" means "insert by key". kvref keeps the priority queue as a sorted list: the same
peek/pop/iteration order as the heap, and readable.
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import Iterable, Iterator

from kvref.impl.request import Request
from kvref.spec.errors import InvalidFieldError

#: vLLM ``SchedulingPolicy`` values (``create_request_queue`` raises ``ValueError`` on any other)
POLICIES = ("fcfs", "priority")


def priority_key(request: Request) -> tuple:
    """vLLM ``Request.__lt__``: lower priority value first, then earlier arrival, then request id."""
    return (request.priority, request.arrival_time, request.request_id)


class WaitingQueue:
    """Waiting requests in the order the scheduler tries them.

    Args:
        policy: ``"fcfs"`` or ``"priority"``.
    """

    def __init__(self, policy: str) -> None:
        if policy not in POLICIES:  # vLLM create_request_queue: "Unknown scheduling policy"
            raise InvalidFieldError("policy", policy, "one of " + ", ".join(POLICIES))
        self.policy = policy
        self._fcfs: deque[Request] = deque()
        self._sorted: list[tuple[tuple, Request]] = []

    def add_request(self, request: Request) -> None:
        """A new arrival: the tail (FCFS) or its key position (PRIORITY)."""
        if self.policy == "priority":
            key = priority_key(request)
            self._sorted.insert(bisect.bisect_left(self._sorted, (key,)), (key, request))
        else:
            self._fcfs.append(request)

    def prepend_request(self, request: Request) -> None:
        """A preempted request goes back to the head (FCFS) or to its key position (PRIORITY)."""
        if self.policy == "priority":
            self.add_request(request)
        else:
            self._fcfs.appendleft(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        """Put requests skipped in this pass back in front, keeping their relative order."""
        items = list(requests)
        if self.policy == "priority":
            for r in items:
                self.add_request(r)
        else:
            self._fcfs.extendleft(reversed(items))

    def peek_request(self) -> Request:
        """The head; an empty queue is refused (vLLM raises ``IndexError`` on both policies)."""
        self._refuse_empty("peek_request")
        return self._sorted[0][1] if self.policy == "priority" else self._fcfs[0]

    def pop_request(self) -> Request:
        """Remove and return the head; an empty queue is refused, the queue unchanged."""
        self._refuse_empty("pop_request")
        return self._sorted.pop(0)[1] if self.policy == "priority" else self._fcfs.popleft()

    def _refuse_empty(self, what: str) -> None:
        if not self:
            raise InvalidFieldError(what, "an empty waiting queue", "a queue holding a request")

    def remove_request(self, request: Request) -> None:
        """Remove one queued request (vLLM ``remove_request``: ``deque.remove`` / ``list.remove``
        and a re-heapify); one not queued is refused (vLLM raises ``ValueError``), nothing changed."""
        if not any(r is request for r in self):
            raise InvalidFieldError("request", getattr(request, "request_id", request), "a request in this queue")
        self.remove_requests((request,))

    def remove_requests(self, requests: Iterable[Request]) -> None:
        ids = {id(r) for r in requests}
        if self.policy == "priority":
            self._sorted = [kr for kr in self._sorted if id(kr[1]) not in ids]
        else:
            self._fcfs = deque(r for r in self._fcfs if id(r) not in ids)

    def __iter__(self) -> Iterator[Request]:
        if self.policy == "priority":
            return iter([r for _, r in self._sorted])
        return iter(list(self._fcfs))

    def __len__(self) -> int:
        return len(self._sorted) if self.policy == "priority" else len(self._fcfs)

    def __bool__(self) -> bool:
        return len(self) > 0

    def check_invariants(self) -> None:
        if self.policy == "priority":
            keys = [k for k, _ in self._sorted]
            assert keys == sorted(keys), "Q5: priority queue out of order"
            assert all(k == priority_key(r) for k, r in self._sorted), "Q5: stale priority key"
            assert not self._fcfs, "Q5: a priority queue holds FCFS entries"
        else:
            assert not self._sorted, "Q5: an FCFS queue holds priority entries"
        ids = [r.request_id for r in self]
        assert len(ids) == len(set(ids)), f"Q1: request queued twice: {ids}"
