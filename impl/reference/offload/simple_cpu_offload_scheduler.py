"""Scheduler side of vLLM's SimpleCPUOffloadConnector (``vllm/v1/simple_kv_offload/manager.py``).

The CPU buffer is managed exactly like the GPU pool: a second coordinator with its own block
pool (ref counts, LRU free queue, hash index). A CPU block becomes findable only when its store
completes on every worker (its hash is inserted then); until then the in-flight store holds one
reference on the CPU block and one on the source GPU block, so neither is reused while the copy
runs.

Loads: ``get_num_new_matched_tokens`` looks the suffix after the local prefix up in the CPU
cache and *pins* the hit (one CPU ref) until ``update_state_after_alloc`` turns it into a load
(CPU + GPU refs, released when the worker reports the request in ``finished_recving``). The pin
closes the window in which the hit could be evicted (vLLM issue #39702).

Stores, eager mode: per request and group a cursor walks the block table over *confirmed*
tokens (computed before this step, less the output placeholders of a step still in flight under
async scheduling); a block is stored unless it is null, unhashed, already
being stored (``_in_flight_store_gpu_blocks``, vLLM #41289) or already in the CPU cache. A
finishing request flushes what its cursor has not reached yet. Stores of one step form one
event.

Stores, lazy mode: a cursor walks the GPU *free queue* and copies hashed blocks that are not on
the CPU yet, before the allocator evicts them; touching them takes them off the queue.

Mamba "align" pools (eager mode; :mod:`.simple_cpu_boundary_stores`): a Mamba table is not
positionally stable (interior states are nulled), so the cursors skip it and the scheduler hands
the connector each committed boundary state by block id (``SimpleOffloadStep.
boundary_state_offloads``); every hand-off is stored or counted under the outcome that declined it
(vLLM's ``BoundaryStoreStats``, reported as ``SAVE_OUTCOMES``). With fine-grained hits (a block
wider than ``hash_block_size``) a finishing request also stores the full-attention block holding
its prompt's last hash boundary (the partial tail a later request can hit).

KV events on Mamba "align" pools (:mod:`.simple_cpu_offload_events`): a positional store captures a
payload for its block and one per hash unit inside it (published with the GPU block's secondary
keys); a hand-off or a partial tail captures none (its keys are known at completion only).

Not modelled: DCP/PCP, disk backend, multi-module MTP placeholders, lazy mode on Mamba pools, block
sizes wider than ``hash_block_size`` without a Mamba "align" group. Groups must
be full attention (incl. MLA), sliding window, chunked local or Mamba "align".

Option: ``dedup_within_scan=True`` also deduplicates within one request's scan (what open vLLM
PR 42903 proposes; not 0.33.0). Historic behaviour (before vLLM #41289: stores scheduled in
earlier steps forgotten) is not a switch here: it is the runtime mutant
``offload.in_flight_not_deduped`` of :mod:`kvref.models.mutants`, the one place historic variants
of the reference live.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvref.impl.interface import MAX_NUM_BLOCKS, PoolConfig
from kvref.impl.request import Request
from kvref.spec.errors import InvalidFieldError, check_int, check_sequence
from kvref.spec.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from kvref.spec.mathutil import cdiv

from ..block_hash import BlockHash, RequestBlockHasher, resolve_block_hashes
from ..block_pool import BlockPool
from ..kv_cache_block import KVCacheBlock
from ..kv_cache_coordinator import get_kv_cache_coordinator, scheduler_spec
from .keys import OffloadStateError
from .simple_cpu_boundary_stores import (
    OUTCOMES,
    _BoundaryStoreStats,
    _check_boundary_offloads,
    _classify_store_candidate,
    _find_fa_partial_tail_source,
)
from .simple_cpu_offload_events import (
    _block_stored_events,
    _BlockStoreMeta,
    _capture_store_meta,
    _relabel_pool_events,
)


@dataclass
class TransferMeta:
    gpu_block_ids: list[int]
    cpu_block_ids: list[int]
    # With KV events on: per block, the ``BlockStored`` payloads captured at selection (its primary
    # key's, then its hash units'; None: none captured).
    block_meta: list[tuple[_BlockStoreMeta, ...] | None] | None = None


@dataclass
class LoadRequestState:
    request: Request
    transfer: TransferMeta
    load_event: int | None = None
    finished: bool = False


@dataclass
class StoreRequestState:
    """Eager mode: the connector's copy of the block table and one cursor per group."""

    request: Request
    block_ids: tuple[list[int], ...]
    num_stored_blocks: list[int]
    store_events: set[int] = field(default_factory=set)
    finished: bool = False


@dataclass
class SimpleOffloadStep:
    """What the connector reads from vLLM's ``SchedulerOutput``.

    ``scheduled``: ``(req_id, new block ids per group or None, is_full_table)`` for new and
    cached requests in vLLM ``yield_req_data`` order (new requests first, then cached ones);
    ``is_full_table`` for new/resumed requests. The order matters: stores are batched in it.
    """

    scheduled: list[tuple[str, tuple[list[int], ...] | None, bool]] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    #: Mamba "align" hand-offs drained by the scheduler this step (vLLM's
    #: ``KVConnectorBlockState.boundary_state_offloads``): request id -> [(group, GPU block, tokens)]
    boundary_state_offloads: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)


@dataclass(frozen=True)
class SimpleOffloadMeta:
    """What the workers get (vLLM ``SimpleCPUOffloadMetadata``); -1 = no event."""

    load_event: int
    load_gpu_blocks: tuple[int, ...]
    load_cpu_blocks: tuple[int, ...]
    store_event: int
    store_gpu_blocks: tuple[int, ...]
    store_cpu_blocks: tuple[int, ...]
    need_flush: bool


_MODELLED = (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec)


def _modelled(spec: object) -> bool:
    return isinstance(spec, _MODELLED) or (isinstance(spec, MambaSpec) and spec.mamba_cache_mode == "align")


def _check_block_table(block_ids: object, num_groups: int) -> None:
    """A block table per group: ``num_groups`` lists of block ids (ints >= 0)."""
    if not isinstance(block_ids, (list, tuple)) or len(block_ids) != num_groups or not all(
            isinstance(g, (list, tuple)) and all(type(b) is int and b >= 0 for b in g) for g in block_ids):
        raise InvalidFieldError("block_ids", block_ids, f"{num_groups} per-group lists of block ids (ints >= 0)")


class SimpleCPUOffloadScheduler:
    """Args:
        kv_cache_groups: the GPU groups (the CPU side mirrors them).
        num_cpu_blocks: CPU blocks including the CPU pool's own null block (>= 1; 1 = no room).
        max_model_len, max_in_flight_tokens: as for the GPU coordinator.
        scheduler_block_size, hash_block_size: as for the GPU coordinator.
        lazy_offload: lazy (free-queue cursor) instead of eager stores.
        world_size: workers that must each report a store event before it completes.
        max_num_batched_tokens: sizes the lazy target.
        block_hasher: request -> chained block hashes (vLLM ``request.block_hashes``).
        enable_kv_cache_events: publish the CPU cache's KV events (vLLM's ``kv_events_config``;
            :mod:`.simple_cpu_offload_events`), taken with :meth:`take_events`.
    """

    def __init__(self, kv_cache_groups: Sequence[KVCacheGroupSpec], num_cpu_blocks: int, max_model_len: int,
                 scheduler_block_size: int, hash_block_size: int, *, lazy_offload: bool = False,
                 world_size: int = 1, max_num_batched_tokens: int = 2048, max_in_flight_tokens: int | None = None,
                 block_hasher: Callable[[Request], list[BlockHash]] | None = None,
                 dedup_within_scan: bool = False, enable_kv_cache_events: bool = False) -> None:
        check_int("num_cpu_blocks", num_cpu_blocks, minimum=1)
        if not isinstance(enable_kv_cache_events, bool):
            raise InvalidFieldError("enable_kv_cache_events", enable_kv_cache_events, "True or False")
        if num_cpu_blocks > MAX_NUM_BLOCKS:
            raise InvalidFieldError("num_cpu_blocks", num_cpu_blocks, f"an int in [1, {MAX_NUM_BLOCKS}]")
        check_sequence("kv_cache_groups", kv_cache_groups, "a tuple of KVCacheGroupSpec")
        check_int("world_size", world_size, minimum=1)
        check_int("max_num_batched_tokens", max_num_batched_tokens, minimum=1)
        check_int("scheduler_block_size", scheduler_block_size, minimum=1)
        check_int("hash_block_size", hash_block_size, minimum=1)
        groups = tuple(kv_cache_groups)
        for i, g in enumerate(groups):
            if not isinstance(g, KVCacheGroupSpec) or not _modelled(scheduler_spec(g.kv_cache_spec)):
                raise InvalidFieldError(f"kv_cache_groups[{i}]", g, "a full-attention, sliding-window, "
                                        "chunked-local or Mamba 'align' KVCacheGroupSpec (others are not modelled)")
        specs = [scheduler_spec(g.kv_cache_spec) for g in groups]
        fa = [i for i, s in enumerate(specs) if isinstance(s, FullAttentionSpec)]
        if not fa:
            raise InvalidFieldError("kv_cache_groups", groups, "at least one full-attention group")
        mamba = any(isinstance(s, MambaSpec) for s in specs)
        for i, s in enumerate(specs):
            if s.block_size != hash_block_size and not mamba:
                raise InvalidFieldError(f"kv_cache_groups[{i}].block_size", s.block_size,
                                        f"== hash_block_size={hash_block_size} without a Mamba 'align' group "
                                        "(coarse hash resolution is not modelled here)")
            if s.block_size % hash_block_size or scheduler_block_size % s.block_size:
                raise InvalidFieldError(f"kv_cache_groups[{i}].block_size", s.block_size,
                                        f"a multiple of hash_block_size={hash_block_size} dividing "
                                        f"scheduler_block_size={scheduler_block_size}")
        if mamba and lazy_offload:
            raise InvalidFieldError("lazy_offload", lazy_offload, "False on a Mamba 'align' pool (vLLM's lazy "
                                    "CPU pool turns fine-grained hits off; not modelled)")
        self.groups = groups
        self.specs = specs
        self.block_size = scheduler_block_size
        self.hash_block_size = hash_block_size
        self.world_size = world_size
        self.lazy = bool(lazy_offload)
        self.dedup_within_scan = dedup_within_scan
        self.cpu_coordinator = get_kv_cache_coordinator(PoolConfig.off_plan(
            "the CPU offload pool: sized from the CPU bytes vLLM's SimpleCPUOffloadConnector is given, "
            "not by the GPU startup plan",
            num_blocks=num_cpu_blocks, groups=groups, max_model_len=max_model_len,
            scheduler_block_size=scheduler_block_size, hash_block_size=hash_block_size,
            max_in_flight_tokens=max_in_flight_tokens or max_model_len,
            enable_kv_cache_events=enable_kv_cache_events))
        self.enable_kv_cache_events = enable_kv_cache_events
        self.cpu_block_pool: BlockPool = self.cpu_coordinator.block_pool
        self.num_cpu_blocks = num_cpu_blocks
        self.fa_gidx = fa[0]
        self.group_block_sizes = [s.block_size for s in specs]
        self.fa_block_size = self.group_block_sizes[self.fa_gidx]
        self.prefix_cacheable_group_ids = tuple(i for i, s in enumerate(specs) if s.prefix_cacheable)
        #: vLLM's cumulative boundary hand-off outcomes and the snapshot ``get_stats`` drains against
        self.boundary_store_stats = _BoundaryStoreStats()
        self._boundary_stats_snapshot = _BoundaryStoreStats()
        self.block_hasher = block_hasher or RequestBlockHasher(hash_block_size).block_hashes
        self._gpu_block_pool: BlockPool | None = None

        self._reqs_to_load: dict[str, LoadRequestState] = {}
        self._load_event_to_reqs: dict[int, list[str]] = {}
        self._abandoned_reqs_to_load: dict[str, LoadRequestState] = {}
        self._pending_cpu_hits: dict[str, tuple[tuple[list[KVCacheBlock], ...], int, int]] = {}

        self._cursor: KVCacheBlock | None = None
        self._target_free = self._lazy_target(max_num_batched_tokens) if self.lazy else 0
        self._store_event_to_blocks: dict[int, TransferMeta] = {}
        self._abandoned_store_event_to_blocks: dict[int, TransferMeta] = {}
        self._reqs_to_store: dict[str, StoreRequestState] = {}
        self._store_event_to_reqs: dict[int, list[str]] = {}
        self._in_flight_store_gpu_blocks: set[int] = set()
        self._pending_finished_stores: list[TransferMeta] = []
        self._store_event_pending_counts: dict[int, int] = {}
        self._load_event_counter = 0
        self._store_event_counter = 0
        self._finished_req_ids: set[str] = set()
        # Blocks of loads the workers completed since the last get_stats() (vLLM's LOAD_BLOCKS).
        self._interval_load_blocks_completed = 0

    def _lazy_target(self, max_num_batched_tokens: int) -> int:
        """Twice the blocks one step can need: a batch per full group, a window per SW group."""
        t = 0
        for s in self.specs:
            if isinstance(s, MambaSpec):
                t += 2
            elif isinstance(s, SlidingWindowSpec):
                t += cdiv(s.sliding_window, s.block_size) + 1
            else:
                t += cdiv(max_num_batched_tokens, s.block_size)
        return int(t * 2.0)

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        if not isinstance(gpu_block_pool, BlockPool):
            raise InvalidFieldError("gpu_block_pool", gpu_block_pool, "a kvref reference BlockPool")
        if self._gpu_block_pool is not None and gpu_block_pool is not self._gpu_block_pool:
            # vLLM binds once, at startup; a second pool would orphan the transfers and pins that
            # hold blocks of the first (check_invariants failed: a GPU block "freed" mid-transfer).
            raise OffloadStateError("gpu_block_pool: already bound to another pool (bind once, at startup)")
        self._gpu_block_pool = gpu_block_pool

    @property
    def gpu_pool(self) -> BlockPool:
        if self._gpu_block_pool is None:
            raise OffloadStateError("gpu_block_pool: not bound; call bind_gpu_block_pool() first")
        return self._gpu_block_pool

    # ------------------------------------------------------------------ loads

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens loadable from the CPU after the local prefix, is_async). Pins the hit."""
        check_int("num_computed_tokens", num_computed_tokens, minimum=0)
        self._check_live(request)
        if (stale := self._pending_cpu_hits.pop(request.request_id, None)) is not None:
            self._free_pending_cpu_hit(stale)
        if request.skip_reading_prefix_cache:
            return 0, False  # prompt logprobs / pooling: nothing cached is read, the CPU's neither
        if num_computed_tokens % self.block_size:
            return 0, False  # a load copies whole blocks: it cannot start mid-block
        for s in self.specs:
            if isinstance(s, ChunkedLocalAttentionSpec) and num_computed_tokens % s.attention_chunk_size:
                return 0, False
        remaining = self.block_hasher(request)[num_computed_tokens // self.hash_block_size:]
        max_hit = request.num_tokens - 1 - num_computed_tokens  # the last token is always computed
        if not remaining or max_hit <= 0:
            return 0, False
        # Chained hashes: a suffix lookup is valid on its own.
        hit_blocks, hit, _ = self.cpu_coordinator.find_longest_cache_hit(remaining, max_hit)
        if hit <= 0:
            return 0, False
        self.cpu_block_pool.touch([b for grp in hit_blocks for b in grp if not b.is_null])
        self._pending_cpu_hits[request.request_id] = (hit_blocks, hit, num_computed_tokens)
        return hit, True

    def update_state_after_alloc(self, request: Request, block_ids: Sequence[Sequence[int]],
                                 num_external_tokens: int) -> None:
        """``block_ids``: the request's whole GPU block table per group after allocation."""
        check_int("num_external_tokens", num_external_tokens, minimum=0)
        self._check_live(request)
        _check_block_table(block_ids, len(self.groups))
        rid = request.request_id
        pending = self._pending_cpu_hits.get(rid)
        if num_external_tokens and pending is not None:
            _, hit, computed = pending
            if num_external_tokens > hit or num_external_tokens % self.hash_block_size:
                raise InvalidFieldError("num_external_tokens", num_external_tokens,
                                        f"a multiple of {self.hash_block_size} <= the offered hit {hit}")
            for g, ids in enumerate(block_ids):
                if len(ids) < computed // self.group_block_sizes[g] + cdiv(num_external_tokens,
                                                                          self.group_block_sizes[g]):
                    raise InvalidFieldError(f"block_ids[{g}]", list(ids), "blocks covering the external tokens")
        if not self.lazy and rid not in self._reqs_to_store:
            n = len(self.groups)
            self._reqs_to_store[rid] = StoreRequestState(request, tuple([] for _ in range(n)), [0] * n)
        self._pending_cpu_hits.pop(rid, None)
        if num_external_tokens == 0 or pending is None:
            if pending is not None:
                self._free_pending_cpu_hit(pending)
            return  # vLLM warns and skips the load when no hit was pending
        hit_blocks, _, computed = pending
        gpu_ids: list[int] = []
        cpu_blocks: list[KVCacheBlock] = []
        for g in self.prefix_cacheable_group_ids:
            bs = self.group_block_sizes[g]
            # The scheduler may accept fewer tokens than offered: take the leading blocks.
            for i, cpu_blk in enumerate(hit_blocks[g][:cdiv(num_external_tokens, bs)]):
                if cpu_blk.is_null:
                    continue
                gpu_ids.append(block_ids[g][computed // bs + i])
                cpu_blocks.append(cpu_blk)
        self.cpu_block_pool.touch(cpu_blocks)
        self._free_pending_cpu_hit(pending)
        self.gpu_pool.touch([self.gpu_pool.blocks[b] for b in gpu_ids])
        self._reqs_to_load[rid] = LoadRequestState(request, TransferMeta(gpu_ids, [b.block_id for b in cpu_blocks]))

    def _free_pending_cpu_hit(self, pending) -> None:
        blocks = [b for grp in pending[0] for b in grp if not b.is_null]
        if blocks:
            self.cpu_block_pool.free_blocks(blocks)

    # ------------------------------------------------------------------ stores

    def _classify_ready(self, block: KVCacheBlock, scan_local: set[int]) -> bool:
        if block.is_null or block.block_hash is None:
            return False
        if block.block_id in self._in_flight_store_gpu_blocks or block.block_id in scan_local:
            return False
        return self.cpu_block_pool.cached_block_hash_to_block.get_one_block(block.block_hash) is None

    def _cached_gpu_block(self, hashes: list[BlockHash], i: int, g: int) -> KVCacheBlock | None:
        if i >= len(hashes):
            return None
        found = self.gpu_pool.get_cached_block(hashes[i], [g])
        return found[0] if found else None

    def _select_eager_blocks(self, state: StoreRequestState, block_ids: Sequence[Sequence[int]]
                             ) -> tuple[list[int], list[int], list[tuple[_BlockStoreMeta, ...] | None] | None]:
        """(GPU blocks to store, cursor advance per group, their event payloads or None with
        events off) over this request's confirmed blocks.

        NOTE: in 0.33.0 the in-flight set is only updated *after* the scan, so one physical block
        id reached twice within the scan (a stale sliding-window slot whose block was freed and
        re-allocated) is selected twice — the open vLLM PR 42903. ``dedup_within_scan`` closes it.
        """
        pool = self.gpu_pool
        selected: list[int] = []
        scan_local: set[int] = set()
        advanced = [0] * len(self.groups)
        metas: list[tuple[_BlockStoreMeta, ...] | None] | None = [] if self.enable_kv_cache_events else None
        request = state.request
        # Async scheduling: tokens of a step still in flight (its output placeholders) are not
        # confirmed yet; their blocks are stored by a later step (or the finish-time flush).
        confirmed = request.num_computed_tokens - request.num_output_placeholders
        num_free = self.cpu_block_pool.get_num_free_blocks()
        for g, ids in enumerate(block_ids):
            if g not in self.prefix_cacheable_group_ids:
                continue
            if len(selected) >= num_free:
                break
            if not self.cpu_coordinator.single_type_managers[g].has_positionally_stable_blocks:
                continue  # a Mamba "align" table: its states come as boundary hand-offs instead
            bs = self.group_block_sizes[g]
            ready = min(len(ids), self.cpu_coordinator.get_num_cacheable_tokens(confirmed, g) // bs)
            fine = self.block_hasher(request)
            hashes = resolve_block_hashes(fine, self.hash_block_size, bs)
            for i in range(state.num_stored_blocks[g], ready):
                block = pool.blocks[ids[i]]
                if block.is_null:
                    # A slot nulled as it left the window; its cached block may still be around.
                    block = self._cached_gpu_block(hashes, i, g)
                    if block is None:
                        advanced[g] += 1
                        continue
                if not self._classify_ready(block, scan_local):
                    advanced[g] += 1
                    continue
                if len(selected) >= num_free:
                    break
                selected.append(block.block_id)
                if metas is not None:
                    metas.append(_capture_store_meta(request, block.block_hash, i, bs, hashes, self.cpu_block_pool,
                                                     fine, self.hash_block_size))
                if self.dedup_within_scan:
                    scan_local.add(block.block_id)
                advanced[g] += 1
        return selected, advanced, metas

    def _prepare_eager_store_specs(self, step: SimpleOffloadStep
                                   ) -> tuple[list[int], list[int], list[str],
                                              list[tuple[_BlockStoreMeta, ...] | None] | None]:
        gpu_out: list[int] = []
        meta_out: list[tuple[_BlockStoreMeta, ...] | None] | None = [] if self.enable_kv_cache_events else None
        cpu_out: list[int] = []
        req_ids: list[str] = []
        n = len(self.groups)
        num_free = self.cpu_block_pool.get_num_free_blocks()
        stats = self.boundary_store_stats
        for rid, entries in step.boundary_state_offloads.items():
            # A request finishing or preempted in this step gives its blocks up (another request
            # may hold them already): its hand-offs are dropped, not read.
            state = self._reqs_to_store.get(rid)
            if state is None or state.finished or rid in step.preempted_req_ids or rid in step.finished_req_ids:
                stats.count("published", len(entries))
                stats.count("dropped_request_gone", len(entries))
                continue
            stored_any = False
            for _, gid, _ in entries:
                stats.count("published")
                block = self.gpu_pool.blocks[gid]
                outcome = _classify_store_candidate(block, self._in_flight_store_gpu_blocks, self.cpu_block_pool)
                if outcome != "ready":
                    stats.count(outcome)
                    continue
                if num_free <= 0:
                    stats.count("dropped_cpu_full")
                    continue
                cpu_out.append(self.cpu_block_pool.get_new_blocks(1)[0].block_id)
                gpu_out.append(gid)
                if meta_out is not None:
                    meta_out.append(None)  # the block's own keys are published at completion
                self._in_flight_store_gpu_blocks.add(gid)
                self.gpu_pool.touch([block])
                num_free -= 1
                stats.count("stored")
                stored_any = True
            if stored_any:
                req_ids.append(rid)
        for rid in step.preempted_req_ids:
            state = self._reqs_to_store.get(rid)
            if state is not None:  # the request resumes with a whole new table
                state.block_ids = tuple([] for _ in range(n))
                state.num_stored_blocks = [0] * n
        for rid, new_ids, full in step.scheduled:
            state = self._reqs_to_store.get(rid)
            if state is None or state.finished:
                continue
            if full:
                state.block_ids = tuple([] for _ in range(n))
            if new_ids:
                for g in range(min(n, len(new_ids))):
                    state.block_ids[g].extend(new_ids[g])
            if not step.num_scheduled_tokens.get(rid, 0):
                continue
            gpu_ids, advanced, metas = self._select_eager_blocks(state, state.block_ids)
            if gpu_ids:
                if meta_out is not None:
                    meta_out += metas
                cpu_ids = [b.block_id for b in self.cpu_block_pool.get_new_blocks(len(gpu_ids))]
                req_ids.append(rid)
                gpu_out += gpu_ids
                cpu_out += cpu_ids
                self._in_flight_store_gpu_blocks.update(gpu_ids)
                # The copy reads these GPU blocks until it completes: hold them.
                self.gpu_pool.touch([self.gpu_pool.blocks[b] for b in gpu_ids])
            for g in range(n):
                state.num_stored_blocks[g] += advanced[g]
        return gpu_out, cpu_out, list(dict.fromkeys(req_ids)), meta_out

    def _prepare_lazy_store_specs(self) -> tuple[list[int], list[int], list[str], None]:
        """Free-queue walk; no request is at hand, so no event payloads (vLLM: ``None``)."""
        pool = self._gpu_block_pool
        if pool is None or self._target_free <= 0:
            return [], [], [], None
        num_cpu_free = self.cpu_block_pool.get_num_free_blocks()
        if self._cursor is not None and self._cursor.ref_cnt > 0:
            self._cursor = None  # the cursor block was taken off the queue
        gpu_ids: list[int] = []
        last = self._cursor
        for covered, node in enumerate(pool.free_block_queue.iter_blocks_after(self._cursor)):
            if covered >= self._target_free or len(gpu_ids) >= num_cpu_free:
                break
            last = node
            if node.block_hash is not None and not node.is_null and \
                    self.cpu_block_pool.cached_block_hash_to_block.get_one_block(node.block_hash) is None:
                gpu_ids.append(node.block_id)
        self._cursor = last
        if not gpu_ids:
            return [], [], [], None
        cpu_ids = [b.block_id for b in self.cpu_block_pool.get_new_blocks(len(gpu_ids))]
        pool.touch([pool.blocks[b] for b in gpu_ids])
        return gpu_ids, cpu_ids, [], None

    def build_connector_meta(self, step: SimpleOffloadStep) -> SimpleOffloadMeta:
        if not isinstance(step, SimpleOffloadStep):
            raise InvalidFieldError("step", step, "a SimpleOffloadStep")
        self.gpu_pool  # noqa: B018 - raises OffloadStateError before any state changes when unbound
        _check_boundary_offloads(step.boundary_state_offloads, len(self.groups), len(self.gpu_pool.blocks))
        gpu, cpu, store_reqs, store_meta = (self._prepare_lazy_store_specs() if self.lazy
                                            else self._prepare_eager_store_specs(step))
        for t in self._pending_finished_stores:
            gpu += t.gpu_block_ids
            cpu += t.cpu_block_ids
            if store_meta is not None:
                store_meta += t.block_meta
        self._pending_finished_stores.clear()
        store_event = -1
        if gpu:
            store_event = self._store_event_counter
            self._store_event_counter += 1
            self._store_event_to_blocks[store_event] = TransferMeta(gpu, cpu, store_meta)
            if store_reqs:
                self._store_event_to_reqs[store_event] = store_reqs
                for rid in store_reqs:
                    if (st := self._reqs_to_store.get(rid)) is not None:
                        st.store_events.add(store_event)
        load_gpu: list[int] = []
        load_cpu: list[int] = []
        load_reqs: list[str] = []
        for rid, ls in self._reqs_to_load.items():
            if ls.load_event is None:
                load_gpu += ls.transfer.gpu_block_ids
                load_cpu += ls.transfer.cpu_block_ids
                load_reqs.append(rid)
        load_event = -1
        if load_reqs:
            load_event = self._load_event_counter
            self._load_event_counter += 1
            for rid in load_reqs:
                self._reqs_to_load[rid].load_event = load_event
            self._load_event_to_reqs[load_event] = load_reqs
        return SimpleOffloadMeta(load_event, tuple(load_gpu), tuple(load_cpu), store_event, tuple(gpu), tuple(cpu),
                                 bool(step.preempted_req_ids))

    # ------------------------------------------------------------------ completions

    def update_connector_output(self, finished_recving: Iterable[str] = (),
                                completed_store_events: dict[int, int] | None = None) -> None:
        """Loads complete per request (``finished_recving``); a store event completes once
        ``world_size`` worker reports have accumulated, in any order and across steps.

        Raises OffloadStateError (nothing changed) for a load completion of a request with no load
        in flight, a store event never issued, or a report for an event already complete — vLLM
        ignores all three silently.
        """
        if isinstance(finished_recving, (str, bytes)) or not isinstance(finished_recving, Iterable):
            raise InvalidFieldError("finished_recving", finished_recving, "request ids (a list of str)")
        recv = list(finished_recving)
        if not all(isinstance(r, str) for r in recv):
            raise InvalidFieldError("finished_recving", recv, "request ids (a list of str)")
        if completed_store_events is not None and not isinstance(completed_store_events, dict):
            raise InvalidFieldError("completed_store_events", completed_store_events,
                                    "None or a dict store event id -> reports")
        events = dict(completed_store_events or {})
        for rid in recv:
            ls = self._reqs_to_load.get(rid) or self._abandoned_reqs_to_load.get(rid)
            if ls is None or ls.load_event is None:
                raise OffloadStateError(f"finished_recving: request {rid!r} has no load in flight")
        if len(set(recv)) != len(recv):
            raise OffloadStateError(f"finished_recving: {recv!r} names a request twice")
        for ev, count in events.items():
            check_int(f"completed_store_events[{ev}]", count, minimum=1)
            if not (isinstance(ev, int) and 0 <= ev < self._store_event_counter):
                raise OffloadStateError(f"completed_store_events: event {ev!r} was never issued")
            if ev not in self._store_event_to_blocks and ev not in self._abandoned_store_event_to_blocks:
                raise OffloadStateError(f"completed_store_events: event {ev} already completed")
            if self._store_event_pending_counts.get(ev, 0) + count > self.world_size:
                raise OffloadStateError(f"completed_store_events: event {ev} reported by more than "
                                        f"world_size={self.world_size} workers")
        for rid in recv:
            self._interval_load_blocks_completed += self._cleanup_load_request(rid)
        for ev, count in events.items():
            total = self._store_event_pending_counts.get(ev, 0) + count
            if total >= self.world_size:
                self._store_event_pending_counts.pop(ev, None)
                self._process_store_event(ev)
            else:
                self._store_event_pending_counts[ev] = total

    def _process_store_event(self, ev: int) -> None:
        t = self._store_event_to_blocks.pop(ev, None)
        if t is None:
            t = self._abandoned_store_event_to_blocks.pop(ev)
            self._release_transfer_refs(t)  # abandoned by reset(): release, do not cache
            return
        if not self.lazy:
            self._in_flight_store_gpu_blocks.difference_update(t.gpu_block_ids)
        gpu = self.gpu_pool
        cpu_blocks = [self.cpu_block_pool.blocks[b] for b in t.cpu_block_ids]
        for i, (gid, cblk) in enumerate(zip(t.gpu_block_ids, cpu_blocks)):
            gblk = gpu.blocks[gid]
            # NOTE: the GPU block still carries its hash: the store's ref kept it off the queue.
            assert gblk.block_hash is not None
            self.cpu_block_pool._insert_block_hash(gblk.block_hash, cblk, gblk.block_hash_num_tokens)
            secondary = list(gpu.cached_block_hashes_by_block.get(gid, ()))
            for h in secondary:
                self.cpu_block_pool._insert_block_hash(h, cblk, None)
            if self.enable_kv_cache_events:
                meta = t.block_meta[i] if t.block_meta is not None else None
                self.cpu_block_pool.kv_event_queue += _block_stored_events(
                    gblk.block_hash, secondary, meta, self.specs, self.group_block_sizes, self.cpu_block_pool)
        self.cpu_block_pool.free_blocks(cpu_blocks)
        gpu.free_blocks([gpu.blocks[b] for b in t.gpu_block_ids])
        if not self.lazy:
            for rid in self._store_event_to_reqs.pop(ev, []):
                st = self._reqs_to_store.get(rid)
                if st is None:
                    continue
                st.store_events.discard(ev)
                if st.finished and not st.store_events:
                    self._cleanup_store_request(rid)

    def _release_transfer_refs(self, t: TransferMeta) -> None:
        self.cpu_block_pool.free_blocks([self.cpu_block_pool.blocks[b] for b in t.cpu_block_ids])
        self.gpu_pool.free_blocks([self.gpu_pool.blocks[b] for b in t.gpu_block_ids])

    def _cleanup_load_request(self, rid: str) -> int:
        """Release a request's load; returns its block count if the load was issued to the
        workers, else 0 (a never-issued load does not count as completed)."""
        ls = self._reqs_to_load.pop(rid, None) or self._abandoned_reqs_to_load.pop(rid, None)
        if ls is None:
            return 0
        if ls.load_event is not None and (reqs := self._load_event_to_reqs.get(ls.load_event)) is not None:
            if rid in reqs:
                reqs.remove(rid)
            if not reqs:
                self._load_event_to_reqs.pop(ls.load_event, None)
        self._release_transfer_refs(ls.transfer)
        return 0 if ls.load_event is None else len(ls.transfer.gpu_block_ids)

    def _cleanup_store_request(self, rid: str) -> None:
        st = self._reqs_to_store.pop(rid, None)
        if st is None:
            return
        for ev in st.store_events:
            if (reqs := self._store_event_to_reqs.get(ev)) is not None:
                if rid in reqs:
                    reqs.remove(rid)
                if not reqs:
                    self._store_event_to_reqs.pop(ev, None)
        st.store_events.clear()

    # ------------------------------------------------------------------ finish / reset

    def _check_live(self, request: Request) -> None:
        if not isinstance(request, Request):
            raise InvalidFieldError("request", request, "a kvref.impl.request.Request")
        if request.request_id in self._finished_req_ids:
            raise OffloadStateError(f"request {request.request_id!r} already finished")

    def request_finished(self, request: Request, block_ids: Sequence[Sequence[int]] = ()) -> tuple[bool, None]:
        """Finish-time flush (eager): queue the confirmed blocks the cursors have not reached,
        then release pins; stores and loads still in flight keep their refs and finish later.
        Always (False, None): the refs protect the GPU blocks, the scheduler frees at once."""
        self._check_live(request)
        if not isinstance(block_ids, (list, tuple)) or block_ids:
            _check_block_table(block_ids, len(self.groups))
        rid = request.request_id
        self._finished_req_ids.add(rid)
        st = self._reqs_to_store.get(rid)
        if st is not None and block_ids and self._gpu_block_pool is not None:
            gpu_ids, _, metas = self._select_eager_blocks(st, block_ids)
            tail = _find_fa_partial_tail_source(self, request, block_ids)
            # A decode that filled the boundary block already selected it: one CPU block per GPU block.
            if tail is not None and tail not in gpu_ids and len(gpu_ids) < self.cpu_block_pool.get_num_free_blocks():
                gpu_ids.append(tail)
                if metas is not None:
                    metas.append(None)
            if gpu_ids:
                cpu = self.cpu_block_pool.get_new_blocks(len(gpu_ids))
                self._pending_finished_stores.append(TransferMeta(gpu_ids, [b.block_id for b in cpu], metas))
                self._in_flight_store_gpu_blocks.update(gpu_ids)
                self.gpu_pool.touch([self.gpu_pool.blocks[b] for b in gpu_ids])
        if (pending := self._pending_cpu_hits.pop(rid, None)) is not None:
            self._free_pending_cpu_hit(pending)
        ls = self._reqs_to_load.get(rid)
        if ls is not None:
            if ls.load_event is not None:
                ls.finished = True
            else:
                self._cleanup_load_request(rid)
        if not self.lazy and (st := self._reqs_to_store.get(rid)) is not None:
            if st.store_events:
                st.finished = True
            else:
                self._cleanup_store_request(rid)
        return False, None

    def has_pending_stores(self) -> bool:
        """A store is queued (finish-time flush), in flight or abandoned but still running."""
        return bool(self._pending_finished_stores or self._store_event_to_blocks
                    or self._abandoned_store_event_to_blocks)

    def get_stats(self) -> dict[str, int]:
        """What vLLM's ``get_stats`` reports per interval (its ``SimpleCPUOffloadStats``):
        ``load_blocks`` completed since the last call (drained), the CPU blocks in use
        (``used_blocks``: every block but the free ones, the null block included) and the CPU
        blocks of stores not yet completed (``pending_store_blocks``: issued, queued by a
        finish-time flush, or abandoned by a reset and still running)."""
        loaded, self._interval_load_blocks_completed = self._interval_load_blocks_completed, 0
        pending = sum(len(t.cpu_block_ids) for t in (*self._store_event_to_blocks.values(),
                                                      *self._pending_finished_stores,
                                                      *self._abandoned_store_event_to_blocks.values()))
        return {"load_blocks": loaded, "used_blocks": self.num_cpu_blocks - self.cpu_block_pool.get_num_free_blocks(),
                "pending_store_blocks": pending}

    def take_save_outcomes(self) -> dict[tuple[str], int]:
        """The boundary hand-off outcomes since the last call, ``{(outcome,): count}`` for the
        positive ones (vLLM's ``SAVE_OUTCOMES`` counter, drained by its ``get_stats``)."""
        out = self.boundary_store_stats.delta(self._boundary_stats_snapshot)
        self._boundary_stats_snapshot = self.boundary_store_stats.copy()
        return {(k,): out[k] for k in OUTCOMES if out[k] > 0}

    def get_boundary_store_stats(self) -> dict[str, int]:
        """The cumulative hand-off counters (vLLM's ``get_boundary_store_stats``)."""
        return self.boundary_store_stats.as_dict()

    def take_events(self) -> list:
        """The KV cache events queued since the last call, oldest first ([] with events off):
        stores published on the CPU, CPU evictions, cache clears (vLLM ``take_events``)."""
        return _relabel_pool_events(self.cpu_block_pool.take_events())

    def reset(self) -> bool:
        """Abandon transfers (their refs are released when workers report them, uncached) and
        clear the CPU cache if nothing is in flight; False while something is."""
        for p in self._pending_cpu_hits.values():
            self._free_pending_cpu_hit(p)
        self._pending_cpu_hits.clear()
        self._abandoned_store_event_to_blocks.update(self._store_event_to_blocks)
        for t in self._pending_finished_stores:
            self._release_transfer_refs(t)
        self._pending_finished_stores.clear()
        self._store_event_to_blocks.clear()
        self._in_flight_store_gpu_blocks.clear()
        for rid in list(self._reqs_to_load):
            ls = self._reqs_to_load.pop(rid)
            if ls.load_event is None:
                self._release_transfer_refs(ls.transfer)
            else:
                self._abandoned_reqs_to_load[rid] = ls
        self._reqs_to_store.clear()
        self._store_event_to_reqs.clear()
        self._store_event_pending_counts = {e: c for e, c in self._store_event_pending_counts.items()
                                            if e in self._abandoned_store_event_to_blocks}
        self._cursor = None
        # Fresh counters seeded with what was not drained yet, so a reset mid-interval loses nothing.
        self.boundary_store_stats = _BoundaryStoreStats(self.boundary_store_stats.delta(self._boundary_stats_snapshot))
        self._boundary_stats_snapshot = _BoundaryStoreStats()
        if self._abandoned_store_event_to_blocks or self._abandoned_reqs_to_load:
            return False
        return self.cpu_block_pool.reset_prefix_cache()

    # ------------------------------------------------------------------ inspection

    def in_flight_stores(self) -> list[TransferMeta]:
        """Every store whose copy may be running: issued events, abandoned ones, queued flushes."""
        return (list(self._store_event_to_blocks.values()) + list(self._abandoned_store_event_to_blocks.values())
                + list(self._pending_finished_stores))

    def in_flight_loads(self) -> list[TransferMeta]:
        return [ls.transfer for ls in list(self._reqs_to_load.values()) + list(self._abandoned_reqs_to_load.values())]

    def check_invariants(self) -> None:
        """O1-O3 of docs/invariants.md plus pool consistency."""
        self.cpu_block_pool.check_invariants()
        stores = self.in_flight_stores()
        loads = self.in_flight_loads()
        pins = [b for p in self._pending_cpu_hits.values() for grp in p[0] for b in grp if not b.is_null]
        # O2: every transfer holds one ref per CPU block; pins hold one each. Nothing else does.
        expected: dict[int, int] = {}
        for t in stores + loads:
            for b in t.cpu_block_ids:
                expected[b] = expected.get(b, 0) + 1
        for b in pins:
            expected[b.block_id] = expected.get(b.block_id, 0) + 1
        for blk in self.cpu_block_pool.blocks[1:]:
            assert blk.ref_cnt == expected.get(blk.block_id, 0), \
                f"O2: CPU block {blk.block_id}: ref_cnt {blk.ref_cnt} != transfers+pins {expected.get(blk.block_id, 0)}"
        # O3: a CPU block being written is not findable.
        writing = {b for t in stores for b in t.cpu_block_ids}
        for b in writing:
            assert self.cpu_block_pool.blocks[b].block_hash is None, f"O3: CPU block {b} hashed while being written"
        # O1 (eager): the in-flight set is exactly the GPU sources of live, non-abandoned stores.
        if not self.lazy:
            live = {g for t in list(self._store_event_to_blocks.values()) + self._pending_finished_stores
                    for g in t.gpu_block_ids}
            assert self._in_flight_store_gpu_blocks == live, "O1: in-flight set out of sync with issued stores"
        if self._gpu_block_pool is not None:
            for t in stores + loads:
                for g in t.gpu_block_ids:
                    assert self._gpu_block_pool.blocks[g].ref_cnt > 0, f"O2: GPU block {g} freed while in a transfer"
