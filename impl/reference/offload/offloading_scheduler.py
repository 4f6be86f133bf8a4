"""Scheduler side of vLLM's OffloadingConnector (``kv_connector/v1/offloading/scheduler.py``).

Chunks of ``blocks_per_chunk`` GPU blocks are keyed by the hash of their last hash unit plus the
group (:mod:`.keys`) and stored in / loaded from an offloading manager (the CPU manager here).

* Lookup (:mod:`.lookup`): full-attention groups left to right, windowed groups right to left,
  to a fixed point. A request with transfers still pending is asked to come back later
  (``None``), as is one whose hit chunks another request is loading (PR 29087).
* Loads: after allocation, the unhashed blocks from the local prefix to the hit end are filled
  from the hit chunks (one job per request, pinned in the manager until the workers report it).
* Stores: each step, for every scheduled or finished request, the chunks that became computed
  (prompt only by default) and are reachable by some future hit (the same mask the GPU cache
  uses for sliding windows) are offered to the manager; what it accepts becomes one store job
  whose source is the chunks' non-null blocks.
* Fences: a store's source blocks must not be overwritten before the copy finishes. Running
  full-attention blocks are protected by their ref counts, but sliding-window blocks can leave
  the window and be re-allocated while the request still runs, so they are fenced at once; the
  full-attention ones only when the request finishes. A fenced block re-allocated in a step
  makes that step flush (wait for) the job. Preempted requests' stores are flushed too.
* Jobs complete when all ``num_workers`` have reported them, in any order and across steps.

Modelled subset (0.33.0 semantics): full-attention (incl. MLA), sliding-window (with MTP's
``extra_retained_tokens``) and chunked-local groups (PR 51161: windowed, one attention chunk),
Mamba "align" groups with their boundary-state stores (:mod:`.boundary_stores`),
``tokens_per_hash == tokens_per_block``, or finer hashes on full attention + Mamba "align" pools with
one block a chunk, where vLLM's partial tails (states inside a block) are stored, looked up and
loaded (:mod:`.partial_tails`, EAGLE drafter groups there at their proof margin), CHUNK_LEVEL policy,
GPU prefix caching on, EAGLE/MTP drafter groups (``eagle_groups``), synchronous
loads (:mod:`.sync_loads`), vLLM's ``prefix_cache_retention_interval`` (sliding-window stores
masked to the retained tails, :func:`swa_store_mask`). A request's
``kv_transfer_params`` give its load tier filter (no effect on the CPU tier) and its
``max_load_tokens`` / ``max_offload_tokens`` caps (:mod:`.tier_filter`); the external hit is split
by source (:meth:`OffloadingConnectorScheduler.get_external_cache_hit_sources`). KV events (placeholder or self-describing payloads) through
:class:`.offload_event_tracker.OffloadingEventsTracker`: stores and full-attention lookup hits
snapshot their chunk's payload, :meth:`OffloadingConnectorScheduler.take_events` translates the
manager's events.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from itertools import chain

from kvref.impl.request import Request
from kvref.spec.errors import InvalidFieldError, check_int, check_sequence
from kvref.spec.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from kvref.spec.mathutil import cdiv

from ..block_hash import BlockHash, RequestBlockHasher
from ..sliding_window_manager import SlidingWindowManager
from .cpu_offloading_manager import CPUOffloadingManager
from .keys import (
    LookupResult,
    OffloadKey,
    OffloadStateError,
    RequestContext,
    get_sliding_window_size_in_chunks,
    make_offload_key,
)
from .boundary_stores import aligned_boundary_stores, check_handoffs, make_boundary_key
from .partial_tails import PartialTails
from .lookup import LookupGroup, lookup_complete_chunks, lookup_order
from .offload_event_tracker import OffloadingEventsTracker
from .sync_loads import SyncLoadBudget
from . import tier_filter
from .tier_filter import TierFilter, request_tier_filter, token_cap


@dataclass(frozen=True)
class GroupOffloadConfig:
    group_idx: int
    spec: KVCacheSpec
    tokens_per_block: int
    tokens_per_chunk: int
    hashes_per_chunk: int
    window: int | None  # sliding_window_size_in_chunks
    # Mamba "align": the group's states come from the GPU cache's boundary hand-offs
    # (:mod:`.boundary_stores`), never from the connector's copy of the block table
    requires_cow_source: bool = False
    # the group holds EAGLE/MTP drafter layers (vLLM ``KVCacheGroupSpec.is_eagle_group``)
    is_eagle_group: bool = False

    def lookup_group(self) -> LookupGroup:
        sw = self.spec if isinstance(self.spec, SlidingWindowSpec) else None
        return LookupGroup(self.tokens_per_chunk, self.window, sw.sliding_window if sw else None,
                           sw.extra_retained_tokens if sw else 0, self.is_eagle_group)


def swa_store_mask(spec: SlidingWindowSpec, start_block: int, end_block: int, alignment_tokens: int | None,
                   final_segment_end_block: int | None, retention_interval: int | None = None,
                   reachable_boundaries: Sequence[int] = (), use_eagle: bool = False) -> list[bool] | None:
    """Blocks of a sliding-window group some aligned hit could need; None = all. vLLM
    ``_reachable_store_block_mask``: the GPU cache's own ``SlidingWindowManager.reachable_block_mask``
    (``use_eagle`` for a drafter group: the run a hit needs is a block longer and ends a block
    later, and no final-segment tail is kept) on the spec widened by ``extra_retained_tokens`` (the offloader restores all it
    kept, PR 41228).

    Dense (``retention_interval`` None): a hit ends on an ``alignment_tokens`` boundary and needs
    the ``cdiv(window - 1, block)`` blocks before it; the final (partial) segment of a request keeps
    the tail before its end too. Sparse (vLLM's ``prefix_cache_retention_interval``, 0 or a multiple
    of the chunk): one tail per interval-long segment (none under 0), plus the tail ending at each
    of ``reachable_boundaries`` (the replay boundary ``num_prompt_tokens - 1`` and the request's
    shared-prefix junction), floored to the alignment.
    """
    if spec.extra_retained_tokens:
        spec = replace(spec, sliding_window=spec.sliding_window + spec.extra_retained_tokens,
                       extra_retained_tokens=0)
    return SlidingWindowManager.reachable_block_mask(
        start_block, end_block, alignment_tokens, spec, use_eagle, retention_interval=retention_interval,
        reachable_boundaries=reachable_boundaries, final_segment_end_block=final_segment_end_block)


@dataclass
class _GroupState:
    offload_keys: list[OffloadKey] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)  # connector copy; 0 = null or stale
    next_stored_chunk_idx: int = 0


@dataclass
class _ReqState:
    req: Request
    ctx: RequestContext
    groups: tuple[_GroupState, ...]
    num_locally_computed_tokens: int = 0
    transfer_jobs: set[int] = field(default_factory=set)
    finished: bool = False
    aborted: bool = False
    finished_signaled: bool = False
    lookup_deferred: bool = False  # a lookup answered "later" and no answer came since
    # from kv_transfer_params (.tier_filter): the load tier filter and the load / store caps
    load_tier_filter: TierFilter = tier_filter.ALL
    max_load_tokens: int | None = None
    max_offload_tokens: int | None = None
    # the token ranges each loaded key covers (for get_external_cache_hit_sources)
    load_key_ranges: list[tuple[int, int]] = field(default_factory=list)
    # the hash boundary inside a block the last lookup hit (.partial_tails), consumed by the load
    partial_tail_boundary: int | None = None
    # a lookup of it loaded from the offload tier (vLLM ``loaded_from_offload``): with an EAGLE proof
    # margin only such a request stores its partial tail (.partial_tails)
    loaded_from_offload: bool = False


@dataclass
class _Job:
    req_id: str
    pending_count: int
    keys: set[OffloadKey]
    is_store: bool
    deferred_fence_block_ids: list[int] = field(default_factory=list)
    fenced_block_ids: list[int] = field(default_factory=list)
    is_sync_load: bool = False  # copied before the step's forward: stores may run beside it


@dataclass(frozen=True)
class TransferJob:
    """What a worker gets: ``block_ids`` are GPU blocks, ``chunk_ids`` CPU chunks."""

    req_id: str
    keys: tuple[OffloadKey, ...]
    block_ids: tuple[int, ...]
    chunk_ids: tuple[int, ...]
    sync: bool = False  # a load the worker finishes before this step's forward pass (.sync_loads)


@dataclass
class OffloadingStep:
    """The parts of vLLM's ``SchedulerOutput`` the connector reads. ``scheduled`` is in
    ``yield_req_data`` order (new requests first); ``num_scheduled_tokens`` in scheduling order.
    Finished requests' store jobs are built in the iteration order of ``finished_req_ids`` (a set
    in vLLM too), so job ids among them follow that order."""

    scheduled: list[tuple[str, tuple[list[int], ...] | None, bool]] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # the step's Mamba "align" boundary-state hand-offs (``kv_connector_block_state``):
    # {request_id: [(group_id, block_id, boundary_tokens), ...]}
    boundary_state_offloads: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)
    # the step's copy-on-write pairs ``(source, destination)`` block ids (``kv_cache_block_copies``:
    # sub-block Mamba hits copy a state into a fresh block before the forward pass)
    kv_cache_block_copies: list[tuple[int, int]] = field(default_factory=list)


@dataclass(frozen=True)
class OffloadingMeta:
    load_jobs: dict[int, TransferJob]
    store_jobs: dict[int, TransferJob]
    jobs_to_flush: frozenset[int]


def _check_eagle_groups(eagle_groups: object, specs: Sequence[KVCacheSpec]) -> frozenset[int]:
    """The EAGLE group indices, checked: distinct attention groups of ``specs`` (drafters hold no
    Mamba layers)."""
    if not isinstance(eagle_groups, (list, tuple, set, frozenset)) or not all(
            type(i) is int and 0 <= i < len(specs) for i in eagle_groups):
        raise InvalidFieldError("eagle_groups", eagle_groups, f"group indices in [0, {len(specs)})")
    for i in eagle_groups:
        if isinstance(specs[i], MambaSpec):
            raise InvalidFieldError(f"eagle_groups[{i}]", i, "an attention group (drafters hold no Mamba layers)")
    return frozenset(eagle_groups)


def _check_retention_interval(retention_interval: int | None, groups: Sequence[GroupOffloadConfig]) -> None:
    """vLLM ``SchedulerOffloadConfig.from_spec`` refuses (``ValueError``) a negative interval, and
    one that is not a multiple of a windowed group's chunk (its sparse tails must end on the chunks
    the connector stores); full-attention groups cache densely and ignore it."""
    if retention_interval is None:
        return
    if retention_interval < 0:
        raise InvalidFieldError("retention_interval", retention_interval, "None or a non-negative int")
    for c in groups:
        if c.window is not None and retention_interval % c.tokens_per_chunk:
            raise InvalidFieldError("retention_interval", retention_interval,
                                    f"a multiple of group {c.group_idx}'s tokens_per_chunk={c.tokens_per_chunk} "
                                    "(a windowed group)")


def _check_request(req: object) -> None:
    if not isinstance(req, Request):
        raise InvalidFieldError("req", req, "a kvref.impl.request.Request")


class OffloadingConnectorScheduler(PartialTails):
    """Args:
        specs: the GPU KV cache groups' specs (full attention, sliding window, chunked local or
            Mamba in "align" mode).
            A chunked-local group is windowed like a sliding-window one (``cdiv(attention_chunk,
            chunk)`` trailing chunks, looked up from the right, sources fenced at creation) but
            keeps every block it holds (no store mask, no widening of the load window).
            A Mamba "align" group is a window of one chunk in the lookup, which rounds the hit down
            to its chunk (``resolve_mamba_align_size``); it loads the state at the hit's end and
            stores only the boundary states the GPU cache hands over (:mod:`.boundary_stores`).
        manager: the offloading manager (a :class:`CPUOffloadingManager`).
        tokens_per_hash: request hash granularity: every group's block size, or a divisor of it on a
            full-attention + Mamba "align" pool with one block a chunk (partial tails).
        blocks_per_chunk: GPU blocks per offloaded chunk.
        num_workers: reports a job needs to complete.
        offload_prompt_only: store prompt chunks only (vLLM's default).
        events_tracker: the KV event payload tracker (None: events off; the manager then has no
            events either).
        sync_load_budget_bytes: bytes per step loaded synchronously (``kv_connector_extra_config``;
            0: every load asynchronous), see :mod:`.sync_loads`.
        kv_bytes_per_token: what one token costs the budget (every group's bytes per token).
        retention_interval: vLLM's ``prefix_cache_retention_interval`` (``SchedulerOffloadConfig``):
            None stores every reachable sliding-window chunk (dense); 0 only the tails at the
            request's replay boundary and shared-prefix junction; k > 0 those plus one tail per
            k-token segment. As in vLLM's ``from_spec`` it must be non-negative and, where a group
            is windowed (sliding window, chunked local, Mamba), a multiple of its chunk.
        eagle_groups: indices of the groups holding EAGLE/MTP drafter layers (vLLM's
            ``is_eagle_group``): their trailing hit chunk is popped in the lookup, their last
            offloadable chunk is not stored while the request decodes (a rejected draft may rewrite
            it; stored once the request finished, #52735), and a sliding-window one keeps the
            EAGLE store mask. Full-attention, sliding-window and chunked-local groups only; on a
            partial-tail pool a drafter group's tail is keyed at its EAGLE proof margin past the
            boundary (:mod:`.partial_tails`).
    """

    def __init__(self, specs: Sequence[KVCacheSpec], manager: CPUOffloadingManager, tokens_per_hash: int,
                 blocks_per_chunk: int = 1, num_workers: int = 1, offload_prompt_only: bool = True,
                 block_hasher: Callable[[Request], list[BlockHash]] | None = None,
                 events_tracker: OffloadingEventsTracker | None = None, sync_load_budget_bytes: int = 0,
                 kv_bytes_per_token: int = 0, retention_interval: int | None = None,
                 eagle_groups: Sequence[int] = ()) -> None:
        check_int("tokens_per_hash", tokens_per_hash, minimum=1)
        check_int("retention_interval", retention_interval, allow_none=True)
        if events_tracker is not None and not isinstance(events_tracker, OffloadingEventsTracker):
            raise InvalidFieldError("events_tracker", events_tracker, "an OffloadingEventsTracker or None")
        check_int("blocks_per_chunk", blocks_per_chunk, minimum=1)
        check_int("num_workers", num_workers, minimum=1)
        if not isinstance(manager, CPUOffloadingManager):
            raise InvalidFieldError("manager", manager, "a CPUOffloadingManager")
        cfgs = []
        check_sequence("specs", specs, "a tuple of KV cache specs")
        for i, spec in enumerate(specs):
            is_align = isinstance(spec, MambaSpec) and spec.mamba_cache_mode == "align"
            if not isinstance(spec, (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec)) and not is_align:
                raise InvalidFieldError(f"specs[{i}]", spec, "a full-attention, sliding-window, chunked-local or "
                                                             "Mamba 'align' spec")
            if spec.block_size % tokens_per_hash:
                raise InvalidFieldError(f"specs[{i}].block_size", spec.block_size,
                                        f"a multiple of tokens_per_hash={tokens_per_hash}")
            tpc = spec.block_size * blocks_per_chunk
            cfgs.append(GroupOffloadConfig(i, spec, spec.block_size, tpc, tpc // tokens_per_hash,
                                           get_sliding_window_size_in_chunks(spec, tpc), is_align,
                                           i in _check_eagle_groups(eagle_groups, specs)))
        self.groups = tuple(cfgs)
        _check_retention_interval(retention_interval, self.groups)
        self.retention_interval = retention_interval
        self.tokens_per_hash = tokens_per_hash
        self.blocks_per_chunk = blocks_per_chunk
        self._init_partial_tails()
        if any(c.tokens_per_block != tokens_per_hash for c in cfgs) and not self.supports_partial_tail:
            raise InvalidFieldError("tokens_per_hash", tokens_per_hash,
                                    "every group's block_size, unless the pool has partial tails (full attention + "
                                    "Mamba 'align' groups of one block size, one block a chunk): finer hashes are "
                                    "modelled only there")
        self.manager = manager
        self.num_workers = num_workers
        self.offload_prompt_only = offload_prompt_only
        self.block_hasher = block_hasher or RequestBlockHasher(tokens_per_hash).block_hashes
        fa, sw = lookup_order([c.lookup_group() for c in self.groups])
        self._sliding_window_groups = sw
        # Mamba "align" hits end on the group's chunk (vLLM ``resolve_mamba_align_size``: every such
        # group has the same chunk, as all groups here share one block size)
        self._mamba_align_size = next((c.tokens_per_chunk for c in cfgs if c.requires_cow_source), None)
        fa_tpc = {self.groups[i].tokens_per_chunk for i in fa}
        # Hits end on a full-attention chunk boundary; with no FA group, on the largest chunk.
        self.alignment_tokens = (fa_tpc.pop() if len(fa_tpc) == 1 else
                                 max(c.tokens_per_chunk for c in self.groups) if not fa_tpc else None)
        self._req_status: dict[str, _ReqState] = {}
        self._jobs: dict[int, _Job] = {}
        self._job_counter = 0
        self._stale_job_threshold = 0
        self._reset_fence: dict[int, int] = {}
        self._block_id_to_pending_jobs: dict[int, set[int]] = {}
        self._chunks_being_loaded: set[OffloadKey] = set()
        self._batch_load_jobs: dict[int, TransferJob] = {}
        self._batch_jobs_to_flush: set[int] = set()
        self._batch_allocated: set[int] = set()
        self._sync = SyncLoadBudget(sync_load_budget_bytes, kv_bytes_per_token)
        self.events_tracker = events_tracker or OffloadingEventsTracker(False, False, {})
        # metrics since the last get_stats: lookups done, deferred lookups answered, stores refused
        self._stats = {"lookups": 0, "deferred_answered": 0, "allocation_failures": 0}
        self._info_sent = False

    # ------------------------------------------------------------------ helpers

    def _snapshot(self, st: _ReqState, c: GroupOffloadConfig, chunk_idx: int):
        t = self.events_tracker
        if not t.enabled:
            return None
        return t.snapshot(self.block_hasher(st.req), st.req.all_token_ids, c.group_idx, c.window is not None,
                          c.tokens_per_block, self.blocks_per_chunk, chunk_idx, self.tokens_per_hash)

    def _recording_lookup(self, st: _ReqState) -> Callable:
        """The manager's lookup for ``st``; with self-describing events on, a full-attention chunk
        seen as HIT or HIT_PENDING is snapshotted (vLLM ``_maximal_prefix_lookup``), whether or
        not the request is then allocated."""
        if not self.events_tracker.enabled:
            return lambda k: self.manager.lookup(k, st.ctx)
        where = {k: (c, i) for c, g in zip(self.groups, st.groups) if c.window is None
                 for i, k in enumerate(g.offload_keys)}

        def lookup(k):
            r = self.manager.lookup(k, st.ctx)
            if k in where and r in (LookupResult.HIT, LookupResult.HIT_PENDING):
                c, i = where[k]
                self.events_tracker.record_lookup(k, self._snapshot(st, c, i))
            return r
        return lookup

    def take_events(self) -> list:
        """The KV cache events since the last call (vLLM ``OffloadingConnectorScheduler.take_events``)."""
        return self.events_tracker.take_events(self.manager.take_events())

    def _status(self, req: Request) -> _ReqState:
        _check_request(req)
        st = self._req_status.get(req.request_id)
        if st is None:
            raise OffloadStateError(f"request {req.request_id!r} is unknown (on_new_request not called, "
                                    "or it already finished)")
        return st

    def _update_offload_keys(self, st: _ReqState) -> None:
        hashes = self.block_hasher(st.req)
        for c, g in zip(self.groups, st.groups):
            for i in range(c.hashes_per_chunk * (len(g.offload_keys) + 1) - 1, len(hashes), c.hashes_per_chunk):
                key = make_offload_key(hashes[i], c.group_idx)
                g.offload_keys.append(key)
                st.ctx.set_offload_key_position(key, len(g.offload_keys) * c.tokens_per_chunk)

    def _new_job(self) -> int:
        self._job_counter += 1
        return self._job_counter - 1

    def _offloadable(self, st: _ReqState, num_tokens: int) -> int:
        n = min(num_tokens, st.req.num_tokens)
        if st.max_offload_tokens is not None:
            n = min(n, st.max_offload_tokens)
        return min(n, st.req.num_prompt_tokens) if self.offload_prompt_only else n

    def _storable_chunks(self, st: _ReqState, c: GroupOffloadConfig, g: _GroupState, num_tokens: int) -> int:
        n = num_tokens // c.tokens_per_chunk
        if c.is_eagle_group and num_tokens > st.req.num_prompt_tokens and not st.req.is_finished:
            n = max(0, n - 1)  # decoding: a rejected draft may still rewrite the trailing chunk
        return min(n, len(g.block_ids) // self.blocks_per_chunk, len(g.offload_keys))

    # ------------------------------------------------------------------ requests

    def on_new_request(self, req: Request, kv_transfer_params: dict | None = None) -> None:
        """``kv_transfer_params``: the request's (vLLM ``Request.kv_transfer_params``): its load tier
        filter and ``max_load_tokens`` / ``max_offload_tokens`` caps (:mod:`.tier_filter`)."""
        _check_request(req)
        if req.request_id in self._req_status:
            raise OffloadStateError(f"request {req.request_id!r} is already known")
        tiers = request_tier_filter(kv_transfer_params)
        ctx = RequestContext(req.request_id)
        self.manager.on_new_request(ctx)
        self._req_status[req.request_id] = _ReqState(
            req, ctx, tuple(_GroupState() for _ in self.groups), load_tier_filter=tiers,
            max_load_tokens=token_cap(kv_transfer_params, "max_load_tokens"),
            max_offload_tokens=token_cap(kv_transfer_params, "max_offload_tokens"))

    def get_num_new_matched_tokens(self, req: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        check_int("num_computed_tokens", num_computed_tokens, minimum=0)
        st = self._status(req)
        if st.finished:
            raise OffloadStateError(f"request {req.request_id!r} already finished")
        for g in st.groups:
            g.block_ids.clear()
            g.next_stored_chunk_idx = 0  # restarting at token 0: offer every chunk again
        if st.transfer_jobs:
            return None, False  # a load or store of this request is still running: retry later
        self._update_offload_keys(st)
        st.num_locally_computed_tokens = num_computed_tokens
        if req.skip_reading_prefix_cache:
            # vLLM: a request that must not read the prefix cache (prompt logprobs, some pooling
            # requests) gets no offloaded hit either, without a lookup: nothing is timed or recorded
            # and its partial-tail boundary stays as it was; its chunks are still stored.
            hit = 0
        else:
            hit_ends = [0] * len(self.groups)
            hit = lookup_complete_chunks([c.lookup_group() for c in self.groups],
                                         [g.offload_keys for g in st.groups], req.num_tokens, num_computed_tokens,
                                         self._recording_lookup(st), self._chunks_being_loaded,
                                         max_load_tokens=st.max_load_tokens, mamba_align_size=self._mamba_align_size,
                                         hit_ends=hit_ends)
            hit = self._lookup_with_partial_tail(st, hit, hit_ends)
            self._stats["lookups"] += 1
            if hit is None:
                st.lookup_deferred = True
            else:
                self._observe_deferred(st)
        sync = self._sync.reserve(req.request_id, num_computed_tokens, hit, req.num_tokens)
        return hit, bool(hit) and not sync

    def _observe_deferred(self, st: _ReqState) -> None:
        if st.lookup_deferred:
            st.lookup_deferred = False
            self._stats["deferred_answered"] += 1

    def get_stats(self) -> dict:
        """The metrics since the last call, by vLLM's metric names without the ``vllm:kv_offload_``
        prefix (vLLM ``OffloadingConnectorScheduler.get_stats``): how many lookups ran and how many
        deferred lookups were answered (vLLM times both: kvref counts the observations), stores the
        manager refused (no room), and the manager's own (:meth:`CPUOffloadingManager.get_stats`).
        A metric with nothing to report is absent. The first call also carries the static config
        facts (``info``: one series per cache; the CPU cache here reports none, one empty series)."""
        s, self._stats = self._stats, dict.fromkeys(self._stats, 0)
        out = {name: s[k] for name, k in (("lookup_sync_delay_seconds", "lookups"),
                                          ("lookup_async_delay_seconds", "deferred_answered"),
                                          ("allocation_failure", "allocation_failures")) if s[k]}
        out.update(self.manager.get_stats())
        if not self._info_sent:
            out["info"] = [{}]
            self._info_sent = True
        return out

    def update_state_after_alloc(self, req: Request, blocks: Sequence[Sequence[tuple[int, bool]]],
                                 num_external_tokens: int) -> None:
        """``blocks``: the request's table per group as ``(block_id, is_hashed)``."""
        check_int("num_external_tokens", num_external_tokens, minimum=0)
        _check_request(req)
        if not isinstance(blocks, (list, tuple)) or len(blocks) != len(self.groups) or not all(
                isinstance(grp, (list, tuple)) and all(
                    isinstance(e, (list, tuple)) and len(e) == 2 and type(e[0]) is int and e[0] >= 0
                    and isinstance(e[1], bool) for e in grp) for grp in blocks):
            raise InvalidFieldError("blocks", blocks, f"{len(self.groups)} per-group lists of (block_id, is_hashed)")
        if num_external_tokens:  # checked before anything is recorded (the batch's allocated blocks too)
            st = self._status(req)
            cached = st.num_locally_computed_tokens + num_external_tokens
            for c, grp in zip(self.groups, blocks):
                if len(grp) < cdiv(cached, c.tokens_per_block):
                    raise InvalidFieldError("blocks", list(grp), f"at least {cdiv(cached, c.tokens_per_block)} "
                                                                 f"blocks in group {c.group_idx}")
        for grp in blocks:
            self._batch_allocated.update(b for b, _ in grp if b != 0)
        if num_external_tokens == 0:
            return
        st = self._status(req)
        st.loaded_from_offload = True
        local = st.num_locally_computed_tokens
        cached = local + num_external_tokens
        sync = req.request_id in self._sync.reserved
        if st.transfer_jobs:
            raise OffloadStateError(f"request {req.request_id!r} still has transfers; a load needs none")
        tail = st.partial_tail_boundary
        if tail is not None and tail != cached:
            raise OffloadStateError(f"request {req.request_id!r}: the lookup hit a partial tail at {tail} tokens, "
                                    f"the load ends at {cached}")
        keys: list[OffloadKey] = []
        dst: list[int] = []
        st.load_key_ranges.clear()
        for c, g, grp in zip(self.groups, st.groups, blocks):
            n_gpu = cdiv(cached, c.tokens_per_block)
            if len(grp) < n_gpu:
                raise InvalidFieldError("blocks", list(grp), f"at least {n_gpu} blocks in group {c.group_idx}")
            start = n_gpu
            for i in range(cdiv(local, c.tokens_per_block), n_gpu):
                bid, hashed = grp[i]
                if bid != 0 and (sync or not hashed):  # a sync load's blocks are hashed at allocation
                    start = i
                    break
            if n_gpu - start:
                first = start // self.blocks_per_chunk
                # a partial tail loads the boundary's key in place of its (incomplete) last chunk
                group_keys = g.offload_keys[first:cdiv(cached, c.tokens_per_chunk) - (tail is not None)]
                if tail is not None:
                    group_keys.append(self._partial_tail_key(st, c, tail))
                keys += group_keys
                if isinstance(c.spec, MambaSpec):  # a recurrent state supports the whole reused prefix
                    st.load_key_ranges.extend((local, cached) for _ in group_keys)
                else:
                    st.load_key_ranges.extend((max(start * c.tokens_per_block, i * c.tokens_per_chunk),
                                               min(cached, (i + 1) * c.tokens_per_chunk))
                                              for i in range(first, first + len(group_keys)))
            dst += [b for b, _ in grp[start:n_gpu]]
            g.next_stored_chunk_idx = cdiv(cached, c.tokens_per_chunk)  # don't re-store the hits
        chunk_ids = self.manager.prepare_load(keys, st.ctx)
        job = self._new_job()
        self._batch_load_jobs[job] = TransferJob(req.request_id, tuple(keys), tuple(dst), tuple(chunk_ids), sync)
        st.transfer_jobs.add(job)
        self._jobs[job] = _Job(req.request_id, self.num_workers, set(keys), False, is_sync_load=sync)
        if not sync:  # a synchronous copy ends before anyone else can look these keys up
            self._chunks_being_loaded.update(keys)
        st.partial_tail_boundary = None

    def get_external_cache_hit_sources(self, req: Request, num_external_tokens: int) -> dict[str, int]:
        """The accepted external hit split by where its tokens came from (vLLM 0.33.0
        ``get_external_cache_hit_sources``): tokens a loaded key covers come from the CPU tier
        (``"host"``); tokens no key covers (history a sliding window omits) are
        ``"external_unspecified"``. Only non-zero counts."""
        _check_request(req)
        check_int("num_external_tokens", num_external_tokens, minimum=0)
        if num_external_tokens == 0:
            return {}
        st = self._status(req)
        start = st.num_locally_computed_tokens
        end = start + num_external_tokens
        covered: set[int] = set()
        for lo, hi in st.load_key_ranges:
            covered.update(range(max(start, lo), min(end, hi)))
        out = {"host": len(covered), "external_unspecified": num_external_tokens - len(covered)}
        return {k: v for k, v in out.items() if v}

    def request_finished(self, req: Request, aborted: bool = False) -> tuple[bool, None]:
        """Blocks may be freed at once (returns ``(False, None)``); the last chunks are stored by the
        next step; full-attention sources of running stores become fenced now."""
        _check_request(req)
        st = self._req_status.get(req.request_id)
        if st is None:
            ctx = RequestContext(req.request_id)  # never tracked: nothing in flight
            self.manager.on_new_request(ctx)
            self.manager.on_request_finished(ctx)
            return False, None
        if st.finished:
            raise OffloadStateError(f"request {req.request_id!r} already finished")
        self._observe_deferred(st)
        st.finished, st.aborted = True, bool(aborted)
        self._update_offload_keys(st)
        for job in st.transfer_jobs:
            for bid in self._jobs[job].deferred_fence_block_ids:
                self._block_id_to_pending_jobs.setdefault(bid, set()).add(job)
        return False, None

    # ------------------------------------------------------------------ steps

    def _update_req_states(self, step: OffloadingStep) -> None:
        old_ends: dict[str, tuple[int, ...]] = {}
        for rid, new_ids, full in step.scheduled:
            st = self._req_status[rid]
            self._update_offload_keys(st)
            if full:
                for g in st.groups:
                    g.block_ids.clear()
            if new_ids:
                if self._sliding_window_groups:
                    old_ends[rid] = tuple(len(st.groups[i].block_ids) for i in self._sliding_window_groups)
                for c, g in zip(self.groups, st.groups):
                    g.block_ids.extend(new_ids[c.group_idx])
                    self._batch_allocated.update(b for b in new_ids[c.group_idx] if b != 0)
        # A copy's destination is written this step like a new block (vLLM #41228's fence): a store
        # still reading it is flushed first, and a sliding-window slot holding it is stale.
        self._batch_allocated.update(dst for _, dst in step.kv_cache_block_copies)
        # A sliding-window block that left the window can be freed and re-allocated before it was
        # stored: a not-yet-stored slot holding a block allocated this step is stale -> 0.
        if self._sliding_window_groups and self._batch_allocated:
            for rid, st in self._req_status.items():
                ends = old_ends.get(rid)
                for j, gi in enumerate(self._sliding_window_groups):
                    g = st.groups[gi]
                    end = ends[j] if ends is not None else len(g.block_ids)
                    for k in range(g.next_stored_chunk_idx * self.blocks_per_chunk, end):
                        if g.block_ids[k] in self._batch_allocated:
                            g.block_ids[k] = 0

    def _build_store_jobs(self, step: OffloadingStep) -> dict[int, TransferJob]:
        bpc = self.blocks_per_chunk
        out: dict[int, TransferJob] = {}
        for rid in chain(step.num_scheduled_tokens, step.finished_req_ids):
            st = self._req_status.get(rid)
            if st is None:
                continue
            req = st.req
            if st.aborted:
                after = req.num_computed_tokens
            elif st.finished:
                after = max(req.num_prompt_tokens, req.num_tokens - 1)  # the last sampled slot is never final
            else:
                after = req.num_computed_tokens + step.num_scheduled_tokens[rid]
            n_off = self._offloadable(st, after)
            prompt_off = self._offloadable(st, req.num_prompt_tokens)
            retention = self.retention_interval
            # sparse retention keeps the tails at the prompt's replay boundary and at the junction
            # the GPU cache's lookup reported (vLLM: ``req.shared_prefix_boundary``, 0 = none)
            boundaries: tuple[int, ...] = ()
            if retention is not None:
                boundaries = (req.num_prompt_tokens - 1,)
                if getattr(req, "shared_prefix_boundary", 0):
                    boundaries += (req.shared_prefix_boundary,)
            new_keys: list[OffloadKey] = []
            ranges: list[tuple[int, int]] = []
            for c, g in zip(self.groups, st.groups):
                n_chunks = self._storable_chunks(st, c, g, n_off)
                start = g.next_stored_chunk_idx
                prompt_chunks = prompt_off // c.tokens_per_chunk
                is_sw = isinstance(c.spec, SlidingWindowSpec)
                align_blocks = (self.alignment_tokens // c.tokens_per_block
                                if is_sw and not c.is_eagle_group and self.alignment_tokens is not None
                                and self.alignment_tokens % c.tokens_per_block == 0 else None)
                reconsider = (st.finished and n_chunks != prompt_chunks and retention is None
                              and align_blocks is not None)
                if retention is not None or c.is_eagle_group:
                    horizon = None  # sparse retention / EAGLE: no final-segment tail
                elif st.finished:
                    horizon: int | None = n_chunks
                elif n_chunks <= prompt_chunks:
                    horizon = prompt_chunks
                else:
                    horizon = None  # a decode frontier is not a final boundary
                if reconsider:
                    hb = n_chunks * bpc
                    start = min(start, (hb - hb % align_blocks) // bpc)
                ranges.append((start, n_chunks))
                if c.requires_cow_source or n_chunks <= start:
                    continue  # a Mamba "align" group stores only its handed-over boundary states
                keys = g.offload_keys[start:n_chunks]
                reps = g.block_ids[start * bpc + bpc - 1:n_chunks * bpc:bpc]
                mask = prompt_mask = None
                if is_sw:
                    mask = swa_store_mask(c.spec, start * bpc, n_chunks * bpc, self.alignment_tokens,
                                          None if horizon is None else horizon * bpc, retention, boundaries,
                                          c.is_eagle_group)
                    if reconsider:
                        prompt_mask = swa_store_mask(c.spec, start * bpc, n_chunks * bpc, self.alignment_tokens,
                                                     prompt_chunks * bpc)
                for k, (key, rep) in enumerate(zip(keys, reps)):
                    if rep == 0:
                        continue
                    idx = start + k
                    if reconsider and idx < g.next_stored_chunk_idx and (
                            prompt_mask is None or any(prompt_mask[k * bpc + b] for b in range(bpc))):
                        continue  # already considered under the prompt horizon
                    if mask is not None and not any(mask[k * bpc + b] for b in range(bpc)):
                        continue  # no aligned hit can ever need this chunk
                    if any(g.block_ids[idx * bpc + b] == 0 and (mask is None or mask[k * bpc + b])
                           for b in range(bpc)):
                        continue  # a needed block is null/stale: the chunk would be incomplete
                    new_keys.append(key)
            if not new_keys:
                self._advance(st, n_off)
                continue
            res = self.manager.prepare_store(new_keys, st.ctx)
            if res is None:
                self._stats["allocation_failures"] += 1
                continue  # no room now: retried next step
            if not res.keys_to_store:
                self._advance(st, n_off)
                continue
            to_store = set(res.keys_to_store)
            src: list[int] = []
            fenced: list[int] = []
            deferred: list[int] = []
            for c, g, (start, n_chunks) in zip(self.groups, st.groups, ranges):
                for k, key in enumerate(g.offload_keys[start:n_chunks]):
                    if key not in to_store:
                        continue
                    self.events_tracker.record_store(key, self._snapshot(st, c, start + k))
                    for b in range(bpc):
                        bid = g.block_ids[(start + k) * bpc + b]
                        if bid == 0:
                            continue
                        src.append(bid)
                        (fenced if c.window is not None else deferred).append(bid)
                g.next_stored_chunk_idx = max(g.next_stored_chunk_idx, n_chunks)
            job = self._new_job()
            st.transfer_jobs.add(job)
            for bid in fenced:  # sliding-window sources can be freed while running: fence now
                self._block_id_to_pending_jobs.setdefault(bid, set()).add(job)
            # A copy of the set, as vLLM's TransferJobStatus holds: completion announces the keys in
            # this set's iteration order, which a copy can change (KV events compare it).
            self._jobs[job] = _Job(rid, self.num_workers, set(to_store), True, deferred, fenced)
            out[job] = TransferJob(rid, tuple(res.keys_to_store), tuple(src), tuple(res.chunk_ids))
            if st.finished:
                for bid in deferred:
                    self._block_id_to_pending_jobs.setdefault(bid, set()).add(job)
                    if bid in self._batch_allocated:
                        self._batch_jobs_to_flush.add(job)
        return out

    def _build_aligned_boundary_store_jobs(self, handoffs) -> dict[int, TransferJob]:
        """One store job per handed-over Mamba "align" state worth storing (:mod:`.boundary_stores`),
        its one source block fenced at once; job ids before the ordinary stores'."""
        out: dict[int, TransferJob] = {}

        def max_boundary(rid: str) -> int | None:
            st = self._req_status.get(rid)
            return None if st is None else self._offloadable(st, st.req.num_tokens)

        for rid, group_idx, block_id, boundary in aligned_boundary_stores(
                handoffs, {c.group_idx: c.tokens_per_chunk for c in self.groups}, max_boundary):
            st, c = self._req_status[rid], self.groups[group_idx]
            key = make_boundary_key(self.block_hasher(st.req), group_idx, boundary, self.tokens_per_hash, st.ctx)
            res = self.manager.prepare_store([key], st.ctx)
            if res is None:
                self._stats["allocation_failures"] += 1
                continue
            if not res.keys_to_store:
                continue
            job = self._new_job()
            st.transfer_jobs.add(job)
            self._block_id_to_pending_jobs.setdefault(block_id, set()).add(job)  # fenced from creation
            self._jobs[job] = _Job(rid, self.num_workers, {key}, True, [], [block_id])
            out[job] = TransferJob(rid, (key,), (block_id,), tuple(res.chunk_ids))
            self.events_tracker.record_store(key, self._snapshot(st, c, boundary // c.tokens_per_chunk - 1))
        return out

    def _register_store_job(self, st: _ReqState, res, sources: list[int]) -> tuple[int, TransferJob]:
        """A new store job of ``st`` for the manager's accepted ``res``, reading ``sources``, which
        are fenced from creation (a boundary state's block can be re-allocated in the next step)."""
        job = self._new_job()
        st.transfer_jobs.add(job)
        for bid in sources:
            self._block_id_to_pending_jobs.setdefault(bid, set()).add(job)
        self._jobs[job] = _Job(st.req.request_id, self.num_workers, set(res.keys_to_store), True, [], list(sources))
        return job, TransferJob(st.req.request_id, tuple(res.keys_to_store), tuple(sources), tuple(res.chunk_ids))

    def _advance(self, st: _ReqState, n_off: int) -> None:
        for c, g in zip(self.groups, st.groups):
            g.next_stored_chunk_idx = max(g.next_stored_chunk_idx, self._storable_chunks(st, c, g, n_off))

    def build_connector_meta(self, step: OffloadingStep) -> OffloadingMeta:
        if not isinstance(step, OffloadingStep):
            raise InvalidFieldError("step", step, "an OffloadingStep")
        for rid, _, _ in step.scheduled:
            if rid not in self._req_status:
                raise OffloadStateError(f"step.scheduled: request {rid!r} is unknown")
        check_handoffs(step.boundary_state_offloads)
        self._update_req_states(step)
        for rid in step.preempted_req_ids:
            st = self._req_status.get(rid)
            if st is not None:
                self._batch_jobs_to_flush.update(st.transfer_jobs - self._batch_load_jobs.keys())
        for bid in self._batch_allocated:  # a fenced source was re-allocated: wait for its copy
            self._batch_jobs_to_flush.update(self._block_id_to_pending_jobs.get(bid, ()))
        stores = self._build_aligned_boundary_store_jobs(step.boundary_state_offloads)
        stores.update(self._build_partial_tail_store_jobs(step.boundary_state_offloads, step.num_scheduled_tokens))
        stores.update(self._build_store_jobs(step))
        meta = OffloadingMeta(self._batch_load_jobs, stores, frozenset(self._batch_jobs_to_flush))
        for rid in step.finished_req_ids:
            st = self._req_status.get(rid)
            if st is None:
                continue
            st.finished_signaled = True
            self.manager.on_request_finished(st.ctx)
            if not st.transfer_jobs:
                del self._req_status[rid]
        self._batch_load_jobs = {}
        self._batch_jobs_to_flush = set()
        self._batch_allocated = set()
        self._sync.end_step()
        return meta

    def has_pending_push_work(self) -> bool:
        """Whether the engine must keep stepping with nothing scheduled (vLLM
        ``OffloadingConnectorScheduler.has_pending_push_work``): a job some worker has not reported
        yet, or a reset fence still counting down late reports of the jobs a reset flushed. The
        CPU manager itself never has work of its own (vLLM's ``OffloadingManager.has_pending_work``
        is False for it); an engine that stopped stepping here would never deliver a completion."""
        return bool(self._jobs or self._reset_fence)

    # ------------------------------------------------------------------ completions / reset

    def update_connector_output(self, completed_jobs: dict[int, int]) -> None:
        """``completed_jobs``: job id -> workers reporting it now. Jobs from before a reset only
        count down the reset fence. Unknown jobs, non-positive counts and more reports than workers
        raise OffloadStateError / InvalidFieldError with nothing changed (vLLM asserts or KeyErrors)."""
        if not isinstance(completed_jobs, dict):
            raise InvalidFieldError("completed_jobs", completed_jobs, "a dict job id -> workers reporting it")
        for job, n in completed_jobs.items():
            check_int(f"completed_jobs[{job}]", n, minimum=1)
            check_int("completed_jobs (job id)", job, minimum=0)
            if job < self._stale_job_threshold:
                continue
            if job not in self._jobs:
                raise OffloadStateError(f"completed_jobs: job {job!r} is unknown or already complete")
            if n > self._jobs[job].pending_count:
                raise OffloadStateError(f"completed_jobs: job {job} reported by more than {self.num_workers} workers")
        for job, n in completed_jobs.items():
            if job < self._stale_job_threshold:
                if job in self._reset_fence:
                    self._reset_fence[job] -= n
                    if self._reset_fence[job] <= 0:
                        del self._reset_fence[job]
                continue
            j = self._jobs[job]
            j.pending_count -= n
            if j.pending_count > 0:
                continue
            st = self._req_status[j.req_id]
            if j.is_store:
                self.manager.complete_store(j.keys, st.ctx)
            else:
                self.manager.complete_load(list(j.keys), st.ctx)
                self._chunks_being_loaded.difference_update(j.keys)
            self._unfence(job, j.fenced_block_ids)
            if st.finished:
                self._unfence(job, j.deferred_fence_block_ids)
            del self._jobs[job]
            st.transfer_jobs.remove(job)
            if st.finished_signaled and not st.transfer_jobs:
                del self._req_status[j.req_id]

    def _unfence(self, job: int, bids: list[int]) -> None:
        for bid in bids:
            pending = self._block_id_to_pending_jobs.get(bid)
            if pending is not None:
                pending.discard(job)
                if not pending:
                    del self._block_id_to_pending_jobs[bid]

    def reset_cache(self) -> None:
        """Drop every chunk and job. In-flight jobs are flushed with the next metadata; their late
        reports only count down the reset fence. Not allowed mid-step, nor twice before a step
        delivered the previous reset's flush (vLLM asserts both)."""
        if self._batch_load_jobs or self._batch_jobs_to_flush or self._batch_allocated or self._sync.reserved:
            raise OffloadStateError("reset_cache: a step is in progress or the last reset's flush is undelivered")
        self._batch_jobs_to_flush.update(self._jobs)
        for rid, st in list(self._req_status.items()):
            if st.finished:
                if not st.finished_signaled:
                    self.manager.on_request_finished(st.ctx)
                del self._req_status[rid]
        self.manager.reset_cache()
        for st in self._req_status.values():
            for g in st.groups:
                g.next_stored_chunk_idx = 0
            st.transfer_jobs.clear()
            st.partial_tail_boundary = None
        self._stale_job_threshold = self._job_counter
        self._reset_fence.update((j, job.pending_count) for j, job in self._jobs.items())
        self._jobs.clear()
        self._block_id_to_pending_jobs.clear()
        self._chunks_being_loaded.clear()
        self.events_tracker.reset()

    # ------------------------------------------------------------------ invariants

    def check_invariants(self) -> None:
        """The CPU manager's chunk states (O4, O7) and each request's jobs (O5, O6 of docs/invariants.md)."""
        self.manager.check_invariants()
        self.events_tracker.check_invariants()
        self._sync.check_invariants()
        for rid, st in self._req_status.items():
            jobs = [self._jobs[j] for j in st.transfer_jobs]
            assert all(j.req_id == rid for j in jobs), f"O5: a job of request {rid} names another request"
            loads = [j for j in jobs if not j.is_store and not j.is_sync_load]
            assert not loads or len(jobs) == 1, f"O5: request {rid} has a load beside other jobs"
        owned = {j for st in self._req_status.values() for j in st.transfer_jobs}
        assert owned == set(self._jobs), "O5: a job without its request, or a request job unknown"
        for bid, jobs in self._block_id_to_pending_jobs.items():
            assert jobs and jobs <= set(self._jobs), f"O5: fence on block {bid} names finished jobs"
        for j, job in self._jobs.items():
            for bid in job.fenced_block_ids:
                assert j in self._block_id_to_pending_jobs.get(bid, ()), f"O6: SW source {bid} of job {j} unfenced"
        # A hit never names a chunk being written: loads only pin ready chunks.
        for job in self._jobs.values():
            if not job.is_store:
                for k in job.keys:
                    assert self.manager.policy.get(k) is not None and self.manager.policy.get(k).ref_cnt > 0, \
                        f"O5: load job reads an unpinned chunk {k!r}"
