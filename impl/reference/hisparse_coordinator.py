"""The HiSparse coordinator in the reference: host write-back, GPU residency and host imports
(vLLM 0.33.0 ``HiSparseCoordinator``, ``v1/hisparse/coordinator.py``; issue #23).

GPU-resident pages are a write-back cache of the host tier. Each step, for every scheduled request,
the coordinator plans a write-back (a *spill*) of every sealed page that has no host copy yet, at
most ``max_model_len // block_size`` transfers per step, holding one extra reference on the page's
host block and on its GPU block in every resident group. The worker reports, per transfer, how many
workers enqueued it and how many completed it (``update_spills``); once all completed, the GPU pins
are dropped and the page is *clean*: its host copy is durable, the request's durable prefix
(``ready_prefix_pages``) grows, and the host block's extra reference goes.

A clean page of a request that can read from host (it holds a complete hot region in every hot
group) is released with ``unpin_blocks``: the GPU block counts as free but is still read until the
pool reuses it; then the page is *lost* (read from host from now on, its row entry sent again to
the worker) and the request is asked for a hot region. A request that cannot read from host keeps
its clean pages pinned, and is asked for its hot region when the GPU pool runs below the transition
watermark or it holds the resident pages admission reserved for it.

Publication of host hashes (prefix caching), GPU copies adopted by later hits and the worker-facing
views are in :mod:`.hisparse_publication` and :mod:`.hisparse_views`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from kvref.spec.errors import InvalidFieldError, check_int
from kvref.spec.hisparse import needs_hot_transition, transition_watermark
from kvref.spec.mathutil import cdiv

from .block_pool import BlockPoolCore
from .hisparse_block_pool import ReuseWatchingBlockPool
from .hisparse_hot_manager import HiSparseHotManager
from .hisparse_publication import HiSparsePublication
from .hisparse_resident_manager import HiSparseResidentManager
from .hisparse_source_manager import HiSparseSourceManager
from .hisparse_state import (
    ACTIVE_TAIL_PAGES,
    HiSparseRequestState,
    PendingSpill,
    SparseKVPageTransfer,
)
from .hisparse_views import HiSparseWorkerViews
from .kv_cache_block import KVCacheBlock
from .single_type_manager import SingleTypeKVCacheManager


class HiSparseCoordinator(HiSparsePublication, HiSparseWorkerViews):
    """Owns the host pool binding, write-back, residency and host imports of one HiSparse pool.

    Args:
        managers: the pool's single-type managers in KV cache group order (one host source, then
            the indexer, resident and hot groups).
        num_gpu_blocks: the GPU pool's size (the host source's admission sentinel is one more).
        host_num_blocks: the private host pool's size (``hisparse_host_num_blocks``).
        max_model_len: bounds the write-backs planned per step.
        num_reprefillable_tokens: trailing tokens not final yet (multi-module MTP re-prefills them),
            never written back.
    """

    def __init__(self, managers: Sequence[SingleTypeKVCacheManager], num_gpu_blocks: int, host_num_blocks: int,
                 max_model_len: int, *, num_reprefillable_tokens: int = 0) -> None:
        check_int("max_model_len", max_model_len, minimum=1)
        check_int("num_reprefillable_tokens", num_reprefillable_tokens, minimum=0)
        self.managers = tuple(managers)
        self.max_model_len = max_model_len
        self.num_reprefillable_tokens = num_reprefillable_tokens
        self.resident_managers = tuple(m for m in self.managers if isinstance(m, HiSparseResidentManager))
        self.hot_managers = tuple(m for m in self.managers if isinstance(m, HiSparseHotManager))
        sources = [(gid, m) for gid, m in enumerate(self.managers) if isinstance(m, HiSparseSourceManager)]
        if len(sources) != 1:
            raise InvalidFieldError("managers", [type(m).__name__ for m in self.managers],
                                    "exactly one HiSparse host source group")
        self.host_group_id, self.host_manager = sources[0]
        for m in (*self.resident_managers, *self.hot_managers, self.host_manager):
            m.coordinator = self
        self.host_manager.bind_host_pool(host_num_blocks, num_gpu_blocks)
        self.gpu_pool: ReuseWatchingBlockPool | None = None
        self.max_spill_pages = 0
        self.transition_watermark = 0
        if self.resident_managers:
            resident_ids = [gid for gid, m in enumerate(self.managers) if isinstance(m, HiSparseResidentManager)]
            if self.host_group_id > min(resident_ids):
                raise InvalidFieldError("managers", self.host_group_id, "the host group before every resident group")
            sizes = {m.block_size for m in self.resident_managers} | {self.host_manager.block_size}
            if len(sizes) != 1:
                raise InvalidFieldError("block_size", sorted(sizes), "one block size for host and resident groups")
            pool = self.resident_managers[0].block_pool
            if not isinstance(pool, ReuseWatchingBlockPool):
                raise InvalidFieldError("gpu_pool", type(pool).__name__, "a ReuseWatchingBlockPool (unpin_blocks)")
            self.gpu_pool = pool
            pool.other_pools.append(self.host_manager.block_pool)
            self.max_spill_pages = max_model_len // self.host_manager.block_size
            # requests start reading from host once the shared pool runs this low, so admissions
            # find evictable pages rather than pinned ones
            self.transition_watermark = transition_watermark([m.blocks_per_request for m in self.hot_managers],
                                                             num_gpu_blocks)
        #: request -> prefix length an external load is still filling in (host pages)
        self._pending_imports: dict[str, int] = {}
        #: requests whose resident pages were all non-null when last scanned
        self._resident_requests: set[str] = set()
        self.spills_to_send: list[SparseKVPageTransfer] = []
        self.pending_spills: dict[int, PendingSpill] = {}
        self.request_states: dict[str, HiSparseRequestState] = {}
        self.next_spill_id = 0
        #: unpinned GPU block id -> (request, page) pairs still reading it
        self._owners: dict[int, set[tuple[str, int]]] = {}
        self._init_publication()

    def _get_request_state(self, request_id: str) -> HiSparseRequestState:
        state = self.request_states.get(request_id)
        if state is None:
            state = self.request_states[request_id] = HiSparseRequestState()
        return state

    # ------------------------------------------------------------------ residency

    def _can_read_from_host(self, request_id: str) -> bool:
        return bool(self.hot_managers) and all(m.has_hot(request_id) for m in self.hot_managers)

    def _fills_admission_window(self, request_id: str) -> bool:
        """Whether the request holds the resident pages admission reserved for it (admission caps
        resident pages at the in-flight window, assuming older pages move to host)."""
        return any(len(m.req_to_blocks.get(request_id, ())) >= m.max_admission_blocks_per_request
                   for m in self.resident_managers)

    def _resident_page_blocks(self, request_id: str, page_idx: int) -> list[KVCacheBlock] | None:
        """The page's GPU block in every resident group; None for a page near the table's tail (an
        in-flight step may still write it) or one that is not resident."""
        blocks = []
        for m in self.resident_managers:
            block = m.get_resident_page(request_id, page_idx)
            if page_idx >= len(m.req_to_blocks.get(request_id, ())) - ACTIVE_TAIL_PAGES or block is None:
                return None
            blocks.append(block)
        return blocks

    def _unpin_page(self, request_id: str, state: HiSparseRequestState, page_idx: int) -> bool:
        if page_idx in state.pending_pages or page_idx not in state.valid_pages:
            return False
        blocks = self._resident_page_blocks(request_id, page_idx)
        if blocks is None:
            return False
        for m, block in zip(self.resident_managers, blocks):
            self._owners.setdefault(block.block_id, set()).add((request_id, page_idx))
            m.block_pool.unpin_blocks([block], self._on_block_reused)
        state.pinned_clean.discard(page_idx)
        state.unpinned_pages.add(page_idx)
        return True

    def _unpin_clean_pages(self, request_id: str, state: HiSparseRequestState) -> None:
        for page_idx in sorted(state.pinned_clean, reverse=True):  # tail first: a prefix keeps its head longest
            self._unpin_page(request_id, state, page_idx)

    def _page_became_clean(self, request_id: str, state: HiSparseRequestState, page_idx: int) -> None:
        state.pinned_clean.add(page_idx)
        if self._can_read_from_host(request_id):
            self._unpin_page(request_id, state, page_idx)

    def _on_block_reused(self, block: KVCacheBlock) -> None:
        """The pool handed out a block that unpinned pages (or a recorded copy) still read."""
        self._forget_copy_of(block)
        for request_id, page_idx in self._owners.pop(block.block_id, ()):
            self._lose_page(request_id, page_idx)

    def _lose_page(self, request_id: str, page_idx: int) -> None:
        self._resident_requests.discard(request_id)
        state = self.request_states.get(request_id)
        if state is None:
            return
        for m in self.resident_managers:
            block = m.drop_resident_page(request_id, page_idx)
            if block is not None and block.block_id in self._owners:
                self._owners[block.block_id].discard((request_id, page_idx))
        state.unpinned_pages.discard(page_idx)
        if page_idx < state.synced_pages:
            state.stale_pages.add(page_idx)
        for m in self.hot_managers:
            m.require_hot(request_id)

    def update_residency(self, request_id: str) -> None:
        """Per-step residency rule of a scheduled request: adopt the GPU copies of its host hit
        first; then a request that can read from host releases its clean pages, and one that cannot
        is asked for a hot region when the pool runs low or it fills its admission window."""
        if not self.resident_managers:
            return
        state = self._get_request_state(request_id)
        if state.pages_to_adopt:
            host_blocks = self.host_manager.req_to_blocks.get(request_id, [])
            self._adopt_copies(request_id, state, host_blocks[:state.pages_to_adopt])
            state.pages_to_adopt = 0
        if self._can_read_from_host(request_id):
            self._unpin_clean_pages(request_id, state)
        elif needs_hot_transition(self.gpu_pool.get_num_free_blocks(), self.transition_watermark,
                                  self._fills_admission_window(request_id)):
            for m in self.hot_managers:
                m.require_hot(request_id)

    def commit_computed_blocks(self, request_id: str, num_host_pages: int) -> None:
        """A prefix hit on host pages the request now references: they are clean (durable) and
        their GPU copies are adopted after the admitting allocation."""
        self._resident_requests.discard(request_id)
        if not self.resident_managers:
            return
        num_host_pages = min(num_host_pages, len(self.host_manager.req_to_blocks.get(request_id, ())))
        if num_host_pages == 0:
            return
        state = self._get_request_state(request_id)
        state.valid_pages.update(range(num_host_pages))
        state.ready_prefix_pages = max(num_host_pages, state.ready_prefix_pages)
        state.pages_to_adopt = max(state.pages_to_adopt, num_host_pages)
        state.copies_recorded_blocks = max(state.copies_recorded_blocks, num_host_pages)

    # ------------------------------------------------------------------ write-back

    def advance_scheduled(self, requests: Iterable[tuple[str, int]]) -> None:
        """Per-step work for each scheduled ``(request id, tokens computed once the step ends)``:
        plan the write-back of its sealed pages (the last ``num_reprefillable_tokens`` are not
        final), then its residency rule."""
        if not self.resident_managers:
            return
        for request_id, num_tokens in requests:
            check_int("num_tokens", num_tokens, minimum=0)
            self.plan_prefix_materialization(request_id, max(0, num_tokens - self.num_reprefillable_tokens))
            self.update_residency(request_id)

    def plan_prefix_materialization(self, request_id: str, num_computed_tokens: int) -> None:
        """Plan a write-back for every sealed, resident page that has no host copy and none in
        flight, after the durable prefix and any prefix an import is filling, within the step's
        transfer budget."""
        if not self.resident_managers:
            return
        bs = self.host_manager.block_size
        state = self._get_request_state(request_id)
        budget = max(self.max_spill_pages - len(self.spills_to_send), 0)
        first_page = max(state.ready_prefix_pages, cdiv(self._pending_imports.get(request_id, 0), bs))
        for page_idx in range(first_page, num_computed_tokens // bs):
            if budget == 0:
                break
            if page_idx in state.pending_pages or page_idx in state.valid_pages:
                continue
            if any(m.get_resident_page(request_id, page_idx) is None for m in self.resident_managers):
                continue
            if self._plan_page_transfer(request_id, page_idx, after_forward=True):
                budget -= 1

    def _plan_page_transfer(self, request_id: str, page_idx: int, *, after_forward: bool,
                            restore: bool = False) -> bool:
        state = self._get_request_state(request_id)
        if page_idx in state.pending_pages:
            return False
        host_blocks = self.host_manager.req_to_blocks.get(request_id)
        if host_blocks is None or page_idx >= len(host_blocks) or host_blocks[page_idx].is_null:
            return False
        host_block = host_blocks[page_idx]
        blocks = [m.get_resident_page(request_id, page_idx) for m in self.resident_managers]
        if any(b is None for b in blocks):
            return False
        # both endpoints stay referenced until every worker has run the transfer
        BlockPoolCore.touch(self.host_manager.block_pool, [host_block])
        for m, block in zip(self.resident_managers, blocks):
            BlockPoolCore.touch(m.block_pool, [block])
        spill_id, self.next_spill_id = self.next_spill_id, self.next_spill_id + 1
        self.pending_spills[spill_id] = PendingSpill(spill_id, (request_id, page_idx), state, host_block,
                                                     tuple(blocks), restore=restore)
        state.pending_pages[page_idx] = spill_id
        self.spills_to_send.append(SparseKVPageTransfer(spill_id, host_block.block_id,
                                                        tuple(b.block_id for b in blocks), after_forward, restore))
        return True

    def update_spills(self, enqueued_counts: Mapping[int, int], completed_counts: Mapping[int, int]) -> None:
        """The workers' report: per transfer id, how many workers enqueued it (the first report
        counts) and how many more completed it. Transfers every worker completed release their
        GPU pins, then make their page clean and release the host block's reference."""
        for name, counts in (("enqueued_counts", enqueued_counts), ("completed_counts", completed_counts)):
            if not isinstance(counts, Mapping):
                raise InvalidFieldError(name, counts, "a mapping of transfer id -> count")
            for k, v in counts.items():
                check_int(f"{name}[{k!r}]", v, minimum=0)
        for spill_id, count in enqueued_counts.items():
            pending = self.pending_spills.get(spill_id)
            if pending is not None and pending.expected_worker_completions == 0:
                pending.expected_worker_completions = count
        for spill_id, count in completed_counts.items():
            pending = self.pending_spills.get(spill_id)
            if pending is not None:
                pending.worker_completions += count
        self._apply_enqueued_spills()
        self._complete_host_writes()

    @staticmethod
    def _all_workers_done(pending: PendingSpill) -> bool:
        return bool(pending.expected_worker_completions) and \
            pending.worker_completions >= pending.expected_worker_completions

    def _apply_enqueued_spills(self) -> None:
        for pending in self.pending_spills.values():
            if pending.enqueue_applied or not self._all_workers_done(pending):
                continue
            for m, block in zip(self.resident_managers, pending.resident_blocks):
                BlockPoolCore.free_blocks(m.block_pool, [block])
            pending.enqueue_applied = True

    def _complete_host_writes(self) -> None:
        completed = [p for p in self.pending_spills.values() if p.enqueue_applied and self._all_workers_done(p)]
        # a set, as in vLLM: requests completing in one report publish in set order, and when two
        # of them publish the same hash the copy recorded last is the one a later hit adopts, so
        # the order is observable (it follows the process's string hash seed on both sides)
        completed_request_ids: set[str] = set()
        for pending in completed:
            del self.pending_spills[pending.transfer_id]
            request_id, page_idx = pending.page
            state = pending.request_state
            state.pending_pages.pop(page_idx, None)
            if self.request_states.get(request_id) is state:
                if not pending.restore:
                    state.valid_pages.add(page_idx)
                if page_idx in state.valid_pages:
                    self._page_became_clean(request_id, state, page_idx)
                    if pending.restore:
                        self._record_copy(request_id, page_idx, pending.host_block)
                completed_request_ids.add(request_id)
            elif state.publication is not None:  # a finished request's last write-backs
                if not pending.restore:
                    state.valid_pages.add(page_idx)
                self._publish_detached_blocks(state)
            BlockPoolCore.free_blocks(self.host_manager.block_pool, [pending.host_block])
        for request_id in completed_request_ids:
            state = self.request_states[request_id]
            while state.ready_prefix_pages in state.valid_pages:
                state.ready_prefix_pages += 1
            self._publish_host_blocks_if_ready(request_id)

    def has_pending_reclamation(self) -> bool:
        """Whether a transfer in flight frees a GPU or host block when it completes."""
        return any(p.host_block.ref_cnt == 1 or (p.page[0] in self.request_states
                                                 and self._can_read_from_host(p.page[0]))
                   for p in self.pending_spills.values())

    def has_pending_work(self) -> bool:
        return bool(self.spills_to_send or self.pending_spills or self._retained_copies)

    # ------------------------------------------------------------------ host imports

    def record_pending_host_import(self, request_id: str, num_tokens: int) -> None:
        """An external load is filling the request's first ``num_tokens`` tokens of host pages."""
        check_int("num_tokens", num_tokens, minimum=0)
        self._resident_requests.discard(request_id)
        self._pending_imports[request_id] = num_tokens

    def finish_host_import(self, request_id: str, *, failed: bool) -> None:
        num_tokens = self._pending_imports.pop(request_id, None)
        if num_tokens is not None and not failed:
            self.complete_host_import(request_id, num_tokens)

    def complete_host_import(self, request_id: str, num_computed_tokens: int) -> None:
        """The imported host pages are durable: mark them clean and restore the last one (the
        request's writable tail) to its GPU page."""
        check_int("num_computed_tokens", num_computed_tokens, minimum=0)
        if not self.resident_managers:
            return
        num_pages = num_computed_tokens // self.resident_managers[0].block_size
        state = self._get_request_state(request_id)
        state.valid_pages = set(range(num_pages))
        state.ready_prefix_pages = num_pages
        if num_computed_tokens:
            self._plan_page_transfer(request_id, (num_computed_tokens - 1) // self.resident_managers[0].block_size,
                                     after_forward=False, restore=True)
        self._publish_host_blocks_if_ready(request_id)

    # ------------------------------------------------------------------ free

    def free(self, request_id: str) -> None:
        """Detach the request before its managers free their tables: clean pages are released
        (unpinned, still readable copies), unpinned ones forgotten; dirty or in-flight pages stay
        in the row for the resident manager to free (their transfers keep their own pins)."""
        self._resident_requests.discard(request_id)
        self._pending_imports.pop(request_id, None)
        state = self.request_states.pop(request_id, None)
        if state is None:
            return
        self._detach_publication(request_id, state)
        for m in self.resident_managers:
            row = m.get_residency_row(request_id)
            for page_idx in reversed(range(len(row))):  # tail first
                block = row[page_idx]
                if block.is_null:
                    continue
                if page_idx in state.unpinned_pages:
                    owners = self._owners.get(block.block_id)
                    if owners is not None:
                        owners.discard((request_id, page_idx))
                elif page_idx in state.valid_pages and page_idx not in state.pending_pages:
                    m.block_pool.unpin_blocks([block], self._on_block_reused)
                else:
                    continue
                m.drop_resident_page(request_id, page_idx)

    def check_invariants(self) -> None:
        """M18: every page in flight names a transfer in flight for that page and every transfer in
        flight is indexed by its page; every owner of an unpinned block is an unpinned page of a
        live request. (Not "unpinned pages are clean": an import's completion resets the clean set
        to the imported prefix, as vLLM does, while later pages may already be unpinned.)"""
        for rid, state in self.request_states.items():
            for page_idx, spill_id in state.pending_pages.items():
                pending = self.pending_spills.get(spill_id)
                assert pending is not None and pending.page == (rid, page_idx), \
                    f"M18: request {rid} page {page_idx} names transfer {spill_id}, which is not in flight for it"
        for spill_id, pending in self.pending_spills.items():
            assert spill_id < self.next_spill_id, f"M18: transfer {spill_id} was never planned"
            assert pending.request_state.pending_pages.get(pending.page[1]) == spill_id, \
                f"M18: transfer {spill_id} is not indexed by its page {pending.page}"
        for bid, owners in self._owners.items():
            for rid, page_idx in owners:
                assert rid in self.request_states and page_idx in self.request_states[rid].unpinned_pages, \
                    f"M18: block {bid} is owned by ({rid}, {page_idx}), which is not an unpinned page"
        self._check_publication_invariants()
