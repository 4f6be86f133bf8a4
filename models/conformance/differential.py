"""Apply one trace to several KV cache managers at once and compare everything they let us see.

The :class:`Harness` plays vLLM's scheduler in miniature: it owns the shared
:class:`~kvref.impl.request.Request` objects, advances ``num_computed_tokens`` /
``num_in_flight_tokens``, appends sampled tokens, and calls the managers the way
``vllm/v1/core/sched/scheduler.py`` does:

* ``add``      a new request enters ``waiting``.
* ``admit``    a waiting/preempted request: ``get_computed_blocks`` then ``allocate_slots`` with the
               hit, ``full_sequence_must_fit`` (the scheduler's ``scheduler_reserve_full_isl``),
               ``reserved_blocks``, ``has_scheduled_reqs = bool(running)`` and optionally
               ``num_external_computed_tokens`` (a KV connector's synchronous load after the hit).
               ``async_load``: the connector loads asynchronously (vLLM's ``load_kv_async``): no
               new tokens, ``delay_cache_blocks=True``, and the request waits
               (``WAITING_FOR_REMOTE_KVS``) holding its blocks until ``load_done``.
               ``reserve_slack >= 0``: ``reserved_blocks`` is set so that exactly that many free
               blocks are available (the scheduler's reservation for in-flight prefills, PR 44560):
               admission is decided at the pool's boundary whatever its size.
* ``load_done`` an async load finished (``_update_waiting_for_remote_kv``): ``cache_blocks`` up to
               the loaded tokens, then the request runs (its next ``step`` allocates the rest).
* ``step``     a running request's next prefill chunk or decode token (``allocate_slots`` without
               hits; ``num_lookahead_tokens`` for spec-decode slots).
* ``process``  the oldest in-flight batch of a request completes (``update_from_output``):
               ``num_in_flight_tokens`` drops and a sampled token is appended. Batches with
               ``in_flight=False`` are processed at once (synchronous scheduling).
* ``preempt``  ``free`` + ``num_computed_tokens = 0``; in-flight output turns stale (vLLM's
               ``_preempt_request``: delivered later, ``num_in_flight_tokens`` kept).
* ``finish``   ``free``; the request is gone.
* ``new_step`` ``new_step_starts()``.
* ``reset_prefix_cache`` the scheduler's ``reset_prefix_cache(reset_running_requests)``: with it,
               every running request is preempted first (last first, in-flight output dropped);
               then the managers' ``reset_prefix_cache()`` (fails while blocks are in use).
* ``evict_blocks`` a KV connector invalidates blocks (``evict_blocks``: their hashes go, blocks
               in use stay allocated).
* ``connector_lookup`` a KV connector's local lookup for a waiting request
               (``get_computed_blocks_for_connector``) and the hit truncated at an aligned endpoint
               (``truncate_computed_blocks``); nothing changes, both results are compared.
* ``make_prefix_cache_stats`` the scheduler's ``make_stats``: take (and reset) the prefix-cache stats.

``add`` carries a request's block-hash inputs (multimodal items, LoRA adapter, prompt embeddings,
session id, ``skip_reading_prefix_cache``); an admission records the prefix-cache stats as the
scheduler does; ``finish``/``preempt`` with ``hold_view`` free while holding the request's
``get_blocks()`` result (a connector's view), which must still read in table order afterwards.

An op whose precondition does not hold is skipped (and reported as such), so a saved trace
stays replayable after shrinking or hand-editing. After every op the harness compares, across
implementations: the op's result (hit ids + length, admission ``None`` vs new block ids), every
block-holding request's block ids per group (exactly), the free-block count, the free-queue
order and the cached hashes; it calls ``check_invariants()`` on each and checks protocol-level
invariants (free queue ⊎ held blocks = all non-null blocks). When the pool config enables KV
cache events and every manager has ``take_kv_events()``, the events each queued during the op are
compared too, exactly (docs/kv_events.md). Where every manager has them (issue #23), also: every
live request's block hashes, ``usage``, the pending prefix-cache stats, and per block-holding
request the connector views ``get_block_ids_for_computed_tokens(num_computed_tokens)`` and
``estimate_cached_tokens``.
"""

from __future__ import annotations

import copy
import pickle
from collections import deque
from time import perf_counter
from dataclasses import dataclass, field
from typing import Any, Callable

from kvref.impl.interface import KVCacheManagerLike, PoolConfig, make_manager
from kvref.impl.request import LoRARequest, MultiModalFeatureSpec, PlaceholderRange, Request, RequestStatus
from kvref.spec.kv_zeroing import needs_kv_cache_zeroing

from kvref.models.conformance.accepted import signature
from kvref.models.conformance.trace import Op, Trace


class Divergence(AssertionError):
    """Two implementations disagreed, or one broke an invariant, after an op of a trace.

    ``signature`` is the finding without its ids (the op and what differed): one baseline entry
    accepts every occurrence of it (:mod:`kvref.models.conformance.accepted`). ``trace_path`` is
    where the failing trace was saved, once a harness saved it (callers read it from here, never
    from the message).
    """

    def __init__(self, message: str, signature: str | None = None, trace_path: str | None = None) -> None:
        super().__init__(message)
        self.signature = signature
        self.trace_path = trace_path


@dataclass
class _Batch:
    num_tokens: int
    token: int | None  # sampled token this batch delivers, if it reached the end of the sequence
    stale: bool = False  # scheduled before a preemption: delivered, but counters were reset


@dataclass
class _ReqState:
    request: Request
    batches: deque = field(default_factory=deque)
    holds_blocks: bool = False
    loading: bool = False  # an async KV load is in flight (WAITING_FOR_REMOTE_KVS)
    admitted_with_hit: bool = False  # its last admission took a prefix hit

    @property
    def placeholders(self) -> int:
        """Sampled tokens scheduled but not yet delivered (async scheduling)."""
        return self.request.num_output_placeholders

    @placeholders.setter
    def placeholders(self, value: int) -> None:
        self.request.num_output_placeholders = value


@dataclass
class OpResult:
    op: Op
    skipped: bool
    value: Any = None


class Harness:
    """Drive ``managers`` (kind -> manager) with the same ops; compare after every op.

    Args:
        pool_config: the pool every manager was built from.
        managers: kind name -> manager; built with :func:`make_manager` when given as kind names.
        compare: compare across managers (False: only invariants, e.g. a single implementation).
    """

    def __init__(self, pool_config: PoolConfig, managers: dict[str, KVCacheManagerLike] | list[str],
                 compare: bool = True) -> None:
        if isinstance(managers, (list, tuple)):
            managers = {k: make_manager(k, pool_config) for k in managers}
        self.pool_config = pool_config
        self.managers = dict(managers)
        self.kinds = list(self.managers)
        self.compare = compare and len(self.kinds) > 1
        self.reqs: dict[str, _ReqState] = {}
        self.trace = Trace(pool_config)
        self.num_applied = 0
        self.num_skipped = 0
        self.num_admission_rejections = 0
        self.num_step_rejections = 0
        self.num_prefix_hits = 0
        self.num_preemptions = 0
        self.num_async_batches = 0
        self.num_external_loads = 0
        self.num_async_loads = 0  # admissions as async KV loads (delay_cache_blocks)
        self.num_loads_done = 0
        self.num_external_hybrid = 0  # external tokens after a prefix hit on a pool of >= 2 groups
        self.num_boundary_admissions = 0  # admissions decided with <= 1 block of slack (reserve_slack)
        self.num_lookahead_hits = 0  # spec-decode steps (lookahead) of a request admitted with a hit, >= 3 groups
        self.num_admissions = 0
        # coverage of what the compared state went through (first implementation's view)
        self.num_evictions = 0  # ops after which a cached block lost its hash (reused for new data)
        self.num_null_slots = 0  # ops after which some table holds a null placeholder (window slid)
        self.num_partial_entries = 0  # ops after which a hash covers a block only partly
        self.num_cow_copies = 0  # copy-on-write pairs released (fine-grained partial hits)
        self._prev_cached: dict = {}
        #: KV cache events seen, by type (first implementation's stream), when events are compared
        self.num_events: dict[str, int] = {}
        self.num_resets = 0  # successful reset_prefix_cache ops
        self.num_held_views = 0  # frees while holding the get_blocks() view (compared after)
        self.num_connector_lookups = 0
        self.num_diverged_hits = 0  # connector lookups whose per-group hits diverged (hybrid Mamba)
        self.num_stats_taken = 0  # make_prefix_cache_stats ops that returned stats
        self.num_zeroed_blocks = 0  # block ids recorded for KV zeroing (compared in order)
        #: Mamba "align" boundary-state hand-offs drained (every step) and finishing producers'
        #: partial tails (issue #23), compared
        self.num_boundary_state_offloads = 0
        self.num_partial_tail_offloads = 0
        self.num_failed_loads = 0  # async loads that failed with a valid prefix (re-recorded for zeroing)
        self.num_junctions = 0  # lookups where a sparse group lagged a longer hit (shared_prefix_boundary > 0)
        self.compare_events = pool_config.enable_kv_cache_events and self._all_have("take_kv_events")
        #: time spent inside each implementation (calls, check_invariants, observation)
        self.seconds_by_kind: dict[str, float] = {}
        self.max_live = 0

    # -- queries the state machine uses to pick valid ops ------------------------------------

    def live(self) -> list[str]:
        return [r for r, s in self.reqs.items() if s.request.status != RequestStatus.FINISHED]

    def waiting(self) -> list[str]:
        return [r for r in self.live() if self._can_admit(self.reqs[r])]

    def running(self) -> list[str]:
        return [r for r in self.live() if self.reqs[r].request.status == RequestStatus.RUNNING]

    def steppable(self) -> list[str]:
        return [r for r in self.running() if self._num_schedulable(self.reqs[r]) > 0]

    def in_flight(self) -> list[str]:
        return [r for r in self.live() if self.reqs[r].batches]

    def loading(self) -> list[str]:
        return [r for r in self.live() if self.reqs[r].loading]

    def token_sequences(self) -> list[list[int]]:
        return [s.request.all_token_ids for s in self.reqs.values()]

    # -- what-if: ops on a scratch copy --------------------------------------------------------

    def probe(self, ops: list[Op], kind: str = "reference") -> Harness | None:
        """Apply ``ops`` to a scratch copy of the ``kind`` manager and of the requests (never to the
        compared managers; nothing is recorded in this trace) and return that scratch harness (its
        ``probe_results``: each op's result); None when ``kind`` is not driven here or an op raised.

        Generators use it to aim at the pool's edge: the largest reservation an admission still
        fits under, a filler request that leaves a step exactly the blocks it needs (or one short).
        The trace keeps only the plain ops chosen, so it replays without this."""
        if kind not in self.managers:
            return None
        state = (self.managers[kind], self.reqs)
        try:  # pickling is ~4x faster than deepcopy on the reference's linked blocks
            mgr, reqs = pickle.loads(pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception:  # noqa: BLE001 - an implementation that does not pickle: copy it instead
            mgr, reqs = copy.deepcopy(state)
        scratch = Harness(self.pool_config, {kind: mgr}, compare=False)
        scratch.reqs = reqs
        scratch.probe_results = []
        try:
            for op in ops:
                scratch.trace.ops.append(op)
                scratch.probe_results.append(getattr(scratch, f"_op_{op.name}")(op))
        except Divergence:
            return None
        return scratch

    # -- rules -------------------------------------------------------------------------------

    def _done(self, s: _ReqState) -> bool:
        r = s.request
        return (len(r.output_token_ids) + s.placeholders >= r.max_tokens
                or r.num_tokens + s.placeholders >= self.pool_config.max_model_len)

    def _can_admit(self, s: _ReqState) -> bool:
        r = s.request
        return (r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) and r.num_computed_tokens == 0
                and not s.loading and not self._done(s))

    def _num_schedulable(self, s: _ReqState) -> int:
        """Tokens the scheduler would schedule now (0 once the last token has been sampled)."""
        if self._done(s):
            return 0
        return s.request.num_tokens + s.placeholders - s.request.num_computed_tokens

    # -- applying ops ------------------------------------------------------------------------

    def apply(self, op: Op) -> OpResult:
        """Apply ``op`` to every manager, then compare and check. Raises :class:`Divergence`."""
        self.trace.ops.append(op)
        handler: Callable[[Op], OpResult] = getattr(self, f"_op_{op.name}")
        res = handler(op)
        if not res.skipped and op.name in ("admit", "step", "load_done"):
            self._release_block_copies(op)
            self._take_new_block_ids(op)
            self._take_boundary_state_offloads(op)
        self.num_applied += 1
        self.num_skipped += res.skipped
        self.max_live = max(self.max_live, len(self.live()))
        # ``add`` only queues a request here: no manager is called, so their state (checked after
        # the previous op) cannot have changed; a quarter of the generated ops are arrivals
        if not res.skipped and op.name != "add":
            self.check_state(op)
        return res

    def _release_block_copies(self, op: Op) -> None:
        """Copy-on-write pairs queued by the op (fine-grained hits) run with the step and their
        retained endpoints are freed, as vLLM's scheduler does at the end of ``schedule()``; the
        pairs themselves are compared."""
        if self._all_have("release_kv_cache_block_copies"):
            pairs = self._call("release_kv_cache_block_copies", op,
                               lambda _k, m: m.release_kv_cache_block_copies())
            self.num_cow_copies += len(pairs)

    def _take_new_block_ids(self, op: Op) -> None:
        """KV zeroing records (issue #23): the block ids recorded for the worker to zero, drained
        as vLLM's scheduler does every step (``take_new_block_ids``); compared in order."""
        if self._all_have("take_new_block_ids"):
            ids = self._call("take_new_block_ids", op, lambda _k, m: m.take_new_block_ids())
            self.num_zeroed_blocks += len(ids)

    def _take_boundary_state_offloads(self, op: Op) -> None:
        """Mamba "align" boundary-state hand-offs (issue #23), drained after the step as vLLM's
        scheduler does every ``schedule()``; compared per request, in order."""
        if self._all_have("take_boundary_state_offloads"):
            offloads = self._call("take_boundary_state_offloads", op,
                                  lambda _k, m: m.take_boundary_state_offloads())
            self.num_boundary_state_offloads += sum(map(len, offloads.values()))

    def _call(self, what: str, op: Op, fn: Callable[[str, KVCacheManagerLike], Any]) -> Any:
        """Call ``fn`` on every manager; the results must agree. Returns the first one."""
        results = {}
        for kind, mgr in self.managers.items():
            t = perf_counter()
            try:
                results[kind] = fn(kind, mgr)
            except Exception as exc:  # any exception is a finding: the harness only makes valid calls
                raise Divergence(self._where(op, f"{kind}.{what} raised {type(exc).__name__}: {exc}"),
                                 f"{op.name}: {kind}.{what} raised {type(exc).__name__}") from exc
            finally:
                self.seconds_by_kind[kind] = self.seconds_by_kind.get(kind, 0.0) + perf_counter() - t
        if self.compare:
            first = self.kinds[0]
            for kind in self.kinds[1:]:
                if results[kind] != results[first]:
                    raise Divergence(self._where(
                        op, f"{what} differs:\n  {first}: {results[first]!r}\n  {kind}: {results[kind]!r}"),
                        f"{op.name}: {what} differs")
        return results[self.kinds[0]]

    def _where(self, op: Op, msg: str) -> str:
        return f"after op #{len(self.trace.ops) - 1} {op}: {msg}"

    def _op_add(self, op: Op) -> OpResult:
        if op.rid in self.reqs:
            return OpResult(op, True)
        req = Request(op.rid, list(op.prompt), max_tokens=op.max_tokens, cache_salt=op.cache_salt,
                      arrival_time=float(len(self.reqs)),
                      mm_features=tuple(MultiModalFeatureSpec(ident, PlaceholderRange(offset, length))
                                        for ident, offset, length in op.mm),
                      lora_request=None if op.lora is None else LoRARequest(*op.lora),
                      prompt_embeds=None if op.embeds is None else tuple(bytes.fromhex(r) for r in op.embeds),
                      session_id=op.session_id, skip_reading_prefix_cache=op.skip_reading,
                      kv_cache_report_mode="full" if op.report_full else "incremental")
        self.reqs[op.rid] = _ReqState(req)
        return OpResult(op, False)

    def _schedule(self, s: _ReqState, num_new: int, in_flight: bool, token: int) -> None:
        """The scheduler's ``_update_after_schedule`` (+ ``update_from_output`` when synchronous)."""
        r = s.request
        r.num_computed_tokens += num_new
        r.num_in_flight_tokens += num_new
        samples = r.num_computed_tokens >= r.num_tokens + s.placeholders
        s.batches.append(_Batch(num_new, token if samples else None))
        self.num_async_batches += in_flight
        if samples:
            s.placeholders += 1
        if not in_flight:
            self._process(s, op_for_errors=None)

    def _process(self, s: _ReqState, op_for_errors: Op | None) -> None:
        """``update_from_output`` for the oldest batch; a request that reached its length stops."""
        r = s.request
        b = s.batches.popleft()
        r.num_in_flight_tokens -= b.num_tokens
        if b.stale:
            r.num_stale_output_tokens -= b.num_tokens
        if b.token is not None:
            if not b.stale:
                s.placeholders -= 1
            r.output_token_ids.append(b.token)
        if self._done(s) and not s.batches and s.placeholders == 0:
            self._finish(s, op_for_errors or self.trace.ops[-1])

    def _op_admit(self, op: Op) -> OpResult:
        s = self.reqs.get(op.rid)
        if s is None or not self._can_admit(s):
            return OpResult(op, True)
        r = s.request
        if self._all_have("get_computed_blocks_and_boundary"):
            # the scheduler stores the third result on the request: sparse retention keeps the
            # junction's tail when the request publishes (issue #23)
            hit_ids, num_hit, r.shared_prefix_boundary = self._call(
                "get_computed_blocks", op, lambda k, m: m.get_computed_blocks_and_boundary(r))
            self.num_junctions += r.shared_prefix_boundary > 0
        else:
            hit_ids, num_hit = self._call("get_computed_blocks", op, lambda k, m: m.get_computed_blocks(r))
        self.num_prefix_hits += num_hit > 0
        if num_hit >= r.num_tokens:  # cannot happen: hits stop at num_tokens - 1
            raise Divergence(self._where(op, f"hit of {num_hit} tokens covers all {r.num_tokens} tokens"),
                             f"{op.name}: a hit covers the whole request")
        external = self._external_tokens(op, r, num_hit)
        is_async = op.async_load and external > 0  # vLLM loads asynchronously only what the connector has
        num_new = 0 if is_async else min(r.num_tokens - num_hit - external, op.chunk)
        has_scheduled = bool(self.running())
        reserved = op.reserved_blocks
        if op.reserve_slack >= 0:
            free = self.managers[self.kinds[0]].get_num_free_blocks()  # equal on all (compared every op)
            reserved = max(0, free - op.reserve_slack)
            self.num_boundary_admissions += op.reserve_slack <= 1
        # an async load writes the prefix-cacheable groups' blocks (the connector default,
        # get_loaded_kv_cache_group_ids): they are not zeroed, which would race with the load
        skip = {"skip_zeroing_group_ids": tuple(
            i for i, g in enumerate(self.pool_config.groups) if g.kv_cache_spec.prefix_cacheable)} \
            if is_async and self._all_have("take_new_block_ids") else {}
        out = self._call("allocate_slots(admission)", op, lambda k, m: m.allocate_slots(
            r, num_new, num_hit, hit_ids, num_external_computed_tokens=external, delay_cache_blocks=is_async,
            full_sequence_must_fit=op.full_sequence_must_fit, reserved_blocks=reserved,
            has_scheduled_reqs=has_scheduled, **skip))
        if out is None:
            self.num_admission_rejections += 1
            return OpResult(op, False, None)
        if self._all_have("record_prefix_cache_stats"):  # the scheduler records at admission
            self._call("record_prefix_cache_stats", op, lambda k, m: m.record_prefix_cache_stats(r, num_hit))
        s.holds_blocks = True
        self.num_admissions += 1
        self.num_external_loads += external > 0
        self.num_external_hybrid += external > 0 and num_hit > 0 and len(self.pool_config.groups) > 1
        s.admitted_with_hit = num_hit > 0
        r.num_computed_tokens = num_hit + external
        if is_async:
            # WAITING_FOR_REMOTE_KVS: blocks held, nothing scheduled, not preemptible until load_done
            s.loading = True
            self.num_async_loads += 1
            return OpResult(op, False, (hit_ids, num_hit, out))
        r.status = RequestStatus.RUNNING
        self._schedule(s, num_new, op.in_flight, op.token)
        return OpResult(op, False, (hit_ids, num_hit, out))

    def _op_load_done(self, op: Op) -> OpResult:
        """vLLM's ``_update_waiting_for_remote_kv`` on a successful load: the blocks are cached up
        to the loaded tokens, and the request is scheduled again (here: it runs; its next ``step``
        allocates the rest of its prompt)."""
        s = self.reqs.get(op.rid)
        if s is None or not s.loading or s.request.status == RequestStatus.FINISHED:
            return OpResult(op, True)
        r = s.request
        if op.valid_tokens >= 0 and self._all_have("record_blocks_for_zeroing"):
            return self._load_failed(s, op)
        self._call("cache_blocks(load done)", op, lambda k, m: cache_blocks(m, r, r.num_computed_tokens))
        s.loading = False
        r.status = RequestStatus.RUNNING
        self.num_loads_done += 1
        return OpResult(op, False)

    def _load_failed(self, s: _ReqState, op: Op) -> OpResult:
        """vLLM's ``_update_waiting_for_remote_kv`` after a failed load: the request keeps the valid
        prefix (block-aligned: the first invalid block and all after it are recomputed), its blocks
        are cached up to it and, when the cache needs zeroing, re-recorded for zeroing from there
        (their zeroing was skipped for the load); with nothing valid its blocks are freed and it
        waits for a new admission."""
        r = s.request
        sbs = self.pool_config.scheduler_block_size
        valid = min(op.valid_tokens, r.num_computed_tokens) // sbs * sbs
        s.loading = False
        self.num_failed_loads += 1
        if valid == 0:
            self._free(s, op, "failed load")
            s.holds_blocks = False
            r.num_computed_tokens = 0
            r.status = RequestStatus.WAITING
            return OpResult(op, False)
        r.num_computed_tokens = valid
        self._call("cache_blocks(failed load)", op, lambda k, m: cache_blocks(m, r, valid))
        if needs_kv_cache_zeroing(self.pool_config.groups):
            self._call("record_blocks_for_zeroing", op, lambda k, m: m.record_blocks_for_zeroing(r.request_id, valid))
        r.status = RequestStatus.RUNNING
        return OpResult(op, False)

    def _external_tokens(self, op: Op, r: Request, num_hit: int) -> int:
        """Tokens a KV connector claims after the local hit (synchronous load, ``delay_cache_blocks``
        False): whole scheduler blocks, never the last token (it is recomputed for logits)."""
        if op.external <= 0:
            return 0
        sbs = self.pool_config.scheduler_block_size
        end = min(num_hit + op.external, r.num_tokens - 1)
        end -= end % sbs
        return max(0, end - num_hit)

    def _op_step(self, op: Op) -> OpResult:
        s = self.reqs.get(op.rid)
        if s is None or s.request.status != RequestStatus.RUNNING:
            return OpResult(op, True)
        num_new = min(self._num_schedulable(s), op.chunk,
                      self.pool_config.max_model_len - s.request.num_computed_tokens)
        if num_new <= 0:
            return OpResult(op, True)
        r = s.request
        out = self._call("allocate_slots(running)", op, lambda k, m: m.allocate_slots(
            r, num_new, num_lookahead_tokens=op.lookahead))
        if out is None:
            self.num_step_rejections += 1
            return OpResult(op, False, None)
        self.num_lookahead_hits += (op.lookahead > 0 and s.admitted_with_hit
                                    and len(self.pool_config.groups) >= 3)
        self._schedule(s, num_new, op.in_flight, op.token)
        return OpResult(op, False, out)

    def _op_process(self, op: Op) -> OpResult:
        s = self.reqs.get(op.rid)
        if s is None or not s.batches or s.request.status == RequestStatus.FINISHED:
            return OpResult(op, True)
        self._process(s, op)
        return OpResult(op, False)

    def _op_preempt(self, op: Op) -> OpResult:
        s = self.reqs.get(op.rid)
        if s is None or s.request.status != RequestStatus.RUNNING:
            return OpResult(op, True)
        r = s.request
        self._free(s, op, "preempt")
        s.holds_blocks = False
        r.status = RequestStatus.PREEMPTED
        r.num_computed_tokens = 0
        r.num_preemptions += 1
        self.num_preemptions += 1
        s.placeholders = 0
        r.num_stale_output_tokens = r.num_in_flight_tokens
        for b in s.batches:
            b.stale = True
        return OpResult(op, False)

    def _op_finish(self, op: Op) -> OpResult:
        s = self.reqs.get(op.rid)
        if s is None or s.request.status == RequestStatus.FINISHED:
            return OpResult(op, True)
        self._finish(s, op)
        return OpResult(op, False)

    def _finish(self, s: _ReqState, op: Op) -> None:
        r = s.request
        if s.holds_blocks and self._all_have("finalize_partial_tail_offloads"):
            # a KV producer's finish, before the free (vLLM's _free_request); compared
            tails = self._call("finalize_partial_tail_offloads", op,
                               lambda _k, m: m.finalize_partial_tail_offloads(r))
            self.num_partial_tail_offloads += len(tails)
        self._free(s, op, "finish")
        r.status = RequestStatus.FINISHED
        s.holds_blocks = False
        s.loading = False
        s.batches.clear()
        for m in self.managers.values():
            forget = getattr(m, "forget", None)
            if forget is not None:
                forget(r.request_id)

    def _free(self, s: _ReqState, op: Op, why: str) -> None:
        """``free``; with ``hold_view`` while holding the request's ``get_blocks()`` result, which
        must still show the table as it was (vLLM frees ``reversed(...)``; issue #23)."""
        r = s.request
        if not (op.args.get("hold_view") and s.holds_blocks and self._all_have("free_holding_view")):
            self._call(f"free({why})", op, lambda k, m: m.free(r))
            return
        before = {k: m.get_block_ids(r.request_id) for k, m in self.managers.items()}
        after = self._call(f"free({why}) holding get_blocks()", op, lambda k, m: m.free_holding_view(r))
        kind = self.kinds[0]
        if after != before[kind]:
            raise Divergence(self._where(op, f"{kind}: the get_blocks() view held across free changed: "
                                             f"{before[kind]} -> {after}"),
                             f"{op.name}: {kind}: held get_blocks() view changed by free")
        self.num_held_views += 1

    def _op_connector_lookup(self, op: Op) -> OpResult:
        """A KV connector's local lookup for a waiting request, then the hit truncated at an aligned
        endpoint (a multiple of ``scheduler_block_size``, within every token-indexed group's hit)."""
        s = self.reqs.get(op.rid)
        if s is None or not self._can_admit(s) or not self._all_have("get_computed_blocks_for_connector"):
            return OpResult(op, True)
        r = s.request
        ids, num_hit, _boundary, diverged = self._call(
            "get_computed_blocks_for_connector", op, lambda k, m: m.get_computed_blocks_for_connector(r))
        self.num_connector_lookups += 1
        self.num_diverged_hits += bool(diverged)
        sbs = self.pool_config.scheduler_block_size
        end = min(op.truncate, num_hit)
        for g, group in enumerate(self.pool_config.groups):
            spec = group.kv_cache_spec
            if spec.prefix_cacheable and not _is_mamba_spec(spec):
                end = min(end, len(ids[g]) * spec.block_size)
        end -= end % sbs
        out = self._call("truncate_computed_blocks", op, lambda k, m: m.truncate_computed_blocks(ids, end))
        return OpResult(op, False, (ids, num_hit, out))

    def _op_make_prefix_cache_stats(self, op: Op) -> OpResult:
        if not self._all_have("make_prefix_cache_stats"):
            return OpResult(op, True)
        stats = self._call("make_prefix_cache_stats", op, lambda k, m: m.make_prefix_cache_stats())
        self.num_stats_taken += stats is not None
        return OpResult(op, False, stats)

    def _op_reset_prefix_cache(self, op: Op) -> OpResult:
        if not self._all_have("reset_prefix_cache"):
            return OpResult(op, True)
        if op.reset_running_requests:
            for rid in reversed(self.running()):  # vLLM pops running from the back
                s = self.reqs[rid]
                self._op_preempt(Op("preempt", {"rid": rid}))
                for b in s.batches:  # drop_stale_output=True: in-flight output is discarded
                    b.token = None
        ok = self._call("reset_prefix_cache", op, lambda k, m: m.reset_prefix_cache())
        self.num_resets += bool(ok)
        return OpResult(op, False, ok)

    def _op_evict_blocks(self, op: Op) -> OpResult:
        if not self._all_have("evict_blocks"):
            return OpResult(op, True)
        n = self.pool_config.num_blocks
        ids = {b for b in op.block_ids if 0 < b < n}  # one set: every manager walks it in one order
        self._call("evict_blocks", op, lambda k, m: m.evict_blocks(ids))
        return OpResult(op, False)

    def _op_new_step(self, op: Op) -> OpResult:
        for m in self.managers.values():
            hook = getattr(m, "new_step_starts", None)
            if hook is not None:
                hook()
        return OpResult(op, False)

    # -- comparing state ---------------------------------------------------------------------

    def observe(self, kind: str) -> dict[str, Any]:
        """Everything comparable about one manager right now."""
        m = self.managers[kind]
        out = {
            "block_ids": {rid: m.get_block_ids(rid) for rid, s in self.reqs.items() if s.holds_blocks},
            "num_free_blocks": m.get_num_free_blocks(),
            "free_block_queue": m.free_block_queue(),
            "cached_blocks": m.cached_blocks(),
        }
        if self._all_have("cached_block_num_tokens"):
            # optional: how many prefix tokens each primary hash covers (partial entries end mid-block)
            out["cached_block_num_tokens"] = m.cached_block_num_tokens()  # type: ignore[attr-defined]
        if self._all_have("request_block_hashes"):  # issue #23: hashes, stats, usage, connector views
            out["request_block_hashes"] = {rid: m.request_block_hashes(s.request)  # type: ignore[attr-defined]
                                           for rid, s in self.reqs.items()
                                           if s.request.status != RequestStatus.FINISHED}
        if all(hasattr(x, "usage") for x in self.managers.values()):
            out["usage"] = m.usage  # type: ignore[attr-defined]
        if self._all_have("prefix_cache_stats"):
            out["prefix_cache_stats"] = m.prefix_cache_stats()  # type: ignore[attr-defined]
        if self._all_have("get_block_ids_for_computed_tokens"):
            held = [(rid, s.request) for rid, s in self.reqs.items() if s.holds_blocks]
            out["block_ids_for_computed_tokens"] = {
                rid: m.get_block_ids_for_computed_tokens(rid, r.num_computed_tokens)  # type: ignore[attr-defined]
                for rid, r in held}
            out["estimate_cached_tokens"] = {rid: m.estimate_cached_tokens(r)  # type: ignore[attr-defined]
                                             for rid, r in held}
        return out

    def _all_have(self, method: str) -> bool:
        return all(callable(getattr(m, method, None)) for m in self.managers.values())

    def check_state(self, op: Op) -> None:
        obs = {}
        for kind, m in self.managers.items():
            t = perf_counter()
            try:
                m.check_invariants()
            except AssertionError as exc:
                raise Divergence(self._where(op, f"{kind}.check_invariants: {exc}"),
                                 signature(f"{kind}.check_invariants: {exc}")) from exc
            obs[kind] = o = self.observe(kind)
            self.seconds_by_kind[kind] = self.seconds_by_kind.get(kind, 0.0) + perf_counter() - t
            self._check_protocol_invariants(kind, op, o)
        self._record_coverage(obs[self.kinds[0]])
        if self.compare_events:
            self._compare_events(op)
        if not self.compare:
            return
        first = self.kinds[0]
        for kind in self.kinds[1:]:
            for key in obs[first]:
                a, b = obs[first][key], obs[kind][key]
                if a != b:
                    raise Divergence(self._where(op, f"{key} differs:\n  {first}: {_short(a)}\n  {kind}: {_short(b)}"
                                                 + _diff_hint(a, b)), f"{op.name}: {key} differs")

    def _compare_events(self, op: Op) -> None:
        """Take every manager's queued KV cache events; the streams must be equal, event by event."""
        streams = {kind: m.take_kv_events() for kind, m in self.managers.items()}  # type: ignore[attr-defined]
        first = self.kinds[0]
        for e in streams[first]:
            self.num_events[e["type"]] = self.num_events.get(e["type"], 0) + 1
        if not self.compare:
            return
        for kind in self.kinds[1:]:
            a, b = streams[first], streams[kind]
            if a != b:
                i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                raise Divergence(self._where(
                    op, f"KV cache events differ at event {i} ({len(a)} vs {len(b)} events):"
                        f"\n  {first}: {_short(a[i:i + 2])}\n  {kind}: {_short(b[i:i + 2])}"),
                    f"{op.name}: KV cache events differ")

    def _record_coverage(self, o: dict[str, Any]) -> None:
        cached = o["cached_blocks"]
        self.num_evictions += any(k not in cached for k in self._prev_cached)
        self._prev_cached = cached
        self.num_null_slots += any(0 in group for ids in o["block_ids"].values() for group in ids)
        sizes = [g.kv_cache_spec.block_size for g in self.pool_config.groups]
        self.num_partial_entries += any(n is not None and n % sizes[g] for (g, _), n
                                        in o.get("cached_block_num_tokens", {}).items())

    def _check_protocol_invariants(self, kind: str, op: Op, o: dict[str, Any]) -> None:
        n = self.pool_config.num_blocks
        queue = o["free_block_queue"]

        def fail(msg: str) -> None:
            raise Divergence(self._where(op, f"{kind}: {msg}"), signature(f"{op.name}: {kind}: {msg}"))

        if len(queue) != o["num_free_blocks"]:
            fail(f"free queue length {len(queue)} != get_num_free_blocks() {o['num_free_blocks']}")
        if len(set(queue)) != len(queue) or any(not 1 <= b < n for b in queue):
            fail(f"free queue has duplicates or bad ids: {queue}")
        held: set[int] = set()
        for rid, ids in o["block_ids"].items():
            if len(ids) != len(self.pool_config.groups):
                fail(f"{rid}: {len(ids)} groups of block ids, expected {len(self.pool_config.groups)}")
            mine: set[int] = set()
            for g, group_ids in enumerate(ids):
                real = [b for b in group_ids if b != 0]
                if len(set(real)) != len(real) or mine & set(real):
                    fail(f"{rid}: a block id appears twice in its tables: {ids}")
                mine |= set(real)
            held |= mine
        if held & set(queue):
            fail(f"blocks both held and free: {sorted(held & set(queue))}")
        if len(held) + len(queue) != n - 1:
            fail(f"held ({len(held)}) + free ({len(queue)}) != num_blocks - 1 ({n - 1}): blocks leaked")
        for (g, b), h in o["cached_blocks"].items():
            if not 0 <= g < len(self.pool_config.groups) or not 1 <= b < n or not isinstance(h, bytes):
                fail(f"bad cached block entry {(g, b)}: {h!r}")


def _is_mamba_spec(spec: Any) -> bool:
    from kvref.spec.kv_cache_interface import MambaSpec, UniformTypeKVCacheSpecs

    if isinstance(spec, UniformTypeKVCacheSpecs):
        return any(isinstance(x, MambaSpec) for x in spec.kv_cache_specs.values())
    return isinstance(spec, MambaSpec)


def cache_blocks(m: KVCacheManagerLike, request: Request, num_computed_tokens: int) -> None:
    """vLLM's ``KVCacheManager.cache_blocks`` on any implementation (all three adapters have it)."""
    fn = getattr(m, "cache_blocks", None)
    if fn is None:
        raise TypeError(f"{type(m).__name__} has no cache_blocks(request, num_computed_tokens): "
                        "async KV loads need it")
    fn(request, num_computed_tokens)


def _short(v: Any, limit: int = 600) -> str:
    s = repr(v)
    return s if len(s) <= limit else s[:limit] + f"... ({len(s)} chars)"


def _diff_hint(a: Any, b: Any) -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        only_a = sorted(set(a) - set(b), key=repr)[:8]
        only_b = sorted(set(b) - set(a), key=repr)[:8]
        changed = sorted((k for k in set(a) & set(b) if a[k] != b[k]), key=repr)[:8]
        return f"\n  keys only in first: {only_a}\n  keys only in second: {only_b}\n  values differ at: {changed}"
    if isinstance(a, tuple) and isinstance(b, tuple):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return f"\n  first difference at index {i}: {x!r} vs {y!r}"
        return f"\n  lengths {len(a)} vs {len(b)}"
    return ""


@dataclass
class ReplayReport:
    applied: int
    skipped: int
    error: Divergence | None

    @property
    def ok(self) -> bool:
        return self.error is None


def replay(trace: Trace, kinds: list[str] | tuple[str, ...] = ("reference", "vllm")) -> ReplayReport:
    """Replay ``trace`` on fresh managers of ``kinds``; report the first divergence, if any."""
    h = Harness(trace.pool_config, list(kinds))
    try:
        for op in trace.ops:
            h.apply(op)
    except Divergence as exc:
        return ReplayReport(h.num_applied, h.num_skipped, exc)
    return ReplayReport(h.num_applied, h.num_skipped, None)


def main(argv: list[str] | None = None) -> int:
    """``python -m kvref.models.conformance.differential TRACE.json [--kinds reference,vllm]``: replay a trace."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kvref.models.conformance.differential", description=main.__doc__)
    ap.add_argument("trace", help="a kvref trace JSON file (saved by the state machine on a failure)")
    ap.add_argument("--kinds", default="reference,vllm",
                    help="comma-separated implementations to drive side by side (default: reference,vllm)")
    args = ap.parse_args(argv)
    trace = Trace.load(args.trace)
    kinds = [k for k in args.kinds.split(",") if k]
    report = replay(trace, kinds)
    print(f"{args.trace}: {len(trace.ops)} ops, {report.applied} applied, {report.skipped} skipped; "
          f"kinds={','.join(kinds)}")
    if report.ok:
        print("OK: no divergence, all invariants hold")
        return 0
    print(f"DIVERGENCE: {report.error}")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
