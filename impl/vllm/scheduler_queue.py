"""vLLM 0.33.0's waiting queues (``FCFSRequestQueue``, ``PriorityRequestQueue``, made by
``create_request_queue``) behind the reference :class:`kvref.impl.reference.scheduler_queue.WaitingQueue`'s
interface, so that generated operation sequences can drive both and compare the order (#22).

Each kvref :class:`~kvref.impl.request.Request` is mirrored by one vLLM ``Request`` (same id,
priority and arrival time, the fields vLLM's priority order reads); the adapter answers with the
kvref requests, so results compare directly. vLLM refuses an empty pop/peek with ``IndexError``
and a removal of a request it does not hold (or an unknown policy) with ``ValueError``; the adapter
lets both through unchanged: the caller compares *that* an operation was refused.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable, Iterator

from kvref.impl.request import Request
from kvref.impl.vllm.vrequest import QUEUE_CARRY, vllm_request_from


class VllmWaitingQueue:
    """A vLLM request queue of ``policy`` (``"fcfs"`` or ``"priority"``; anything else is passed to
    vLLM's ``SchedulingPolicy`` lookup and ``create_request_queue`` as is)."""

    def __init__(self, policy: str) -> None:
        from vllm.v1.core.sched.request_queue import SchedulingPolicy, create_request_queue

        try:
            sp = SchedulingPolicy(policy)
        except ValueError:
            sp = policy  # create_request_queue's own "Unknown scheduling policy" refusal
        self.queue = create_request_queue(sp)
        self._twins: dict[int, object] = {}  # id(kvref request) -> its vLLM request
        self._back: dict[int, Request] = {}  # id(vLLM request) -> the kvref request

    def _twin(self, request: Request):
        vr = self._twins.get(id(request))
        if vr is None:
            vr = vllm_request_from(request, carry=QUEUE_CARRY, max_tokens=max(1, request.max_tokens))
            self._twins[id(request)] = vr
            self._back[id(vr)] = request
        return vr

    def add_request(self, request: Request) -> None:
        self.queue.add_request(self._twin(request))

    def prepend_request(self, request: Request) -> None:
        self.queue.prepend_request(self._twin(request))

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        """The reference takes the requests in the order they end up at the head; vLLM's
        scheduler hands ``prepend_requests`` a deque it built with ``appendleft`` (the skipped
        requests last-first), which FCFS's ``extendleft`` reverses back. Passed the same way."""
        self.queue.prepend_requests(deque(self._twin(r) for r in reversed(list(requests))))

    def peek_request(self) -> Request:
        return self._back[id(self.queue.peek_request())]

    def pop_request(self) -> Request:
        return self._back[id(self.queue.pop_request())]

    def remove_request(self, request: Request) -> None:
        self.queue.remove_request(self._twin(request))

    def remove_requests(self, requests: Iterable[Request]) -> None:
        self.queue.remove_requests([self._twin(r) for r in requests])

    def __iter__(self) -> Iterator[Request]:
        return iter([self._back[id(vr)] for vr in self.queue])

    def __len__(self) -> int:
        return len(self.queue)

    def __bool__(self) -> bool:
        return bool(self.queue)

    def check_invariants(self) -> None:
        """Every queued vLLM request is one this adapter made (none lost or foreign)."""
        assert all(id(vr) in self._back for vr in self.queue), "a vLLM queue entry the adapter never added"
