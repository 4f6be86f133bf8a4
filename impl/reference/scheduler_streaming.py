"""Streaming-input sessions (vLLM 0.33.0 ``resumable=True`` requests): the session rules.

A resumable request is a *session*: when one turn stops (``max_tokens``, a stop token, the
model length) the request is not freed. vLLM's ``Scheduler._handle_stopped_request``:

* drops the turn's in-flight work: ``num_computed_tokens`` falls back to the materialized frontier
  (``num_computed_tokens - num_output_placeholders``), the in-flight output becomes stale and is
  dropped when it returns (``drop_stale_output``), the placeholders go;
* applies the next queued ``StreamingUpdate`` at once, or finishes the session when the queued
  update is the ``None`` sentinel, or else waits (``WAITING_FOR_STREAMING_REQ``) holding its
  blocks, counted by ``num_waiting_for_streaming_input``.

``Scheduler._update_request_as_session`` applies an update: every output token but the final
sampled one becomes prompt (the final one was sampled, never computed, so it and the block hashes
of the block it falls in are dropped), the update's prompt is appended, the outputs are cleared,
``max_tokens``/``arrival_time`` come from the update and the status is WAITING again.

A second ``add_request`` with a live id is an update: queued while the session runs or waits in a
queue, applied at once while it waits for input; a finishing update (``None``) of a waiting
session aborts it.

This module holds the rules as functions over :class:`kvref.impl.request.Request` and a
:class:`SessionState` (the queues and the waiting set); kvref's ``RequestStatus`` has no
``WAITING_FOR_STREAMING_REQ``, so a session waiting for input is WAITING and named in
``SessionState.waiting_for_input``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvref.impl.request import RepetitionDetectionParams, Request, RequestStatus
from kvref.spec.errors import InvalidFieldError


@dataclass(frozen=True)
class StreamingUpdate:
    """vLLM ``StreamingUpdate``: the next input chunk of a session (multimodal items aside). Its
    ``sampling_params`` replace the session's, so the stop rules (``stop_token_ids``,
    ``eos_token_id``, ``min_tokens``, ``repetition_detection``) are the update's from then on."""

    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    arrival_time: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    eos_token_id: int | None = None
    min_tokens: int = 0
    repetition_detection: RepetitionDetectionParams | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.prompt_token_ids, (list, tuple)) or any(
                type(t) is not int or t < 0 for t in self.prompt_token_ids):
            raise InvalidFieldError("update.prompt_token_ids", self.prompt_token_ids, "a list of token ids >= 0")
        object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
        if type(self.max_tokens) is not int or self.max_tokens < 1:
            raise InvalidFieldError("update.max_tokens", self.max_tokens, "an int >= 1")
        if not isinstance(self.arrival_time, (int, float)) or isinstance(self.arrival_time, bool):
            raise InvalidFieldError("update.arrival_time", self.arrival_time, "a number")
        # the stop rules: validated as a Request's (one of the same id would carry them)
        Request("update", list(self.prompt_token_ids) or [0], max_tokens=self.max_tokens,
                stop_token_ids=self.stop_token_ids, eos_token_id=self.eos_token_id, min_tokens=self.min_tokens,
                repetition_detection=self.repetition_detection)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))


@dataclass
class SessionState:
    """The scheduler's session bookkeeping: each session's queue of updates (``None`` finishes)
    and the sessions waiting for input (vLLM ``num_waiting_for_streaming_input`` is its size)."""

    queues: dict[str, deque] = field(default_factory=dict)
    waiting_for_input: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        if not isinstance(self.queues, dict) or not all(
                isinstance(k, str) and isinstance(q, deque) for k, q in self.queues.items()):
            raise InvalidFieldError("queues", self.queues, "a dict of request id -> deque of updates")
        if not isinstance(self.waiting_for_input, set) or not self.waiting_for_input <= set(self.queues):
            raise InvalidFieldError("waiting_for_input", self.waiting_for_input, "a set of session ids in queues")

    @property
    def num_waiting_for_streaming_input(self) -> int:
        return len(self.waiting_for_input)

    def check_invariants(self, live_ids: set[str]) -> None:
        """A session waiting for input has an empty queue (vLLM asserts it in
        ``_handle_blocked_waiting_request``) and is live; every queue belongs to a live session."""
        assert self.waiting_for_input <= set(self.queues), "Q11: waiting for input but not a session"
        for rid in self.waiting_for_input:
            assert not self.queues[rid], f"Q11: session {rid} waits for input with updates queued"
        assert set(self.queues) <= live_ids, "Q12: a finished request still has a session queue"


def _check_request(request) -> None:
    if not isinstance(request, Request):
        raise InvalidFieldError("request", request, "a kvref Request")


def _check_state(state) -> None:
    if not isinstance(state, SessionState):
        raise InvalidFieldError("state", state, "a SessionState")


def update_request_as_session(request: Request, update: StreamingUpdate) -> None:
    """vLLM ``_update_request_as_session``: keep every output token but the final sampled one as
    prompt, append the update's prompt, take its ``max_tokens`` and ``arrival_time``, WAITING."""
    _check_request(request)
    if not isinstance(update, StreamingUpdate):
        raise InvalidFieldError("update", update, "a StreamingUpdate")
    all_tokens = list(request.prompt_token_ids) + list(request.output_token_ids)
    keep_end = len(all_tokens) - 1
    if keep_end < request.num_computed_tokens:
        raise InvalidFieldError("request.num_computed_tokens", request.num_computed_tokens,
                                f"at most {keep_end} (the final sampled token is never computed)")
    request.prompt_token_ids = all_tokens[:keep_end] + list(update.prompt_token_ids)
    request.output_token_ids = []
    request.max_tokens = update.max_tokens
    request.arrival_time = update.arrival_time
    request.stop_token_ids = update.stop_token_ids  # vLLM: the update's sampling_params replace the session's
    request.eos_token_id = update.eos_token_id
    request.min_tokens = update.min_tokens
    request.repetition_detection = update.repetition_detection
    request.finish_reason = None
    request.status = RequestStatus.WAITING


def handle_stopped_request(request: Request, state: SessionState) -> bool:
    """vLLM ``_handle_stopped_request`` for a stopped request; True when it is finished (not a
    session, or its next queued update is the finishing ``None``)."""
    _check_request(request)
    _check_state(state)
    if request.request_id not in state.queues:
        return True
    frontier = request.num_computed_tokens - request.num_output_placeholders
    assert frontier >= 0
    request.num_computed_tokens = frontier
    request.drop_stale_output = True
    request.num_stale_output_tokens = request.num_in_flight_tokens
    request.num_output_placeholders = 0
    queue = state.queues[request.request_id]
    if queue:
        update = queue.popleft()
        if update is None:
            del state.queues[request.request_id]
            return True
        update_request_as_session(request, update)
    else:
        request.status = RequestStatus.WAITING
        request.finish_reason = None  # vLLM: WAITING_FOR_STREAMING_REQ has no finish reason
        state.waiting_for_input.add(request.request_id)
    return False


def add_update(state: SessionState, request: Request, update: StreamingUpdate | None) -> str:
    """A second ``add_request`` for a live session: ``"queued"`` (the session runs or waits in a
    queue), ``"applied"`` (it waited for input: applied at once) or ``"finish"`` (it waited for
    input and the update is the finishing ``None``: the caller aborts it)."""
    _check_state(state)
    _check_request(request)
    rid = request.request_id
    if rid not in state.queues:
        raise InvalidFieldError("request.request_id", rid, "a live streaming session (duplicate request id)")
    if update is not None and not isinstance(update, StreamingUpdate):
        raise InvalidFieldError("update", update, "a StreamingUpdate or None (finish the session)")
    if rid not in state.waiting_for_input:
        state.queues[rid].append(update)
        return "queued"
    state.waiting_for_input.discard(rid)
    if update is None:
        return "finish"
    update_request_as_session(request, update)
    return "applied"


def forget(state: SessionState, request_id: str) -> None:
    """The session finished or was aborted: drop its queue and waiting mark."""
    _check_state(state)
    if not isinstance(request_id, str):
        raise InvalidFieldError("request_id", request_id, "a request id (str)")
    state.queues.pop(request_id, None)
    state.waiting_for_input.discard(request_id)
