"""Plain data the schedulers exchange with their driver: config, step output, model output, snapshot.

Shared by the reference scheduler and the vLLM adapter (``kvref.impl.vllm.scheduler``) so a state
machine can compare them field by field. Everything here is ids and ints: no object identity.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvref.impl.interface import BlockIds
from kvref.spec.errors import InvalidFieldError, check_choice, check_int

FCFS = "fcfs"
PRIORITY = "priority"


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler settings kvref models (vLLM's ``SchedulerConfig`` fields of the same names).

    Args:
        max_num_batched_tokens: token budget of one step (``max_num_scheduled_tokens`` defaults to it).
        max_num_seqs: running requests at most.
        long_prefill_token_threshold: cap on one request's chunk when more than one request is
            eligible (0: off).
        enable_chunked_prefill: split prompts over steps; when off a prompt that does not fit the
            remaining budget stops the waiting loop.
        policy: ``"fcfs"`` or ``"priority"`` (lower ``(priority, arrival_time)`` first).
        scheduler_reserve_full_isl: admit a waiting request only if its whole sequence fits
            (``full_sequence_must_fit``); the gate behind the head-of-line hang of vLLM #39734.
        async_scheduling: two batches in flight (``AsyncScheduler``): output placeholders, and
            ``max_in_flight_tokens = 2 * max_num_batched_tokens``.
    """

    max_num_batched_tokens: int = 64
    max_num_seqs: int = 8
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    policy: str = FCFS
    scheduler_reserve_full_isl: bool = True
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, minimum=1)
        check_int("max_num_seqs", self.max_num_seqs, minimum=1)
        check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, minimum=0)
        check_choice("policy", self.policy, (FCFS, PRIORITY))
        for name in ("enable_chunked_prefill", "scheduler_reserve_full_isl", "async_scheduling"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidFieldError(name, getattr(self, name), "True or False")

    @property
    def max_concurrent_batches(self) -> int:
        """``VllmConfig.max_concurrent_batches`` without pipeline parallelism: 2 with async, else 1."""
        return 2 if self.async_scheduling else 1

    @property
    def max_in_flight_tokens(self) -> int:
        """``VllmConfig.max_in_flight_tokens``: what the scheduler hands its KVCacheManager
        (:func:`kvref.spec.config.max_in_flight_tokens`, the one definition)."""
        from kvref.spec.config import max_in_flight_tokens

        return max_in_flight_tokens(self.max_num_batched_tokens, self.max_concurrent_batches)


@dataclass(frozen=True)
class ScheduledRequest:
    """One request in a step's batch.

    ``kind`` is ``"new"`` (first admission), ``"resumed"`` (admitted again after preemption) or
    ``"running"``. ``block_ids`` are the whole block table for new requests (vLLM's
    ``NewRequestData.block_ids``) and the newly allocated blocks otherwise
    (``CachedRequestData.new_block_ids``; for a resumed request that is its whole new table).
    ``num_computed_tokens`` is the count before this step's tokens (prefix hits included).
    """

    request_id: str
    kind: str
    num_scheduled_tokens: int
    num_computed_tokens: int
    block_ids: BlockIds
    is_prefill_chunk: bool


@dataclass(frozen=True)
class SchedulerOutput:
    """What one ``schedule()`` returns, in batch order (running first, then admissions)."""

    scheduled: tuple[ScheduledRequest, ...]
    preempted_req_ids: frozenset[str]
    finished_req_ids: frozenset[str]

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {s.request_id: s.num_scheduled_tokens for s in self.scheduled}

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.scheduled)


@dataclass(frozen=True)
class ModelOutput:
    """The fake model runner's answer for one step: sampled token ids per request id.

    A request whose step ended inside its known tokens (a prefill chunk) samples nothing and is
    absent, as in vLLM where the runner discards those samples.
    """

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass(frozen=True)
class RequestState:
    """What a driver compares about one live or finished request."""

    request_id: str
    status: str
    num_computed_tokens: int
    num_in_flight_tokens: int
    num_output_placeholders: int
    num_stale_output_tokens: int
    output_token_ids: tuple[int, ...]
    num_preemptions: int
    finish_reason: str | None


@dataclass(frozen=True)
class SchedulerSnapshot:
    """The scheduler's observable state between calls."""

    waiting: tuple[str, ...]
    running: tuple[str, ...]
    requests: dict[str, RequestState]
    block_ids: dict[str, BlockIds]
    num_free_blocks: int
    #: block ids in free-queue order (next to allocate first) where the manager exposes it
    free_block_queue: tuple[int, ...] | None = None
