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
#: speculative methods kvref models: n-gram (no lookahead slots, no EAGLE block drop) and EAGLE-like
#: drafters ("eagle", "eagle3", "mtp": vLLM's ``use_eagle``), which reserve ``num_speculative_tokens``
#: lookahead slots per allocation and drop the trailing prefix-cache block on a hit.
NGRAM = "ngram"
EAGLE = "eagle"
SPECULATIVE_METHODS = (NGRAM, EAGLE)


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler settings kvref models (vLLM's ``SchedulerConfig`` fields of the same names).

    Args:
        max_num_batched_tokens: input budget of one step: the tokens the runner takes (vLLM's
            ``input_budget``; ``max_num_scheduled_tokens`` defaults to it).
        max_num_scheduled_tokens: the tokens the scheduler may issue in one step (vLLM's field of
            that name, ``--max-num-scheduled-tokens``; None: ``max_num_batched_tokens``). vLLM
            keeps two budgets, this one and the input budget, and takes both down by every
            scheduled chunk, so a step schedules at most the smaller of the two (drafting slots,
            which would charge the input budget alone, are 0 for the drafters kvref models:
            n-gram, EAGLE, MTP). The Mamba ``align`` split caps a chunk by this value alone.
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
        num_speculative_tokens: speculative decoding: drafts per request per step (vLLM's
            ``SpeculativeConfig.num_speculative_tokens``; 0: off). Rules in
            :mod:`kvref.impl.reference.scheduler_spec_decode`.
        speculative_method: ``"ngram"`` or ``"eagle"`` (EAGLE/EAGLE3/MTP: vLLM's ``use_eagle``):
            an EAGLE-like drafter reserves ``num_lookahead_tokens`` KV slots past each step and its
            KV manager drops the trailing block of a prefix hit (``pool.use_eagle`` must say so).
        skip_unused_drafts: vLLM's ``Scheduler.can_skip_drafts`` (a drafter with lookahead slots
            under the V2 model runner, the GPU default): a step whose drafts no request can use
            says ``skip_drafts`` and the runner proposes none.
        long_prefill_token_threshold_adaptive: floor a nonzero ``long_prefill_token_threshold``
            at ``max_num_batched_tokens // (running + waiting requests)`` (vLLM's field of that
            name; :mod:`kvref.impl.reference.scheduler_cadence`).
        prefill_schedule_interval: vLLM's local prefill cadence: while a decode runs, prefill
            (new admissions and running chunks alike) is held until this many executed steps
            passed since the last prefill-carrying step; 1: off
            (:mod:`kvref.impl.reference.scheduler_cadence`).
        max_num_active_seqs: admission into ``running`` stops at this many requests (vLLM's field:
            smaller decode batches without shrinking the runner's ``max_num_seqs`` slots); None:
            ``max_num_seqs``.
        spec_decode_metrics_level: per-request speculative-decoding metrics (vLLM's
            ``ObservabilityConfig.per_request_spec_decode_metrics``): ``"none"``, ``"summary"``
            (per request a histogram of accepted drafts per verify step and the drafts proposed)
            or ``"detailed"`` (also the per-step sequences); :class:`RequestSpecDecodeMetrics`.
    """

    max_num_batched_tokens: int = 64
    max_num_seqs: int = 8
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    policy: str = FCFS
    scheduler_reserve_full_isl: bool = True
    async_scheduling: bool = False
    num_speculative_tokens: int = 0
    speculative_method: str = NGRAM
    skip_unused_drafts: bool = False
    long_prefill_token_threshold_adaptive: bool = False
    prefill_schedule_interval: int = 1
    max_num_active_seqs: int | None = None
    spec_decode_metrics_level: str = "none"
    max_num_scheduled_tokens: int | None = None

    def __post_init__(self) -> None:
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, minimum=1)
        check_int("max_num_scheduled_tokens", self.max_num_scheduled_tokens, minimum=1, allow_none=True)
        check_int("max_num_seqs", self.max_num_seqs, minimum=1)
        check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, minimum=0)
        check_choice("policy", self.policy, (FCFS, PRIORITY))
        check_int("prefill_schedule_interval", self.prefill_schedule_interval, minimum=1)
        check_int("max_num_active_seqs", self.max_num_active_seqs, minimum=1, allow_none=True)
        if self.max_num_active_seqs is not None and self.max_num_active_seqs > self.max_num_seqs:
            raise InvalidFieldError("max_num_active_seqs", self.max_num_active_seqs,  # as vLLM's config
                                    f"at most max_num_seqs={self.max_num_seqs} (or None)")
        for name in ("enable_chunked_prefill", "scheduler_reserve_full_isl", "async_scheduling",
                     "skip_unused_drafts", "long_prefill_token_threshold_adaptive"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidFieldError(name, getattr(self, name), "True or False")
        check_int("num_speculative_tokens", self.num_speculative_tokens, minimum=0)
        check_choice("speculative_method", self.speculative_method, SPECULATIVE_METHODS)
        check_choice("spec_decode_metrics_level", self.spec_decode_metrics_level, SPEC_DECODE_METRICS_LEVELS)
        if self.num_speculative_tokens and 0 < self.long_prefill_token_threshold < 1 + self.num_speculative_tokens:
            # vLLM 0.33.0 pads a one-token admission beside a running decode to 1 + k tokens, then
            # cuts it to the threshold and fails ``assert num_new_tokens == 1 + self.num_spec_tokens``
            # inside schedule(); kvref refuses the config (docs/differences.md)
            raise InvalidFieldError("long_prefill_token_threshold", self.long_prefill_token_threshold,
                                    f"0 or at least 1 + num_speculative_tokens = {1 + self.num_speculative_tokens}")
        if self.num_lookahead_tokens >= self.max_num_batched_tokens:
            # VllmConfig._set_max_num_scheduled_tokens refuses this at startup
            raise InvalidFieldError("num_speculative_tokens", self.num_speculative_tokens,
                                    f"fewer lookahead slots than max_num_batched_tokens={self.max_num_batched_tokens}")

    @property
    def use_eagle(self) -> bool:
        """vLLM's ``Scheduler.use_eagle_block_drop`` (handed to the KV manager as ``use_eagle``)."""
        return self.num_speculative_tokens > 0 and self.speculative_method == EAGLE

    @property
    def num_lookahead_tokens(self) -> int:
        """``VllmConfig.num_lookahead_tokens``: KV slots past the scheduled tokens that the drafter
        writes (``num_speculative_tokens`` for EAGLE-like drafters, 0 for n-gram)."""
        return self.num_speculative_tokens if self.use_eagle else 0

    @property
    def can_skip_drafts(self) -> bool:
        """vLLM's ``Scheduler.can_skip_drafts``: ``num_lookahead_tokens > 0`` and the V2 runner."""
        return self.skip_unused_drafts and self.num_lookahead_tokens > 0

    @property
    def scheduled_tokens_cap(self) -> int:
        """vLLM's ``Scheduler.max_num_scheduled_tokens``: the configured value, else
        ``max_num_batched_tokens`` (the Mamba ``align`` split's chunk cap)."""
        return self.max_num_batched_tokens if self.max_num_scheduled_tokens is None else self.max_num_scheduled_tokens

    @property
    def step_token_budget(self) -> int:
        """The tokens one step may schedule: the smaller of vLLM's two budgets (``token_budget``
        from ``max_num_scheduled_tokens``, ``input_budget`` from ``max_num_batched_tokens``), which
        every scheduled chunk takes down alike."""
        return min(self.scheduled_tokens_cap, self.max_num_batched_tokens)

    @property
    def max_num_active_reqs(self) -> int:
        """vLLM's ``Scheduler.max_num_active_reqs``: the admission limit of the waiting loop."""
        return self.max_num_active_seqs if self.max_num_active_seqs is not None else self.max_num_seqs

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

    def engine_settings(self) -> dict:
        """The :class:`~kvref.spec.config.EngineConfig` fields this scheduler config decides
        (``max_num_batched_tokens``, ``max_num_seqs``, ``max_concurrent_batches``): vLLM keeps them in
        its ``SchedulerConfig`` and its startup sizing reads them, so every road from a scheduler to
        a startup plan takes them from here, never field by field (#26: four copies of this mapping
        had grown in the liveness oracle, the machines' pool road, the demo and its planner)."""
        return dict(max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs,
                    max_concurrent_batches=self.max_concurrent_batches)


def engine_config_for(config: SchedulerConfig, *, groups, max_model_len: int, scheduler_block_size: int,
                      hash_block_size: int, enable_caching: bool, num_blocks: int | None = None):
    """The :class:`~kvref.spec.config.EngineConfig` a user gives vLLM for a pool with these fields
    under ``config``: the one mapping from a runtime pool back to startup's arguments (#26).

    The scheduler's settings come from :meth:`SchedulerConfig.engine_settings`; the pool gives
    ``block_size`` (its ``scheduler_block_size``), ``max_model_len``, prefix caching, the Mamba
    cache mode of its Mamba groups (vLLM has one per engine) and, for a hybrid pool with caching,
    its ``hash_block_size`` as the explicit hash unit (``prefix_match_unit``); ``num_blocks`` (with
    the null block) becomes ``num_gpu_blocks_override``. :func:`~kvref.spec.planning.plan_kv_cache`
    on the result plans the pool startup would build for it, and the startup bounds
    (``max_memory_usage_blocks``) read the same values the scheduler runs with.
    """
    from kvref.spec.config import EngineConfig
    from kvref.spec.kv_cache_interface import MambaSpec

    from kvref.spec.kv_cache_interface import KVCacheGroupSpec

    if not isinstance(config, SchedulerConfig):
        raise InvalidFieldError("config", config, "a SchedulerConfig")
    if not isinstance(groups, (list, tuple)) or not groups \
            or not all(isinstance(g, KVCacheGroupSpec) for g in groups):
        raise InvalidFieldError("groups", groups, "a non-empty tuple of KVCacheGroupSpec")
    for name, value in (("max_model_len", max_model_len), ("scheduler_block_size", scheduler_block_size),
                        ("hash_block_size", hash_block_size)):
        check_int(name, value, minimum=1)
    check_int("num_blocks", num_blocks, minimum=1, allow_none=True)
    if not isinstance(enable_caching, bool):
        raise InvalidFieldError("enable_caching", enable_caching, "True or False")
    modes = {g.kv_cache_spec.mamba_cache_mode for g in groups if isinstance(g.kv_cache_spec, MambaSpec)}
    hybrid_hashing = len(groups) > 1 and enable_caching
    return EngineConfig(block_size=scheduler_block_size, max_model_len=max_model_len,
                        num_gpu_blocks_override=num_blocks, enable_prefix_caching=enable_caching,
                        mamba_cache_mode=modes.pop() if modes else "none",
                        prefix_match_unit=hash_block_size if hybrid_hashing else None, **config.engine_settings())


def check_scheduler_pool(pool: object, config: object) -> None:
    """The rules that tie a pool to the scheduler driving it, checked once for every scheduler
    (the reference's and vLLM's adapter: #26, each rule checked once; they used to check different
    subsets, so a pool one accepted the other ran silently).

    * ``pool.max_in_flight_tokens == config.max_in_flight_tokens``: vLLM's scheduler hands its
      ``KVCacheManager`` ``VllmConfig.max_in_flight_tokens``; another value would size the
      sliding-window admission caps for a different pipeline depth (vLLM #39734 / #35541).
    * ``config.long_prefill_token_threshold <= pool.max_model_len`` (a chunk cap above every
      request is a config error, not a cap).
    * ``pool.use_eagle`` says what the drafter does: an EAGLE-like drafter drops the trailing hit
      block (vLLM's ``use_eagle_block_drop``) unless its block hashes cover the lookahead tokens
      (``num_hash_lookahead_tokens > 0``), and without one nothing is dropped.

    Raises:
        InvalidFieldError: naming the field of the first rule broken.
    """
    from kvref.impl.interface import PoolConfig

    if not isinstance(pool, PoolConfig):
        raise InvalidFieldError("pool", pool, "a PoolConfig")
    if not isinstance(config, SchedulerConfig):
        raise InvalidFieldError("config", config, "a SchedulerConfig")
    if pool.max_in_flight_tokens != config.max_in_flight_tokens:
        raise InvalidFieldError("pool.max_in_flight_tokens", pool.max_in_flight_tokens,
                                f"config.max_in_flight_tokens={config.max_in_flight_tokens}")
    if config.long_prefill_token_threshold > pool.max_model_len:
        raise InvalidFieldError("long_prefill_token_threshold", config.long_prefill_token_threshold,
                                f"at most max_model_len={pool.max_model_len}")
    if config.use_eagle and not pool.num_hash_lookahead_tokens and not pool.use_eagle:
        raise InvalidFieldError("pool.use_eagle", pool.use_eagle,
                                "True for an EAGLE-like drafter (or num_hash_lookahead_tokens > 0)")
    if pool.use_eagle and not config.use_eagle:
        raise InvalidFieldError("pool.use_eagle", pool.use_eagle,
                                "False without an EAGLE-like drafter (speculative_method='eagle')")


@dataclass(frozen=True)
class ScheduledRequest:
    """One request in a step's batch.

    ``kind`` is ``"new"`` (first admission), ``"resumed"`` (admitted again after preemption) or
    ``"running"``. ``block_ids`` are the whole block table for new requests (vLLM's
    ``NewRequestData.block_ids``) and the newly allocated blocks otherwise
    (``CachedRequestData.new_block_ids``; for a resumed request that is its whole new table).
    ``num_computed_tokens`` is the count before this step's tokens (prefix hits included).
    ``spec_token_ids`` are the draft tokens scheduled for verification in this step (vLLM's
    ``scheduled_spec_decode_tokens[request_id]``; ``-1`` for placeholders), counted in
    ``num_scheduled_tokens``.
    """

    request_id: str
    kind: str
    num_scheduled_tokens: int
    num_computed_tokens: int
    block_ids: BlockIds
    is_prefill_chunk: bool
    spec_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class SchedulerOutput:
    """What one ``schedule()`` returns, in batch order (running first, then admissions).

    ``skip_drafts``: no request of the step can use drafts proposed after it (only with
    ``SchedulerConfig.can_skip_drafts``); the model runner then proposes none.
    """

    scheduled: tuple[ScheduledRequest, ...]
    preempted_req_ids: frozenset[str]
    finished_req_ids: frozenset[str]
    skip_drafts: bool = False

    @property
    def scheduled_spec_decode_tokens(self) -> dict[str, tuple[int, ...]]:
        return {s.request_id: s.spec_token_ids for s in self.scheduled if s.spec_token_ids}

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
    absent, as in vLLM where the runner discards those samples. With speculative decoding a
    request that verified drafts samples ``1 + accepted`` tokens (the accepted drafts and the
    bonus token); the scheduler rolls back what it rejected.
    """

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass(frozen=True)
class DraftTokenIds:
    """vLLM's ``DraftTokenIds``: drafts the (synchronous) runner proposed after a step, handed to
    ``update_draft_token_ids`` before the next ``schedule()``."""

    req_ids: tuple[str, ...]
    draft_token_ids: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if not isinstance(self.req_ids, (list, tuple)) or not all(isinstance(r, str) for r in self.req_ids):
            raise InvalidFieldError("req_ids", self.req_ids, "a tuple of request ids (str)")
        if not isinstance(self.draft_token_ids, (list, tuple)) or len(self.draft_token_ids) != len(self.req_ids):
            raise InvalidFieldError("draft_token_ids", self.draft_token_ids,
                                    f"one draft list per request id ({len(self.req_ids)})")
        for ids in self.draft_token_ids:
            # -1 pads a draft slot the drafter left empty (vLLM's ngram_gpu); the scheduler keeps it
            if not isinstance(ids, (list, tuple)) or any(type(t) is not int or t < -1 for t in ids):
                raise InvalidFieldError("draft_token_ids[i]", ids, "a list of token ids >= 0 (or -1 padding)")
        object.__setattr__(self, "req_ids", tuple(self.req_ids))
        object.__setattr__(self, "draft_token_ids", tuple(tuple(ids) for ids in self.draft_token_ids))


@dataclass(frozen=True)
class SpecDecodingStats:
    """vLLM's ``SpecDecodingStats`` of one ``update_from_output`` (``make_spec_decoding_stats``):
    verified drafts, draft tokens, accepted tokens, and both per draft position."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: tuple[int, ...] = ()
    num_draft_tokens_per_pos: tuple[int, ...] = ()


#: vLLM's ``ObservabilityConfig.per_request_spec_decode_metrics`` values
SPEC_DECODE_METRICS_LEVELS = ("none", "summary", "detailed")


@dataclass(frozen=True)
class RequestSpecDecodeMetrics:
    """vLLM's per-request ``RequestSpecDecodeMetrics`` (``vllm/v1/metrics/stats.py``), as a value:
    ``histogram[j]`` counts the verify steps that accepted ``j`` drafts (``num_spec_tokens + 1``
    entries), ``num_draft_tokens`` the drafts proposed less the grammar-invalid ones, and with the
    ``"detailed"`` level the per-step accepted / proposed counts in order. The scheduler observes
    it in ``update_from_output`` for every verified step, stale ones included, and the engine
    reports it with the request's finishing output."""

    histogram: tuple[int, ...]
    num_draft_tokens: int = 0
    per_step_accepted: tuple[int, ...] = ()
    per_step_drafted: tuple[int, ...] = ()


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
    #: drafts waiting to be verified in the next step (vLLM ``Request.spec_token_ids``); live requests only
    spec_token_ids: tuple[int, ...] = ()


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
    #: waiting requests that hold KV blocks (KV-connector loads), drained before ``waiting``
    #: (vLLM ``Scheduler.kv_holding_waiting``)
    kv_holding_waiting: tuple[str, ...] = ()
    #: structured-output requests whose grammar is not ready (vLLM status
    #: ``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR``; their status reads ``waiting``), sorted
    waiting_for_grammar: tuple[str, ...] = ()
