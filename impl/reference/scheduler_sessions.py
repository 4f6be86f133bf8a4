"""Streaming-input sessions inside whole scheduler steps (vLLM 0.33.0, issue #22).

:mod:`.scheduler_streaming` holds a session's own rules (what a stopped turn or an update does to
the request). This module places them in ``Scheduler``'s steps, as vLLM's scheduler does:

* ``add_request`` with the id of a live session is an *update*
  (``StreamingUpdate.from_request``: the new request's prompt, ``max_tokens`` and
  ``arrival_time``; a request that is not ``resumable`` is the finishing ``None``). Queued while the
  session runs or waits in a queue; applied at once while it waits for input; a finishing update
  of a session waiting for input aborts it (``finish_requests``).
* ``update_from_output``: a stopped turn of a session is not freed
  (``_handle_stopped_request``); it leaves ``running`` with the stopped requests, then
  ``_enqueue_waiting_request`` puts it back: into ``kv_holding_waiting`` while it has computed
  tokens (its KV blocks stay allocated), else into ``waiting``; a session waiting for input is
  also *deferred* (``deferred_waiting``: ``make_stats``' ``num_skipped_waiting_reqs``).
* ``schedule()``'s waiting loop drains ``kv_holding_waiting`` first (also under ``PAUSED_NEW``); a
  session waiting for input is skipped (``_handle_blocked_waiting_request``); a session with
  computed tokens is admitted on its own blocks, without a prefix-cache lookup (as a ``new``
  request: its status is WAITING); sessions waiting for input still hold a model-runner slot, so
  they count against ``max_num_active_reqs``.
* ``get_num_unfinished_requests`` leaves sessions waiting for input out (the engine loop idles on
  them); ``get_request_counts`` counts them as waiting.

kvref models sessions under FCFS without a KV connector, speculative decoding or multimodal items
(the scheduler refuses such a session with :class:`~kvref.spec.errors.InvalidFieldError`; under
PRIORITY an update re-times a session inside vLLM's heap).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from kvref.impl.request import Request, RequestStatus
from kvref.spec.errors import InvalidFieldError

from . import scheduler_streaming as ss
from .scheduler_queue import WaitingQueue

if TYPE_CHECKING:  # pragma: no cover
    from .scheduler import Scheduler


class SessionSteps:
    """The scheduler's sessions: their update queues and waits (:class:`.SessionState`), and
    vLLM's ``kv_holding_waiting`` queue, which (without a KV connector) only sessions enter."""

    def __init__(self, policy: str) -> None:
        self.state = ss.SessionState()
        self.kv_holding_waiting = WaitingQueue(policy)

    @property
    def num_waiting_for_streaming_input(self) -> int:
        return self.state.num_waiting_for_streaming_input

    def is_session(self, request_id: str) -> bool:
        return request_id in self.state.queues

    def waiting_for_input(self, request: Request) -> bool:
        """vLLM ``WAITING_FOR_STREAMING_REQ``: skipped by the waiting loop until an update comes."""
        return request.request_id in self.state.waiting_for_input

    def check_invariants(self, live: dict[str, Request]) -> None:
        """Q11/Q12 of the session state; Q13: ``kv_holding_waiting`` holds only live WAITING
        sessions with computed tokens (the blocks they keep)."""
        self.state.check_invariants(set(live))
        self.kv_holding_waiting.check_invariants()
        for r in self.kv_holding_waiting:
            assert self.is_session(r.request_id) and live.get(r.request_id) is r, \
                f"Q13: {r.request_id} holds KV while waiting but is no live session"
            assert r.status == RequestStatus.WAITING and r.num_computed_tokens > 0, \
                f"Q13: KV-holding session {r.request_id} is {r.status.value} with {r.num_computed_tokens} computed"


def check_new_session(sched: "Scheduler", request: Request) -> None:
    """A ``resumable`` arrival: refused where kvref does not model sessions."""
    if not request.resumable:
        return
    if sched.connector_state is not None:
        raise InvalidFieldError("request.resumable", True, "False with a KV connector (kvref models sessions without)")
    if sched.config.num_speculative_tokens:
        raise InvalidFieldError("request.resumable", True,
                                "False with speculative decoding (kvref models sessions without)")
    if request.mm_features:
        raise InvalidFieldError("request.resumable", True, "False for a multimodal request (updates carry no items)")
    if sched.config.policy != "fcfs":
        # an update re-times a queued session: vLLM's priority heap is then out of order
        raise InvalidFieldError("request.resumable", True, "False under the PRIORITY policy (kvref models FCFS)")


def add_session(sched: "Scheduler", request: Request) -> None:
    """A new ``resumable`` request opens its (empty) update queue."""
    sched.sessions.state.queues[request.request_id] = deque()


def add_update(sched: "Scheduler", request: Request) -> None:
    """vLLM ``add_request`` for a live session id: ``request`` carries the update (or, not
    ``resumable``, the finishing ``None``)."""
    session = sched.requests[request.request_id]
    update = None
    if request.resumable:
        update = ss.StreamingUpdate(tuple(request.prompt_token_ids), request.max_tokens, request.arrival_time,
                                    request.stop_token_ids, request.eos_token_id, request.min_tokens,
                                    request.repetition_detection)
        kept = session.num_tokens - 1 if session.request_id in sched.sessions.state.waiting_for_input else None
        if kept is not None and kept + len(update.prompt_token_ids) >= sched.max_model_len:
            raise InvalidFieldError("len(request.prompt_token_ids)", len(update.prompt_token_ids),
                                    f"fewer than max_model_len={sched.max_model_len} tokens with the session's "
                                    f"{kept}")
    outcome = ss.add_update(sched.sessions.state, session, update)
    if outcome == "finish":
        sched.finish_requests(session.request_id)
    elif outcome == "applied":
        _rehash(sched, session)


def _rehash(sched: "Scheduler", request: Request) -> None:
    """The final sampled token was dropped and the update's prompt appended: the hash of the block
    that token fell in is stale (vLLM trims ``block_hashes`` at ``keep_end // hash_block_size`` and
    rehashes). The reference's hasher memoizes a request's hashes, so it forgets them: the kept
    blocks rehash to the same values, the rest to the new tokens'."""
    manager = getattr(sched.kv_cache_manager, "manager", sched.kv_cache_manager)
    hasher = getattr(manager, "hasher", None)
    if hasher is not None:
        hasher.forget(request.request_id)


def handle_stopped(sched: "Scheduler", request: Request) -> bool:
    """vLLM ``_handle_stopped_request`` for a stopped request; True when it is finished (no
    session, or its queued update is the finishing ``None``)."""
    if not sched.sessions.is_session(request.request_id):
        return True
    finished = ss.handle_stopped_request(request, sched.sessions.state)
    if not finished and not sched.sessions.waiting_for_input(request):
        _rehash(sched, request)  # a queued update was applied
    return finished


def enqueue_waiting(sched: "Scheduler", request: Request) -> None:
    """vLLM ``_enqueue_waiting_request`` for a session whose turn stopped: deferred while it waits
    for input; into ``kv_holding_waiting`` while it has computed tokens, else ``waiting``."""
    if sched.sessions.waiting_for_input(request):
        sched.cadence.note_skipped(request)
    if request.num_computed_tokens > 0:
        sched.sessions.kv_holding_waiting.add_request(request)
    else:
        sched.waiting.add_request(request)


def forget(sched: "Scheduler", request: Request) -> None:
    """A finished or aborted request leaves the session state and the KV-holding queue."""
    ss.forget(sched.sessions.state, request.request_id)
    sched.sessions.kv_holding_waiting.remove_requests([request])
