"""The request as the KV-cache code sees it: tokens, progress and scheduling status.

Shared by every implementation (reference, torch, vLLM adapter) so the state machines can hand
them the same request. Mutable on purpose: like vLLM's ``Request``, the scheduler advances
``num_computed_tokens`` and ``num_in_flight_tokens``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvref.spec.errors import InvalidFieldError, check_int


@dataclass(frozen=True)
class PlaceholderRange:
    """Where a multimodal item's placeholder tokens sit in the prompt (vLLM ``PlaceholderRange``)."""

    offset: int
    length: int

    def __post_init__(self) -> None:
        check_int("mm_position.offset", self.offset, minimum=0)
        check_int("mm_position.length", self.length, minimum=1)


@dataclass(frozen=True)
class MultiModalFeatureSpec:
    """One multimodal item of a request, as the KV cache sees it (vLLM ``MultiModalFeatureSpec``):
    its ``identifier`` (the item's hash, LoRA-prefixed where applicable) goes into the hash of every
    block its placeholder range overlaps, with the item's offset relative to that block."""

    identifier: str
    mm_position: PlaceholderRange
    modality: str = "image"

    def __post_init__(self) -> None:
        if not isinstance(self.identifier, str) or not self.identifier:
            raise InvalidFieldError("mm_features[i].identifier", self.identifier, "a non-empty str")
        if not isinstance(self.mm_position, PlaceholderRange):
            raise InvalidFieldError("mm_features[i].mm_position", self.mm_position, "a PlaceholderRange")
        if not isinstance(self.modality, str):
            raise InvalidFieldError("mm_features[i].modality", self.modality, "a str such as 'image'")


@dataclass(frozen=True)
class LoRARequest:
    """The LoRA adapter a request runs with (vLLM ``LoRARequest``): its name and path enter every
    block hash (so re-pointing a name at another adapter does not reuse KV), its id and name every
    ``BlockStored`` event."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise InvalidFieldError("lora_request.lora_name", self.lora_name, "a non-empty str")
        check_int("lora_request.lora_int_id", self.lora_int_id, minimum=1)
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise InvalidFieldError("lora_request.lora_path", self.lora_path, "a non-empty str")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name


@dataclass(frozen=True)
class RepetitionDetectionParams:
    """vLLM ``RepetitionDetectionParams``: finish a request whose output ends in ``min_count``
    repetitions of an n-gram of ``min_pattern_size`` (0: 1) to ``max_pattern_size`` tokens
    (``check_stop``: status ``FINISHED_REPETITION``, checked only past ``min_tokens``)."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    def __post_init__(self) -> None:
        check_int("repetition_detection.max_pattern_size", self.max_pattern_size, minimum=0)
        check_int("repetition_detection.min_pattern_size", self.min_pattern_size, minimum=0)
        if self.min_pattern_size > self.max_pattern_size:
            raise InvalidFieldError("repetition_detection.min_pattern_size", self.min_pattern_size,
                                    f"at most max_pattern_size={self.max_pattern_size}")
        check_int("repetition_detection.min_count", self.min_count, minimum=2 if self.max_pattern_size else 0)


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
        eos_token_id: sampling it finishes the request (reason ``"stop"``; vLLM's
            ``SamplingParams.eos_token_id``, None with ``ignore_eos``).
        min_tokens: output tokens before a repetition may finish the request (vLLM's
            ``check_stop`` tests it after the stop tokens and the length caps).
        repetition_detection: a :class:`RepetitionDetectionParams` (reason ``"repetition"``), or None.
        resumable: a streaming-input session (vLLM ``Request.resumable``): a stopped turn keeps the
            request and its KV blocks for the next input chunk (:mod:`kvref.impl.reference.scheduler_sessions`).
        use_structured_output: the request's sampling is constrained by a grammar (JSON mode, a
            regex, ...; vLLM derives ``Request.use_structured_output`` from
            ``SamplingParams.structured_outputs``): it waits for its grammar before it is scheduled,
            its drafts and sampled tokens are checked against it
            (:mod:`kvref.impl.reference.scheduler_structured_output`).

    Scheduler-owned progress (vLLM ``Request`` fields of the same names):
        num_output_placeholders: async scheduling: tokens sampled by in-flight steps, not yet known.
        num_stale_output_tokens / drop_stale_output: async scheduling: in-flight output of a
            preempted request (delivered, or dropped, when it returns).
        is_prefill_chunk: after the last schedule, the request has not yet reached the end of its
            known tokens (its step samples nothing).
        finish_reason: ``"stop"``, ``"length"``, ``"repetition"`` or ``"abort"`` once FINISHED.

    Inputs of the block hashes and KV events (vLLM ``Request`` fields of the same names):
        mm_features: multimodal items, sorted by offset, not overlapping, inside the prompt.
        lora_request: the LoRA adapter, or None.
        prompt_embeds: the prompt's embeddings as raw bytes, one ``bytes`` row per prompt token
            (all rows the same length): vLLM hashes the tensor bytes of each block's rows
            (``tensor_data``), which is exactly the concatenation of these rows.
        session_id: carried into ``BlockStored`` events.
        skip_reading_prefix_cache: the request never reads the prefix cache (vLLM sets it for
            prompt logprobs and all-pooling requests); it still publishes its blocks.
        kv_cache_report_mode: ``"full"`` also announces the blocks of a prefix-cache hit in KV
            events (vLLM reads it from ``SamplingParams.extra_args``); ``"incremental"`` (default)
            only newly cached blocks.
        do_remote_prefill: the request's ``kv_transfer_params`` say ``do_remote_prefill`` (the
            decode side of a prefill/decode split: its KV comes from a remote prefill); with a KV
            connector vLLM counts it as waiting to start a KV fetch from its arrival.
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
    mm_features: tuple[MultiModalFeatureSpec, ...] = ()
    lora_request: LoRARequest | None = None
    prompt_embeds: tuple[bytes, ...] | None = None
    session_id: str | None = None
    skip_reading_prefix_cache: bool = False
    kv_cache_report_mode: str = "incremental"
    do_remote_prefill: bool = False
    eos_token_id: int | None = None
    min_tokens: int = 0
    repetition_detection: RepetitionDetectionParams | None = None
    resumable: bool = False
    use_structured_output: bool = False
    #: SWA bounded replay (vLLM ``Request.replay_start``): where the last admission's replay of
    #: its prefix hit starts (the worker has no window KV below it); set by the scheduler only
    #: (:mod:`kvref.impl.reference.scheduler_prefix_replay`)
    replay_start: int = field(default=0, compare=False)

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
        if self.eos_token_id is not None:
            check_int("eos_token_id", self.eos_token_id, minimum=0)
        check_int("min_tokens", self.min_tokens, minimum=0)
        if self.min_tokens > self.max_tokens:  # vLLM's SamplingParams refuses it too
            raise InvalidFieldError("min_tokens", self.min_tokens, f"at most max_tokens={self.max_tokens}")
        if self.repetition_detection is not None and not isinstance(self.repetition_detection,
                                                                    RepetitionDetectionParams):
            raise InvalidFieldError("repetition_detection", self.repetition_detection,
                                    "None or a RepetitionDetectionParams")
        if not isinstance(self.resumable, bool):
            raise InvalidFieldError("resumable", self.resumable, "True or False")
        if not isinstance(self.use_structured_output, bool):
            raise InvalidFieldError("use_structured_output", self.use_structured_output, "True or False")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise InvalidFieldError("cache_salt", self.cache_salt, "None or a str")
        self._check_hash_inputs()

    def _check_hash_inputs(self) -> None:
        if not isinstance(self.mm_features, (list, tuple)):
            raise InvalidFieldError("mm_features", self.mm_features, "a tuple of MultiModalFeatureSpec")
        self.mm_features = tuple(self.mm_features)
        end = 0
        for i, f in enumerate(self.mm_features):
            if not isinstance(f, MultiModalFeatureSpec):
                raise InvalidFieldError(f"mm_features[{i}]", f, "a MultiModalFeatureSpec")
            pos = f.mm_position
            if pos.offset < end or pos.offset + pos.length > len(self.prompt_token_ids):
                raise InvalidFieldError(f"mm_features[{i}].mm_position", (pos.offset, pos.length),
                                        f"a range inside the prompt ({len(self.prompt_token_ids)} tokens) after "
                                        f"the previous item (ends at {end}): sorted, not overlapping")
            end = pos.offset + pos.length
        if self.lora_request is not None and not isinstance(self.lora_request, LoRARequest):
            raise InvalidFieldError("lora_request", self.lora_request, "None or a LoRARequest")
        if self.prompt_embeds is not None:
            rows = self.prompt_embeds
            if not isinstance(rows, (list, tuple)) or len(rows) != len(self.prompt_token_ids) \
                    or not all(isinstance(r, bytes) and r and len(r) == len(rows[0]) for r in rows):
                raise InvalidFieldError("prompt_embeds", rows if not isinstance(rows, (list, tuple)) else len(rows),
                                        f"None or {len(self.prompt_token_ids)} non-empty bytes rows of one "
                                        "length (one per prompt token)")
            self.prompt_embeds = tuple(rows)
        if self.session_id is not None and not isinstance(self.session_id, str):
            raise InvalidFieldError("session_id", self.session_id, "None or a str")
        if self.kv_cache_report_mode not in ("incremental", "full"):
            raise InvalidFieldError("kv_cache_report_mode", self.kv_cache_report_mode, "'incremental' or 'full'")
        if not isinstance(self.skip_reading_prefix_cache, bool):
            raise InvalidFieldError("skip_reading_prefix_cache", self.skip_reading_prefix_cache, "True or False")
        if not isinstance(self.do_remote_prefill, bool):
            raise InvalidFieldError("do_remote_prefill", self.do_remote_prefill, "True or False")

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
