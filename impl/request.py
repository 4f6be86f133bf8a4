"""The request as the KV-cache code sees it: tokens, progress and scheduling status.

Shared by every implementation (reference, torch, vLLM adapter) so the state machines can hand
them the same request. Mutable on purpose: like vLLM's ``Request``, the scheduler advances
``num_computed_tokens`` and ``num_in_flight_tokens``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvref.spec.errors import InvalidFieldError, check_int


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass
class Request:
    """One request.

    Args:
        request_id: unique id.
        prompt_token_ids: the prompt.
        max_tokens: output tokens to generate before finishing.
        cache_salt: isolates this request's prefix-cache entries (hashed into the first block only).
        priority / arrival_time: order for the PRIORITY policy (lower first).
        stop_token_ids: sampling one of these finishes the request (vLLM's
            ``SamplingParams.stop_token_ids``; reason ``"stop"``).

    Scheduler-owned progress (vLLM ``Request`` fields of the same names):
        num_output_placeholders: async scheduling: tokens sampled by in-flight steps, not yet known.
        num_stale_output_tokens / drop_stale_output: async scheduling: in-flight output of a
            preempted request (delivered, or dropped, when it returns).
        is_prefill_chunk: after the last schedule, the request has not yet reached the end of its
            known tokens (its step samples nothing).
        finish_reason: ``"stop"``, ``"length"`` or ``"abort"`` once FINISHED.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int = 16
    cache_salt: str | None = None
    priority: int = 0
    arrival_time: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_in_flight_tokens: int = 0
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_token_ids: tuple[int, ...] = ()
    num_output_placeholders: int = 0
    num_stale_output_tokens: int = 0
    drop_stale_output: bool = False
    is_prefill_chunk: bool = False
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidFieldError("request_id", self.request_id, "a non-empty str")
        if not isinstance(self.prompt_token_ids, (list, tuple)) or not self.prompt_token_ids:
            raise InvalidFieldError("prompt_token_ids", self.prompt_token_ids, "a non-empty list of ints >= 0")
        tokens = self.prompt_token_ids
        # Fast path (C-level passes) for the common all-int case; the loop names a bad element.
        if set(map(type, tokens)) != {int} or min(tokens) < 0:
            for t in tokens:
                check_int("prompt_token_ids[i]", t, minimum=0)
        self.prompt_token_ids = list(self.prompt_token_ids)
        check_int("max_tokens", self.max_tokens, minimum=1)
        check_int("priority", self.priority)
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise InvalidFieldError("stop_token_ids", self.stop_token_ids, "a tuple of ints >= 0")
        for t in self.stop_token_ids:
            check_int("stop_token_ids[i]", t, minimum=0)
        self.stop_token_ids = tuple(self.stop_token_ids)
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise InvalidFieldError("cache_salt", self.cache_salt, "None or a str")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
