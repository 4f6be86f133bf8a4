"""The scheduler subset of vLLM 0.33.0's ``Scheduler`` that decides who gets KV blocks and when.

Modelled: waiting and running queues, the token budget, chunked prefill (and its absence),
``long_prefill_token_threshold``, prefix-cache hits on admission, FCFS and PRIORITY preemption by
recompute, finishing (``max_tokens``, ``max_model_len``, stop token ids, EOS, ``min_tokens`` and
repetition detection: :mod:`kvref.impl.reference.scheduler_stop`; abort), the
full-sequence admission gate (``scheduler_reserve_full_isl``), and async scheduling's output
placeholders, in-flight tokens and stale output of preempted requests.

Speculative decoding (drafts, verification, rollback, lookahead slots, padding, stats, async
placeholders) lives in :mod:`kvref.impl.reference.scheduler_spec_decode`, called at small hooks.

KV connectors (``kv_holding_waiting``, sync and async loads, ``WAITING_FOR_REMOTE_KVS``, failed
loads under both failure policies, delayed frees, ``reset_prefix_cache(reset_connector=...)``,
MultiConnector) live in :mod:`kvref.impl.reference.scheduler_connector`, called at small hooks
when the scheduler is built with a ``connector``.

Pause states (``set_pause_state``: :mod:`kvref.impl.reference.scheduler_pause`) and the request
counts the engine polls (``get_request_counts``, ``get_num_unfinished_requests``,
``has_finished_requests``, ``get_kv_cache_usage``) are modelled too.

The adaptive long-prefill threshold and the local prefill cadence (``prefill_schedule_interval``)
live in :mod:`kvref.impl.reference.scheduler_cadence` (the cadence without a KV connector only).

Encoder inputs (the encoder compute budget and cache that cut a multimodal request's chunk) live
in :mod:`kvref.impl.reference.scheduler_encoder` (without a KV connector).

LoRA's ``max_loras`` admission rule lives in :mod:`kvref.impl.reference.scheduler_lora`.

Streaming-input sessions (``resumable`` requests: updates, stopped turns kept with their KV blocks
in ``kv_holding_waiting``) live in :mod:`kvref.impl.reference.scheduler_sessions`.

Structured output (a request waiting for its grammar, a failed grammar finishing it, drafts cut to
what the grammar accepts, sampled tokens it rejects) lives in
:mod:`kvref.impl.reference.scheduler_structured_output` (without a KV connector; the grammar's answers
come from a :class:`~kvref.impl.reference.scheduler_structured_output.GrammarOracle`).

Not modelled: a KV connector's deferred frees under async scheduling, pipeline parallelism, DP
prefill throttling, the grammar bitmask (outside the KV cache).

The scheduling rules, in the order ``schedule()`` applies them:

1. **Running requests first**, in ``running`` order. Each asks for every token it has not computed
   (``num_tokens + num_output_placeholders - num_computed_tokens``), cut to the long-prefill
   threshold (only when more than one request is eligible), the remaining budget and
   ``max_model_len - num_computed_tokens - 1`` (room for the sampled token). If its blocks do
   not fit, the scheduler preempts the *last* running request (FCFS) or the one with the largest
   ``(priority, arrival_time)`` (PRIORITY), frees its blocks, resets it to zero computed tokens and
   puts it at the head of the waiting queue, until the allocation fits or the request preempted
   itself. A failed request stops the running loop (FCFS); under PRIORITY a request that
   preempted itself lets the loop go on.
2. **Waiting requests** only if nobody was preempted this step. The head of the queue is tried
   with its prefix hit and ``full_sequence_must_fit=scheduler_reserve_full_isl``; if it does not
   fit, the waiting loop **stops** (head-of-line blocking: later requests are not tried). A request
   whose gate can never pass therefore blocks the queue forever — vLLM #39734 / #35541; kvref
   keeps this behaviour and makes it impossible by a startup check (see
   :func:`kvref.impl.reference.scheduler_liveness.startup_consistent`).
3. Every scheduled request advances ``num_computed_tokens`` and ``num_in_flight_tokens`` by its
   tokens now (``_update_after_schedule``); ``update_from_output`` settles the in-flight count and
   appends sampled tokens.
"""

from __future__ import annotations

from typing import Iterable

from kvref.impl.interface import BlockIds, KVCacheManagerLike, PoolConfig
from kvref.impl.request import Request, RequestStatus
from kvref.spec.errors import InvalidFieldError

from .scheduler_queue import WaitingQueue
from .scheduler_pause import PauseState, as_pause_state
from . import scheduler_connector as _conn
from . import scheduler_connector_stats as _conn_stats
from .scheduler_spec_decode import SpecDecodeState
from .scheduler_mamba_split import split_scheduled_chunk
from .scheduler_prefill_lookahead import reserve_prefill_lookahead
from . import scheduler_prefix_replay as _replay
from .scheduler_cadence import PrefillCadence, adaptive_long_prefill_threshold
from . import scheduler_encoder as _enc
from . import scheduler_lora as _lora
from .scheduler_stop import stop_reason
from . import scheduler_sessions as _sess
from . import scheduler_aux_output as _aux
from . import scheduler_structured_output as _so
from kvref.impl.scheduler_types import (
    PRIORITY,
    check_scheduler_pool,
    DraftTokenIds,
    ModelOutput,
    RequestSpecDecodeMetrics,
    RequestState,
    ScheduledRequest,
    SchedulerConfig,
    SchedulerOutput,
    SchedulerSnapshot,
    SpecDecodingStats,
)

#: the ``PrefixCacheStats`` fields ``make_stats`` reports (vLLM's, ``hits_by_source`` aside: connectors)
PREFIX_CACHE_STATS_FIELDS = ("reset", "requests", "queries", "hits", "preempted_requests", "preempted_queries",
                             "preempted_hits")

# Generative models sample one token per step (vLLM ``num_sampled_tokens_per_step``).
NUM_SAMPLED_TOKENS_PER_STEP = 1


def _default_kv_cache_manager(pool: PoolConfig) -> KVCacheManagerLike:
    from .adapter import ReferenceKVCacheManager

    return ReferenceKVCacheManager(pool)


def _cache_blocks(kv, request: Request, num_computed_tokens: int) -> None:
    """vLLM ``KVCacheManager.cache_blocks``: publish the request's full blocks up to a token count.

    Uses the manager's own ``cache_blocks`` when it has one; the reference protocol adapter does
    not (yet), so fall back to its coordinator, as vLLM's manager does.
    """
    if hasattr(kv, "cache_blocks"):
        kv.cache_blocks(request, num_computed_tokens)
        return
    manager = getattr(kv, "manager", None)
    if manager is not None and manager.enable_caching:
        manager.coordinator.cache_blocks(request, manager.block_hashes(request), num_computed_tokens)


def _record_prefix_cache_stats(kv, request: Request, num_hits: int) -> None:
    """vLLM records a waiting request's local prefix-cache lookup at admission only ("so
    unscheduled lookups are not counted"): a request the loop stops at is counted when it is
    admitted, once. Managers without stats (vLLM-twin test doubles) record nothing."""
    record = getattr(kv, "record_prefix_cache_stats", None)
    if record is not None:
        record(request, num_hits)


class Scheduler:
    """vLLM's scheduler loop over any :class:`~kvref.impl.interface.KVCacheManagerLike`.

    Args:
        pool: the KV cache plan; ``pool.max_in_flight_tokens`` must equal
            ``config.max_in_flight_tokens`` (vLLM's scheduler hands its manager
            ``VllmConfig.max_in_flight_tokens``; a different value would size the sliding-window
            cap differently from what the scheduler keeps in flight).
        config: scheduler settings.
        kv_cache_manager: the manager to drive (default: the reference ``KVCacheManager(pool)``).
        record_prefix_cache_stats: record each admission's prefix-cache lookup in the manager's
            stats (what ``make_stats`` reports), as vLLM's scheduler does.
        encoder_budget: the encoder limits of a multimodal model
            (:class:`~kvref.impl.reference.scheduler_encoder.EncoderBudget`; None: a text model's).
        max_loras: vLLM ``LoRAConfig.max_loras`` (None: LoRA off; :mod:`.scheduler_lora`).
        use_v2_model_runner: the workers run vLLM's V2 model runner: resumed requests are sent as
            new ones, and steps carry the encoder-input updates (:mod:`.scheduler_encoder`).
        include_finished_set: each ``update_from_output`` reports the requests freed since the
            previous one (vLLM's ``EngineCoreOutputs.finished_requests``, which the engine core
            asks for with several data-parallel engines): :attr:`finished_requests`.
        grammar_oracle: the answers about structured-output requests' grammars
            (:class:`~kvref.impl.reference.scheduler_structured_output.GrammarOracle`); None: a
            request with ``use_structured_output`` is refused.
    """

    def __init__(self, pool: PoolConfig, config: SchedulerConfig,
                 kv_cache_manager: KVCacheManagerLike | None = None,
                 connector: _conn.ScriptedConnector | None = None,
                 record_prefix_cache_stats: bool = False,
                 encoder_budget: _enc.EncoderBudget | None = None, max_loras: int | None = None,
                 use_v2_model_runner: bool = False, include_finished_set: bool = False,
                 aux_output: bool = False, grammar_oracle: _so.GrammarOracle | None = None) -> None:
        check_scheduler_pool(pool, config)  # the pool <-> scheduler rules, shared with vLLM's adapter
        if not isinstance(record_prefix_cache_stats, bool):
            raise InvalidFieldError("record_prefix_cache_stats", record_prefix_cache_stats, "True or False")
        self.pool = pool
        self.config = config
        # vLLM's scheduler records each admission's prefix-cache lookup in its KV cache manager
        # (``make_stats``). Off by default: the check-run replay (models/run_check/replay.py)
        # records at the same point itself, and would count every admission twice.
        self.records_prefix_cache_stats = record_prefix_cache_stats
        self.max_model_len = pool.max_model_len
        self.kv_cache_manager = kv_cache_manager if kv_cache_manager is not None else _default_kv_cache_manager(pool)
        self.requests: dict[str, Request] = {}  # live requests (finished ones are dropped)
        self.waiting = WaitingQueue(config.policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()  # since the last schedule()
        self.preempted_req_ids: set[str] = set()  # since the last schedule()
        self._in_flight: dict[int, SchedulerOutput] = {}
        self.pause_state = PauseState.UNPAUSED  # vLLM ``Scheduler._pause_state``
        self._published_kv_events: list[list[dict]] = []  # batches not yet taken by the caller
        # SWA bounded replay: the one replay window of the pool (:mod:`.scheduler_prefix_replay`;
        # beside a KV connector, :mod:`.scheduler_connector`)
        self.prefix_replay_tokens = _replay.prefix_replay_tokens(pool)
        # KV connector flows (vLLM's connector paths): :mod:`.scheduler_connector`
        self.connector_state = _conn.make_state(connector, config, pool) if connector is not None else None
        self.spec_decode = SpecDecodeState(config)
        if connector is not None and config.prefill_schedule_interval > 1:
            raise InvalidFieldError("config.prefill_schedule_interval", config.prefill_schedule_interval,
                                    "1 with a KV connector (kvref models the prefill cadence without one)")
        self.cadence = PrefillCadence(config)  # prefill cadence (:mod:`.scheduler_cadence`)
        self._num_invalid_spec_tokens: dict[int, dict[str, int]] = {}  # id(output) -> invalid drafts
        # encoder inputs of multimodal requests (:mod:`.scheduler_encoder`)
        self.encoder = _enc.EncoderState(encoder_budget if encoder_budget is not None else _enc.EncoderBudget(),
                                         use_v2_model_runner)
        self.use_v2_model_runner = use_v2_model_runner
        self.max_loras = _lora.check_max_loras(max_loras)
        if self.max_loras is not None and connector is not None:
            raise InvalidFieldError("max_loras", max_loras, "None with a KV connector (kvref models LoRA without one)")
        self.sessions = _sess.SessionSteps(config.policy)  # streaming-input sessions (:mod:`.scheduler_sessions`)
        if not isinstance(include_finished_set, bool) or (include_finished_set and connector is not None):
            raise InvalidFieldError("include_finished_set", include_finished_set,
                                    "True or False (True only without a KV connector)")
        # vLLM ``finished_req_ids_dict`` (one client): ids freed since the last update_from_output
        self._finished_since_output: set[str] | None = set() if include_finished_set else None
        #: the set the last ``update_from_output`` reported (None: none, or include_finished_set off)
        self.finished_requests: frozenset[str] | None = None
        #: a recorded run's finish order, handed over by check-run's replay for one update: where
        #: vLLM walks a ``set`` of request ids (the encoder-cache mismatch errors), the order is the
        #: recording process's string-hash order, which the replaying process cannot reproduce;
        #: None: this process's own set order (what vLLM does beside it, in conformance)
        self.finish_order_hint: tuple[str, ...] | None = None
        if not isinstance(aux_output, bool):
            raise InvalidFieldError("aux_output", aux_output, "True or False")
        #: vLLM's aux-output (routed-experts) connector when ``aux_output_config.enabled``: caps
        #: prefix hits at the blocks whose routing it can serve (:mod:`.scheduler_aux_output`)
        self.aux_output = _aux.AuxOutputControl(self.kv_cache_manager, pool, connector is not None) \
            if aux_output else None
        if grammar_oracle is not None and connector is not None:
            raise InvalidFieldError("grammar_oracle", grammar_oracle,
                                    "None with a KV connector (kvref models structured output without one)")
        #: structured output: requests waiting for their grammar, compile errors (:mod:`.scheduler_structured_output`)
        self.structured = _so.StructuredOutputState(grammar_oracle)

    # ---- arrivals and aborts --------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a new request.

        vLLM's input processor (not its scheduler) rejects prompts of ``max_model_len`` tokens or
        more; kvref rejects them here so every queued request can be served.
        """
        if not isinstance(request, Request):
            raise InvalidFieldError("request", request, "a kvref Request")
        if request.request_id in self.requests and self.sessions.is_session(request.request_id):
            if request.status != RequestStatus.WAITING or request.num_computed_tokens or request.output_token_ids:
                raise InvalidFieldError("request.status", request.status.value, "a fresh WAITING request (an update)")
            return _sess.add_update(self, request)  # a streaming session's next input (or its end)
        if request.request_id in self.requests:
            raise InvalidFieldError("request.request_id", request.request_id, "an id not already queued")
        if any(sr.request_id == request.request_id for out in self._in_flight.values() for sr in out.scheduled):
            # an aborted request's step is still in flight: its update would land on the new request
            raise InvalidFieldError("request.request_id", request.request_id,
                                    "an id no step still in flight names (ids are unique, as in vLLM)")
        if request.status != RequestStatus.WAITING or request.num_computed_tokens or request.output_token_ids:
            raise InvalidFieldError("request.status", request.status.value, "a fresh WAITING request")
        if request.num_prompt_tokens >= self.max_model_len:
            raise InvalidFieldError("len(request.prompt_token_ids)", request.num_prompt_tokens,
                                    f"fewer than max_model_len={self.max_model_len} tokens")
        if request.mm_features and self.connector_state is not None:
            raise InvalidFieldError("request.mm_features", len(request.mm_features),
                                    "none with a KV connector (kvref models encoder inputs without one)")
        if request.use_structured_output and request.resumable:
            raise InvalidFieldError("request.use_structured_output", True,
                                    "False for a resumable request (kvref models structured output without sessions)")
        self.structured.add(request)  # with structured output: waits for its grammar (refused without an oracle)
        _sess.check_new_session(self, request)
        self.requests[request.request_id] = request
        self.waiting.add_request(request)
        if request.use_structured_output:
            # vLLM _enqueue_waiting_request: a blocked status (waiting for its grammar) is deferred from
            # arrival (deferred_waiting: num_skipped_waiting_reqs, the prefill cadence's capacity test)
            self.cadence.note_skipped(request)
        self.spec_decode.add(request.request_id)
        if request.resumable:
            _sess.add_session(self, request)
        if self.connector_state is not None:
            self.connector_state.connector.on_new_request(request.request_id)
            if request.do_remote_prefill:  # vLLM counts P/D requests from arrival (all run slots may be taken)
                _conn_stats.set_kv_fetch_stage(self.connector_state, request.request_id,
                                               _conn_stats.KV_FETCH_WAITING_TO_START)

    def finish_requests(self, request_ids: str | Iterable[str]) -> list[Request]:
        """Abort requests (unknown or finished ids are ignored, as in vLLM); free their blocks.
        ``None`` aborts every live request (vLLM: "If request_ids is None, all requests will be
        finished")."""
        if request_ids is None:
            request_ids = list(self.requests)
        if isinstance(request_ids, str):
            ids: tuple = (request_ids,)
        elif isinstance(request_ids, (list, tuple, set, frozenset)):
            ids = tuple(request_ids)
        else:
            raise InvalidFieldError("request_ids", request_ids, "a request id or a list/tuple/set of them")
        for rid in ids:
            if not isinstance(rid, str):
                raise InvalidFieldError("request_ids[i]", rid, "a request id (str)")
        if self.connector_state is not None:
            return _conn.finish_requests(self, ids if isinstance(request_ids, str) else set(ids), "abort")
        return self._finish(ids, "abort")

    def _finish(self, ids, reason: str) -> list[Request]:
        """Finish the live requests among ``ids``, in that order, with ``reason``; free them."""
        valid = [self.requests[r] for r in dict.fromkeys(ids) if r in self.requests]
        gone = {id(r) for r in valid}
        self.running = [r for r in self.running if id(r) not in gone]
        self.waiting.remove_requests(valid)
        for request in valid:
            _sess.forget(self, request)  # a session: its updates, its wait and its KV-holding place go
            request.status = RequestStatus.FINISHED
            request.finish_reason = reason
            self._free_request(request)
        return valid

    # ---- one step -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch: running requests first, then waiting ones (see module docstring)."""
        cfg = self.config
        limit = 2 if cfg.async_scheduling else 1
        if len(self._in_flight) >= limit:
            # vLLM's engine never does this (its batch queue holds max_concurrent_batches steps);
            # scheduling again would advance the requests past tokens never computed
            raise InvalidFieldError("schedule()", f"{len(self._in_flight)} step(s) not yet updated",
                                    f"at most {limit} step(s) in flight ({'async' if limit == 2 else 'synchronous'}"
                                    " scheduling): call update_from_output first")
        kv = self.kv_cache_manager
        # vLLM keeps token_budget (max_num_scheduled_tokens) and input_budget (max_num_batched_tokens)
        # and takes both down by every chunk: the step is bounded by the smaller one
        token_budget = cfg.step_token_budget
        if self.pause_state == PauseState.PAUSED_ALL:
            token_budget = 0  # vLLM: paused, nothing is scheduled (running requests keep their blocks)
        scheduled: dict[str, tuple[Request, str, int, BlockIds]] = {}
        preempted: list[Request] = []
        spec = self.spec_decode
        spec.start_step()
        self.encoder.start_step()
        prefill_scheduled = False  # a running prefill chunk in the batch (no spec-decode padding)
        if hasattr(kv, "new_step_starts"):
            kv.new_step_starts()

        # The threshold only protects other requests from a long prefill (vLLM: "when it is the
        # only request there is nobody to starve").
        num_eligible = sum(self.get_request_counts())
        long_prefill = cfg.long_prefill_token_threshold if num_eligible > 1 else 0
        long_prefill = adaptive_long_prefill_threshold(cfg, long_prefill, num_eligible)
        defer_prefills = self.cadence.defer_prefills(self.running)

        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            if (request.num_output_placeholders > 0
                    and request.num_computed_tokens + 2 - request.num_output_placeholders
                    >= request.num_prompt_tokens + request.max_tokens):
                # Async: the step in flight already reaches max_tokens; no extra step.
                req_index += 1
                continue
            if defer_prefills and request.is_prefill_chunk:
                req_index += 1  # prefill cadence: this chunk waits for a cadence step; decodes go on
                continue
            num_new = (request.num_tokens + spec.num_spec(request) + request.num_output_placeholders
                       - request.num_computed_tokens)
            if 0 < long_prefill < num_new:
                num_new = long_prefill
            num_new = min(num_new, token_budget)
            num_new = min(num_new, self.max_model_len - request.num_computed_tokens - NUM_SAMPLED_TOKENS_PER_STEP)
            num_new = split_scheduled_chunk(self, request, num_new)  # Mamba "align": chunks end on states
            num_new, encoding = self.encoder.try_schedule(request, request.num_computed_tokens, num_new)
            if self.pool.num_prefill_lookahead > 1:  # multi-module MTP (scheduler_prefill_lookahead)
                num_new = reserve_prefill_lookahead(self.pool.num_prefill_lookahead, request,
                                                    request.num_computed_tokens, num_new)
            if num_new <= 0:
                req_index += 1
                continue

            new_blocks = None
            while True:
                new_blocks = kv.allocate_slots(request, num_new, num_lookahead_tokens=cfg.num_lookahead_tokens)
                if new_blocks is not None:
                    break
                if _conn.has_pending_block_frees(self):
                    break  # the connector's pending sends will free blocks: no preemption
                if not _conn.victim_blocks_can_be_freed(self):
                    break  # a deferred free would not help this allocation (vLLM's defer_block_free)
                if cfg.policy == PRIORITY:
                    victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))
                    victim_index = self.running.index(victim)
                    del self.running[victim_index]
                    if victim_index < req_index:
                        req_index -= 1
                    if victim.request_id in scheduled:
                        # Give back what the victim already took this step.
                        token_budget += scheduled.pop(victim.request_id)[2]
                        spec.unschedule(victim.request_id)
                        self.encoder.unschedule(victim)
                else:
                    victim = self.running.pop()
                self._preempt_request(victim, drop_stale_output=_conn.requires_kv_delivery(self))
                preempted.append(victim)
                if victim is request:
                    break

            if new_blocks is None:
                if cfg.policy == PRIORITY and request.status == RequestStatus.PREEMPTED:
                    continue  # it preempted itself; the ones after it may still fit
                break

            scheduled[request.request_id] = (request, "running", num_new, new_blocks)
            token_budget -= num_new
            req_index += 1
            prefill_scheduled |= request.is_prefill_chunk
            spec.note_scheduled(request, request.num_computed_tokens, num_new)
            spec.take_running_drafts(request, num_new)
            self.encoder.commit(request, encoding)

        if not preempted and self.pause_state != PauseState.PAUSED_ALL:
            token_budget = self._schedule_waiting(token_budget, long_prefill, scheduled, prefill_scheduled,
                                                  defer_prefills)
            self.cadence.after_waiting_loop(defer_prefills, list(self.waiting) + list(self.sessions.kv_holding_waiting))

        self.encoder.end_step([v[0] for v in scheduled.values()],
                              [v[0] for v in scheduled.values() if v[1] != "running"])
        total = sum(s[2] for s in scheduled.values())
        prefill_admitted = any(kind != "running" and r.num_computed_tokens < r.num_tokens - 1
                               for r, kind, _, _ in scheduled.values())
        self.cadence.after_schedule(total, prefill_scheduled or prefill_admitted)
        assert 0 <= token_budget and total <= cfg.step_token_budget
        assert len(self.running) <= cfg.max_num_seqs
        release_copies = getattr(kv, "release_kv_cache_block_copies", None)
        if self.connector_state is not None:
            _conn.release_cow_copies(self)  # fenced like vLLM's with deferred frees (#28)
        elif release_copies is not None:
            release_copies()  # copy-on-write endpoints kept for this step's copies (_free_cow_retained_blocks)

        out = SchedulerOutput(
            scheduled=tuple(ScheduledRequest(request_id=rid, kind=kind, num_scheduled_tokens=n,
                                             num_computed_tokens=r.num_computed_tokens, block_ids=blocks,
                                             is_prefill_chunk=False,
                                             spec_token_ids=spec.step_spec_tokens.get(rid, ()))
                            for rid, (r, kind, n, blocks) in scheduled.items()),
            preempted_req_ids=frozenset(self.preempted_req_ids),
            finished_req_ids=frozenset(self.finished_req_ids),
            skip_drafts=not spec.drafts_needed)
        if self.connector_state is not None:
            _conn.after_schedule(self, out)  # build_connector_meta
        if self.aux_output is not None:  # vLLM: the aux-output metadata, before _update_after_schedule
            self.aux_output.build_connector_meta([(s.request_id, s.num_scheduled_tokens) for s in out.scheduled],
                                                 self.requests)
        out = self._update_after_schedule(out)
        if self.connector_state is not None:
            _conn.after_update_after_schedule(self, out)
        self._in_flight[id(out)] = out
        return out

    def _schedule_waiting(self, token_budget: int, long_prefill: int,
                          scheduled: dict[str, tuple[Request, str, int, BlockIds]],
                          prefill_scheduled: bool = False, defer_prefills: bool = False) -> int:
        """Admit waiting requests in queue order until one does not fit (head-of-line, #39734)."""
        if self.connector_state is not None:
            return _conn.schedule_waiting(self, token_budget, long_prefill, scheduled, prefill_scheduled)
        cfg = self.config
        kv = self.kv_cache_manager
        skipped: list[Request] = []
        skipped_holding: list[Request] = []  # skipped sessions that hold KV blocks
        kv_holding = self.sessions.kv_holding_waiting

        def skip(queue: WaitingQueue) -> None:
            r = queue.pop_request()
            (skipped_holding if r.num_computed_tokens > 0 else skipped).append(r)
            self.cadence.note_skipped(r)

        # the adapters of every running request, scheduled in this step or not (max_loras)
        scheduled_loras = _lora.running_loras(self.running) if self.max_loras is not None else set()
        while token_budget > 0:
            # sessions holding KV blocks drain first, and are the only ones PAUSED_NEW admits
            queue = kv_holding if kv_holding else (self.waiting if self.pause_state == PauseState.UNPAUSED else None)
            # sessions waiting for input are in no queue's turn but keep a model-runner slot
            has_slot = len(self.running) < cfg.max_num_active_reqs - self.sessions.num_waiting_for_streaming_input
            if not queue or not has_slot:
                break
            request = queue.peek_request()
            if self.sessions.waiting_for_input(request):
                skip(queue)  # vLLM _handle_blocked_waiting_request: WAITING_FOR_STREAMING_REQ
                continue
            if not self.structured.ready_to_schedule(request):
                skip(queue)  # vLLM _handle_blocked_waiting_request: WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
                continue
            if request.num_stale_output_tokens and not request.drop_stale_output:
                # Async: output of its pre-preemption steps is still in flight; resuming now could
                # resample a position that output later fills. Skip it (it does not block).
                skip(queue)
                continue
            if _lora.exceeds_max_loras(request, scheduled_loras, self.max_loras):
                skip(queue)  # one adapter too many: skipped, not stalling
                continue

            looked_up = request.num_computed_tokens == 0
            num_replay = 0
            if looked_up:
                hit_ids, num_hit = kv.get_computed_blocks(request) if self.aux_output is None else \
                    kv.get_computed_blocks(request, self.aux_output.max_cache_hit(request))  # vLLM max_cache_hit_length
                if _replay.drop_short_hit(self.prefix_replay_tokens, num_hit):
                    hit_ids, num_hit = None, 0  # SWA bounded replay: recomputed in full anyway
            else:  # a session resuming on the KV blocks it kept: no prefix-cache lookup
                hit_ids, num_hit = None, request.num_computed_tokens
            if defer_prefills and num_hit < request.num_tokens - 1:
                break  # prefill cadence: no prefill this step (scheduler_cadence)
            hit_tokens = num_hit  # what allocate_slots adopts
            if looked_up and self.prefix_replay_tokens:
                replay = _replay.replay_admission(self.prefix_replay_tokens, num_hit)
                request.replay_start = replay.replay_start
                num_hit, num_replay = replay.num_computed_tokens, replay.num_replay_tokens
            num_new = request.num_tokens - num_hit
            padded = self.spec_decode.pad_new_decode(
                num_new, num_hit, prefill_scheduled, any(v[1] == "running" for v in scheduled.values()),
                token_budget, self.max_model_len)
            if padded is None:
                break  # the padded decode does not fit: vLLM prefers not to schedule it un-padded
            is_padded, num_new = padded != num_new, padded
            if 0 < long_prefill < num_new:
                num_new = long_prefill
            if not cfg.enable_chunked_prefill and num_new > token_budget:
                break
            num_new = min(num_new, token_budget)
            assert num_new > 0
            num_new = split_scheduled_chunk(self, request, num_new, num_hit if looked_up else 0,
                                            admitting=looked_up)  # Mamba "align"
            if num_new == 0:
                break
            if is_padded and num_new != padded:
                num_new, is_padded = 1, False  # vLLM drops spec-decode padding the alignment clipped
            num_new, encoding = self.encoder.try_schedule(request, num_hit, num_new)
            if self.pool.num_prefill_lookahead > 1:  # multi-module MTP (scheduler_prefill_lookahead)
                num_new = reserve_prefill_lookahead(self.pool.num_prefill_lookahead, request, num_hit, num_new)
            if num_new == 0:
                # the encoder limits leave no token: requeued, it does not stall the ones behind it
                skip(queue)
                continue

            blocks = kv.allocate_slots(
                request, _replay.slots_past_hit(num_new, num_replay),
                num_new_computed_tokens=hit_tokens if looked_up else 0, new_computed_block_ids=hit_ids,
                num_lookahead_tokens=cfg.num_lookahead_tokens, full_sequence_must_fit=cfg.scheduler_reserve_full_isl, reserved_blocks=0,
                has_scheduled_reqs=bool(self.running))
            if blocks is None:
                if request.mm_features:
                    self.encoder.manager.free(request)  # the cache references its lookup took
                break  # head-of-line: the requests behind it are not tried this step
            if self.records_prefix_cache_stats and looked_up:
                _record_prefix_cache_stats(kv, request, hit_tokens)  # vLLM: the hit adopted, before the rewind

            queue.pop_request()
            self.cadence.note_admitted(request)
            self.running.append(request)
            if self.max_loras is not None and request.lora_request is not None:
                scheduled_loras.add(request.lora_request.lora_int_id)
            # the V2 runner gets a resumed request as a new one (all its blocks, all its tokens)
            kind = "new" if request.status == RequestStatus.WAITING or self.use_v2_model_runner else "resumed"
            scheduled[request.request_id] = (request, kind, num_new, kv.get_block_ids(request.request_id))
            token_budget -= num_new
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            self.spec_decode.note_scheduled(request, num_hit, num_new)
            if is_padded:
                self.spec_decode.mark_padded(request.request_id)
            self.encoder.commit(request, encoding)
        self.waiting.prepend_requests(skipped)
        kv_holding.prepend_requests(skipped_holding)
        return token_budget

    def _update_after_schedule(self, out: SchedulerOutput) -> SchedulerOutput:
        """Advance computed and in-flight tokens now, so the next step can be scheduled before
        this one's output arrives (and, under async scheduling, add one output placeholder per
        request that will sample)."""
        items = []
        for s in out.scheduled:
            request = self.requests[s.request_id]
            request.num_computed_tokens += s.num_scheduled_tokens
            request.num_in_flight_tokens += s.num_scheduled_tokens
            request.is_prefill_chunk = (request.num_computed_tokens
                                        < request.num_tokens + request.num_output_placeholders)
            items.append(ScheduledRequest(s.request_id, s.kind, s.num_scheduled_tokens, s.num_computed_tokens,
                                          s.block_ids, request.is_prefill_chunk, s.spec_token_ids))
        if self.config.async_scheduling:
            for s in items:
                if not s.is_prefill_chunk:
                    # AsyncScheduler: the sampled token and the scheduled drafts are placeholders now,
                    # and the request gets placeholder drafts for its next step
                    self.requests[s.request_id].num_output_placeholders += self.spec_decode.after_schedule(
                        self.requests[s.request_id], s.spec_token_ids)
        self.finished_req_ids = set()
        self.preempted_req_ids = set()
        return SchedulerOutput(tuple(items), out.preempted_req_ids, out.finished_req_ids, out.skip_drafts)

    def _preempt_request(self, request: Request, drop_stale_output: bool = False) -> None:
        """Recompute preemption: free all blocks, forget progress, back to the waiting queue's head."""
        assert request.status == RequestStatus.RUNNING
        if self.aux_output is not None:
            self.aux_output.request_finished(request)  # vLLM: retained before the blocks are freed
        if self.connector_state is not None:
            _conn.free_request_blocks(self, request)  # deferred while a step may still write them
        else:
            self.kv_cache_manager.free(request)
        self.encoder.forget(request)
        if self.connector_state is not None:
            self.connector_state.inflight_prefills.pop(request.request_id, None)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.spec_decode.forget(request.request_id)
        # Async: in-flight output becomes stale; it is still delivered when it arrives (an
        # undrained drop-mode share stays dropped).
        # (``drop_stale_output``: a connector that requires KV delivery, or a prefix-cache reset)
        request.drop_stale_output = drop_stale_output or (
            request.drop_stale_output and request.num_stale_output_tokens > 0)
        request.num_stale_output_tokens = request.num_in_flight_tokens
        request.num_output_placeholders = 0
        request.num_preemptions += 1
        self.waiting.prepend_request(request)
        self.preempted_req_ids.add(request.request_id)

    # ---- outputs --------------------------------------------------------------------------------
    def update_from_output(self, output: SchedulerOutput, model_output: ModelOutput,
                           kv_connector_output: _conn.KVConnectorOutput | None = None) -> None:
        """Settle one step: in-flight tokens, sampled tokens, stop checks, finishing.

        Steps must be settled in the order they were scheduled (vLLM's batch queue is FIFO).
        """
        if self._in_flight and id(output) != next(iter(self._in_flight)):
            raise InvalidFieldError("output", "a later step", "the oldest SchedulerOutput not yet updated")
        if id(output) not in self._in_flight:
            raise InvalidFieldError("output", output, "a SchedulerOutput this scheduler returned, not yet updated")
        if not isinstance(model_output, ModelOutput) or not isinstance(model_output.sampled_token_ids, dict):
            raise InvalidFieldError("model_output", model_output, "a ModelOutput")
        for rid, ids in model_output.sampled_token_ids.items():
            if not isinstance(ids, (list, tuple)) or any(type(t) is not int or t < 0 for t in ids):
                raise InvalidFieldError(f"model_output.sampled_token_ids[{rid!r}]", ids, "a list of token ids >= 0")
        spec_tokens = output.scheduled_spec_decode_tokens
        for rid, ids in model_output.sampled_token_ids.items():
            self.spec_decode.check_sampled(rid, ids, spec_tokens.get(rid, ()))
        _conn.check_kv_connector_output(self, kv_connector_output)
        del self._in_flight[id(output)]
        # failed KV loads (vLLM: skipped below; finished as errors under the "fail" policy)
        failed = (_conn.handle_failures(self, kv_connector_output, output.num_scheduled_tokens)
                  if self.connector_state is not None else set())
        self.spec_decode.start_update()
        num_invalid_spec_tokens = self._num_invalid_spec_tokens.pop(id(output), {})
        stopped: list[tuple[Request, RequestStatus]] = []
        continuing: list[tuple[Request, RequestStatus]] = []  # sessions whose turn stopped
        for s in output.scheduled:
            request = self.requests.get(s.request_id)
            if request is None:
                continue  # finished (aborted or stopped) while the step was in flight
            request.num_in_flight_tokens -= s.num_scheduled_tokens
            stale = request.num_stale_output_tokens > 0
            if stale:
                request.num_stale_output_tokens -= s.num_scheduled_tokens
                assert request.num_stale_output_tokens >= 0
                if request.drop_stale_output:
                    continue
            if s.request_id in failed or request.status == RequestStatus.FINISHED:
                continue  # a failed KV load, or finished while the connector holds its blocks
            new_ids = list(model_output.sampled_token_ids.get(s.request_id, ()))
            if new_ids and s.spec_token_ids:
                self.spec_decode.verify(request, s.spec_token_ids, len(new_ids), stale,
                                        num_invalid_spec_tokens.get(s.request_id, 0))
            if request.mm_features:
                _enc.free_encoder_inputs(self.encoder, request)  # only once the step has executed
            if not new_ids:
                continue
            status_before = request.status
            had_placeholders = request.num_output_placeholders > 0
            num_before = request.num_output_tokens
            is_stopped = self._append_output(request, new_ids, stale)
            if (not stale and status_before == RequestStatus.RUNNING
                    and (had_placeholders or self.config.num_speculative_tokens > 0)):
                # Async: the sampled token is known now, so its full block can be cached.
                _cache_blocks(self.kv_cache_manager, request,
                              request.num_computed_tokens - request.num_in_flight_tokens)
            if not self.structured.accepts(request, request.output_token_ids[num_before:]):
                # vLLM: "grammar rejected tokens ... Terminating request": FINISHED_ERROR, not resumable
                request.status, request.finish_reason, is_stopped = RequestStatus.FINISHED, "error", True
            if is_stopped and not _sess.handle_stopped(self, request):
                continuing.append((request, status_before))  # a session: kept, with its blocks
            elif is_stopped:
                stopped.append((request, status_before))
                self._free_request(request)  # at once, in batch order, as vLLM does
        gone = {id(r) for r, _ in stopped + continuing}
        self.running = [r for r in self.running if id(r) not in gone]
        left_waiting = [r for r, st in stopped + continuing if st != RequestStatus.RUNNING]
        self.waiting.remove_requests(left_waiting)
        self.sessions.kv_holding_waiting.remove_requests(left_waiting)
        for request, _ in continuing:
            _sess.enqueue_waiting(self, request)  # vLLM _enqueue_waiting_request
        self._finish_encoder_mismatches()
        if self.connector_state is not None:
            _conn.after_output(self, kv_connector_output, failed)
        self._publish_kv_events()
        if self._finished_since_output is not None:  # vLLM: then cleared, until the next update
            self.finished_requests = frozenset(self._finished_since_output) or None
            self._finished_since_output.clear()

    def _finish_encoder_mismatches(self) -> None:
        """vLLM ``update_from_output``: the requests an encoder-cache embedding-count mismatch
        rejected since the last update (:func:`kvref.impl.reference.scheduler_encoder._reject_mismatch`)
        are finished as errors, freeing their KV blocks, in the order vLLM's ``finish_requests``
        walks them (a set of their ids), or in :attr:`finish_order_hint`'s when a replay gives one
        (the free order decides which free blocks later allocations get). None with a KV
        connector: the reference refuses multimodal requests then."""
        grammar_errors = self.structured.take_compile_errors()  # vLLM grammar_compile_error_reqs
        mismatched = self.encoder.encoder_cache_mismatch_reqs
        if not mismatched and not grammar_errors:
            return
        error_req_ids: set[str] = set(grammar_errors)
        error_req_ids.update(mismatched)
        mismatched.clear()
        ids = tuple(set(error_req_ids))
        if self.finish_order_hint is not None:  # the recorded order first; the rest in set order
            rank = {rid: i for i, rid in enumerate(self.finish_order_hint)}
            ids = tuple(sorted(ids, key=lambda rid: rank.get(rid, len(rank))))
        self._finish(ids, "error")

    def _publish_kv_events(self) -> None:
        """vLLM's ``update_from_output`` ends by taking every KV cache event queued since the last
        step (by ``schedule``'s allocations and evictions, this update's async caching, a prefix
        cache reset) and publishing them as one ``KVEventBatch``; an empty queue publishes nothing.
        With events off (``pool.enable_kv_cache_events``) nothing is queued."""
        take = getattr(self.kv_cache_manager, "take_kv_events", None)
        if take is not None and self.pool.enable_kv_cache_events:
            events = take()
            if events:
                self._published_kv_events.append(events)

    def take_published_kv_events(self) -> list[list[dict]]:
        """The event batches published since the last call, each a list of plain event dicts
        (:func:`kvref.impl.reference.kv_events.event_to_plain`), oldest first."""
        out, self._published_kv_events = self._published_kv_events, []
        return out

    def _append_output(self, request: Request, new_ids: list[int], stale: bool) -> bool:
        """Append sampled tokens one by one until a stop condition (vLLM ``check_stop``)."""
        stopped = False
        for n, token in enumerate(new_ids, 1):
            request.output_token_ids.append(token)
            reason = stop_reason(request, self.max_model_len)  # eos, stop ids, length, repetition
            if reason is None:
                continue
            request.finish_reason = reason
            request.status = RequestStatus.FINISHED
            if not stale:
                request.num_computed_tokens -= len(new_ids) - n
            stopped = True
            break
        if not stale and request.num_output_placeholders > 0:
            request.num_output_placeholders -= len(new_ids)
            assert request.num_output_placeholders >= 0
        return stopped

    def update_draft_token_ids_in_output(self, draft_token_ids: DraftTokenIds, output: SchedulerOutput) -> None:
        """The runner's drafts for a step still in flight (see
        :meth:`SpecDecodeState.invalid_in_output`); only the step's stats change."""
        if id(output) not in self._in_flight:
            raise InvalidFieldError("output", output, "a SchedulerOutput this scheduler returned, not yet updated")
        draft_token_ids = self.structured.filter_drafts(self.requests, draft_token_ids, self.spec_decode.k,
                                                        output.scheduled_spec_decode_tokens)
        self._num_invalid_spec_tokens[id(output)] = self.spec_decode.invalid_in_output(
            self.requests, draft_token_ids, output.scheduled_spec_decode_tokens)

    def update_draft_token_ids(self, draft_token_ids: DraftTokenIds) -> None:
        """Drafts the runner proposed after the last step (synchronous scheduling; see
        :meth:`SpecDecodeState.update_draft_token_ids`)."""
        draft_token_ids = self.structured.filter_drafts(self.requests, draft_token_ids, self.spec_decode.k)
        self.spec_decode.update_draft_token_ids(self.requests, draft_token_ids)

    @property
    def spec_decoding_stats(self) -> SpecDecodingStats | None:
        """The ``SpecDecodingStats`` of the last ``update_from_output`` (None when it verified no draft)."""
        return self.spec_decode.last_stats

    @property
    def request_spec_decode_metrics(self) -> dict[str, RequestSpecDecodeMetrics]:
        """Per-request speculative-decoding metrics (``spec_decode_metrics_level``): the live
        requests' and those of the requests the last ``update_from_output`` finished (vLLM reports
        them with the finishing output)."""
        return {**self.spec_decode.metrics, **self.spec_decode.finished_metrics}

    def _free_request(self, request: Request) -> None:
        assert request.status == RequestStatus.FINISHED
        if self.aux_output is not None and self.connector_state is None:  # (with one: _conn.free_request)
            self.aux_output.request_finished(request)  # vLLM: first thing _free_request does
        self.spec_decode.freed(request.request_id)
        self.structured.forget(request.request_id)
        if self.connector_state is not None:
            return _conn.free_request(self, request)
        self.spec_decode.forget(request.request_id)
        self.encoder.forget(request)
        _sess.forget(self, request)
        self.finished_req_ids.add(request.request_id)
        if self._finished_since_output is not None:
            self._finished_since_output.add(request.request_id)
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]

    # ---- observation ----------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def set_pause_state(self, pause_state: PauseState | int) -> None:
        """vLLM ``Scheduler.set_pause_state``: only what later steps schedule changes (see
        :mod:`.scheduler_pause`); no request is freed, preempted or moved."""
        self.pause_state = as_pause_state(pause_state)

    def get_request_counts(self) -> tuple[int, int]:
        """vLLM: ``(num_running, num_waiting)``, KV-holding waiting requests counted as waiting."""
        return (len(self.running),
                len(self.waiting) + _conn.num_kv_holding_waiting(self) + len(self.sessions.kv_holding_waiting))

    def get_num_unfinished_requests(self) -> int:
        """vLLM: what the pause state lets run. PAUSED_ALL counts none (the engine loop idles);
        PAUSED_NEW counts running requests and those holding KV blocks, not the queued ones;
        sessions waiting for input are never counted."""
        if self.pause_state == PauseState.PAUSED_ALL:
            return 0
        num_running, num_waiting = self.get_request_counts()
        if self.pause_state == PauseState.PAUSED_NEW:
            num_waiting = _conn.num_kv_holding_waiting(self) + len(self.sessions.kv_holding_waiting)
        return num_running + num_waiting - self.sessions.num_waiting_for_streaming_input

    def has_request(self, request_id: str) -> bool:
        """vLLM ``has_request``: the id is known (live, or finished with blocks a connector still
        holds); the engine asks it before an abort or a streaming update."""
        if not isinstance(request_id, str):
            raise InvalidFieldError("request_id", request_id, "a request id (str)")
        return request_id in self.requests

    def has_requests(self) -> bool:
        """vLLM ``has_requests``: the engine keeps stepping while requests are unfinished or
        finished ones still hold blocks (the scripted connector has no pending push work)."""
        return self.has_unfinished_requests() or self.has_finished_requests()

    def has_finished_requests(self) -> bool:
        """vLLM: finished ids not yet reported by a ``schedule()``, or (with a connector) finished
        requests whose blocks the connector still holds (still in ``requests``, in no queue)."""
        if self.finished_req_ids:
            return True
        if self.connector_state is None:
            return False
        return len(self.requests) > sum(self.get_request_counts())

    def make_stats(self) -> dict:
        """The KV-cache part of vLLM's ``make_stats`` (``SchedulerStats`` with ``log_stats``):
        request counts, ``kv_cache_usage`` and the prefix-cache stats since the last call (which
        this call resets, as vLLM's does); None without ``pool.log_stats``."""
        make = getattr(self.kv_cache_manager, "make_prefix_cache_stats", None)
        stats = make() if make is not None and self.pool.log_stats else None
        if stats is None:
            return None
        num_running, num_waiting = self.get_request_counts()
        waiting_ids = ([r.request_id for r in self.waiting] + list(_conn.kv_holding_waiting_ids(self))
                       + [r.request_id for r in self.sessions.kv_holding_waiting])
        if self.connector_state is not None:  # deferred requests, async loads by stage, external hits
            extra = _conn_stats.connector_stats(self.connector_state, waiting_ids)
        else:  # vLLM: the stage tally is all zeros and there are no connector stats
            extra = {"num_skipped_waiting_reqs": len(self.cadence.skipped_ids & set(waiting_ids)),
                     "num_kv_fetch_reqs_by_stage": dict.fromkeys(_conn_stats.KV_FETCH_STAGES, 0),
                     "connector_prefix_cache_stats": None}
        # vLLM's num_waiting_reqs leaves the skipped (deferred) requests out
        return {"num_running_reqs": num_running, "num_waiting_reqs": num_waiting - extra["num_skipped_waiting_reqs"],
                "kv_cache_usage": self.get_kv_cache_usage(),
                "prefix_cache_stats": {f: stats[f] for f in PREFIX_CACHE_STATS_FIELDS}, **extra}

    def shutdown(self) -> None:
        """vLLM ``Scheduler.shutdown`` (the engine core's exit): the KV connector is shut down (its
        ``shutdown`` hook, which a connector uses to finish its transfers); the scheduler's state
        is left as it was, as vLLM leaves it."""
        if self.connector_state is not None:
            self.connector_state.connector.shutdown()

    def encoder_view(self) -> dict:
        """The encoder cache and what the last ``schedule()`` encoded and evicted (vLLM
        ``scheduled_encoder_inputs`` / ``free_encoder_mm_hashes``)."""
        return self.encoder.view()

    def get_kv_cache_usage(self) -> float:
        """vLLM ``get_kv_cache_usage`` (the ``kv_cache_usage`` of its ``SchedulerStats``): the
        fraction of the pool's blocks (the null block aside) not free."""
        return self.kv_cache_manager.usage

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """vLLM ``Scheduler.reset_prefix_cache`` (see :func:`.scheduler_connector.reset_prefix_cache`)."""
        ok = _conn.reset_prefix_cache(self, reset_running_requests, reset_connector)
        if ok and self.aux_output is not None:
            self.aux_output.reset()  # vLLM: a new aux-output generation after a successful reset
        return ok

    def snapshot(self, all_requests: Iterable[Request] = ()) -> SchedulerSnapshot:
        """Observable state; ``all_requests`` adds finished requests the caller still holds."""
        if isinstance(all_requests, (str, bytes, dict)) or not isinstance(all_requests, Iterable):
            raise InvalidFieldError("all_requests", all_requests, "a collection of Requests")
        all_requests = list(all_requests)
        if not all(isinstance(r, Request) for r in all_requests):
            raise InvalidFieldError("all_requests", all_requests, "a collection of Requests")
        reqs = {r.request_id: r for r in all_requests}
        reqs.update(self.requests)
        snap = SchedulerSnapshot(
            waiting=tuple(r.request_id for r in self.waiting),
            running=tuple(r.request_id for r in self.running),
            requests={rid: request_state(r, tuple(self.spec_decode.spec_token_ids.get(rid, ())))
                      for rid, r in reqs.items()},
            block_ids={rid: self.kv_cache_manager.get_block_ids(rid) for rid in self.requests
                       if any(self.kv_cache_manager.get_block_ids(rid))},
            num_free_blocks=self.kv_cache_manager.get_num_free_blocks(),
            free_block_queue=(self.kv_cache_manager.free_block_queue()
                              if hasattr(self.kv_cache_manager, "free_block_queue") else None),
            kv_holding_waiting=tuple(r.request_id for r in self.sessions.kv_holding_waiting),
            waiting_for_grammar=tuple(sorted(self.structured.waiting_for_grammar)))
        return snap if self.connector_state is None else _conn.snapshot(self, snap)

    def check_invariants(self) -> None:
        """Queues disjoint and consistent with request states, plus the KV cache manager's rules
        (docs/invariants.md)."""
        if self.aux_output is not None:
            self.aux_output.check_invariants(self.requests)
        if self.connector_state is not None:
            return _conn.check_invariants(self)
        holding = list(self.sessions.kv_holding_waiting)
        waiting = list(self.waiting) + holding
        self.waiting.check_invariants()
        self.cadence.check_invariants()
        self.sessions.check_invariants(self.requests)
        ids_w = {r.request_id for r in waiting}
        ids_r = [r.request_id for r in self.running]
        self.structured.check_invariants(self.requests, ids_w)
        assert len(ids_r) == len(set(ids_r)), "Q1: request running twice"
        assert not ids_w & set(ids_r), "Q1: request both waiting and running"
        assert ids_w | set(ids_r) == set(self.requests), "Q1: live request in no queue (or a queued dead one)"
        assert len(self.running) <= self.config.max_num_seqs, \
            f"Q1: {len(self.running)} running, max_num_seqs={self.config.max_num_seqs}"
        drafts_in_flight: dict[str, int] = {}  # scheduled drafts not yet verified
        for out in self._in_flight.values():
            for s in out.scheduled:
                drafts_in_flight[s.request_id] = drafts_in_flight.get(s.request_id, 0) + len(s.spec_token_ids)
        for r in self.running:
            assert r.status == RequestStatus.RUNNING, f"Q2: running request {r.request_id} is {r.status.value}"
            assert r.num_output_placeholders >= 0 and r.num_in_flight_tokens >= 0, \
                f"Q6: request {r.request_id}: {r.num_output_placeholders} placeholders, " \
                f"{r.num_in_flight_tokens} in-flight tokens"
            assert r.num_computed_tokens <= (r.num_tokens + r.num_output_placeholders
                                             + (0 if self.config.async_scheduling
                                                else drafts_in_flight.get(r.request_id, 0))), \
                f"Q6: request {r.request_id} computed {r.num_computed_tokens} of {r.num_tokens} tokens"
            assert r.num_computed_tokens < self.max_model_len, \
                f"Q6: request {r.request_id} computed {r.num_computed_tokens}, max_model_len={self.max_model_len}"
        for r in waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), \
                f"Q2: waiting request {r.request_id} is {r.status.value}"
            if any(r is h for h in holding):
                continue  # a session keeps its blocks while it waits (Q13)
            assert r.num_computed_tokens == 0 and r.num_output_placeholders == 0, \
                f"Q3: waiting request {r.request_id} keeps {r.num_computed_tokens} computed tokens, " \
                f"{r.num_output_placeholders} placeholders"
            assert not any(self.kv_cache_manager.get_block_ids(r.request_id)), \
                f"Q3: waiting request {r.request_id} holds blocks"
        if not self.config.async_scheduling:
            assert all(r.num_output_placeholders == 0 for r in self.requests.values()), \
                "Q6: output placeholders without async scheduling"
        assert len(self._in_flight) <= self.config.max_concurrent_batches, \
            f"Q6: {len(self._in_flight)} schedules in flight, " \
            f"max_concurrent_batches={self.config.max_concurrent_batches}"
        self.spec_decode.check_invariants(self.requests)
        self.encoder.manager.check_invariants()
        self.kv_cache_manager.check_invariants()


def request_state(r: Request, spec_token_ids: tuple[int, ...] = ()) -> RequestState:
    return RequestState(request_id=r.request_id, status=r.status.value, num_computed_tokens=r.num_computed_tokens,
                        num_in_flight_tokens=r.num_in_flight_tokens,
                        num_output_placeholders=r.num_output_placeholders,
                        num_stale_output_tokens=r.num_stale_output_tokens,
                        output_token_ids=tuple(r.output_token_ids), num_preemptions=r.num_preemptions,
                        finish_reason=r.finish_reason, spec_token_ids=spec_token_ids)
