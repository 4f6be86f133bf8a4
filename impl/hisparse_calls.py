"""The single-type-manager calls both HiSparse pools make, in the order vLLM 0.33.0's
``KVCacheManager.allocate_slots`` / ``KVCacheCoordinator`` make them (issue #23).

:class:`kvref.impl.reference.hisparse_pool.HiSparsePool` (kvref's managers) and
:class:`kvref.impl.vllm.hisparse.VllmHiSparsePool` (vLLM's) hold a ``managers`` tuple in group
order with the same method names, so the way a request is admitted and allocated is written once
here: a difference between the two pools is then a difference in the managers, never in how each
side happens to drive them (#26: the two copies were the duplicates tool's D1).
"""

from __future__ import annotations

from typing import Any

from kvref.spec.errors import InvalidFieldError, check_int


class HiSparseManagerCalls:
    """Mixin: needs ``self.managers``, the pool's single-type managers in KV cache group order."""

    managers: tuple[Any, ...]
    #: request -> per-group hit blocks of its last ``find_longest_cache_hit``, until admitted
    _hits: dict[str, list[list[Any]]]

    def is_running(self, request_id: str) -> bool:
        return any(request_id in m.num_cached_block for m in self.managers)

    # ---------------------------------------------------------------- prefix caching (enable_caching)
    # Each side hashes its own requests (``block_hashes``) and publishes through its own
    # coordinator (``cache_blocks``); the hit search is written once here.

    def find_longest_cache_hit(self, request_id: str, prompt: list[int],
                               max_length: int) -> tuple[int, list[list[int]]]:
        """``HybridKVCacheCoordinator.find_longest_cache_hit`` on a HiSparse pool: the prefix-cacheable
        groups are the host source (first: full attention) and the GPU indexer, which looks only as
        far as the source hit; the reconciled hit is the indexer's, whose blocks are cut to it while
        the source keeps its longer hit (``retains_longer_hit``: ``allocate`` cuts it to the tokens
        the request reuses). Remembers the hit for the admission; returns the hit length and the
        hit block ids of each group."""
        hashes = self.block_hashes(request_id, prompt)
        bs = self.config.block_size
        source, indexer = self.managers[0], self.managers[1]
        (src_blocks,), src_len = type(source).find_longest_cache_hit(
            hashes, max_length, [0], source.block_pool, source.kv_cache_spec, False, bs)
        (idx_blocks,), hit = type(indexer).find_longest_cache_hit(
            hashes, src_len, [1], indexer.block_pool, indexer.kv_cache_spec, False, bs)
        hits = [list(src_blocks), list(idx_blocks)[:-(-hit // bs)]] + [[] for _ in self.managers[2:]]
        self._hits[request_id] = hits
        return hit, [[b.block_id for b in blocks] for blocks in hits]

    def _new_computed_blocks(self, request_id: str, num_reused_tokens: int) -> list[list[Any]]:
        """The remembered hit of a request being admitted, the source's cut to the reused tokens
        (``KVCacheManager.allocate_slots``: retained-hit groups keep the local and external hits)."""
        hits = self._hits.get(request_id)
        if hits is None:
            return [[] for _ in self.managers]
        return [hits[0][:-(-num_reused_tokens // self.config.block_size)], *hits[1:]]

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, total_computed_tokens: int,
                                   num_local_computed_tokens: int, apply_admission_cap: bool) -> list[int]:
        new = ([[] for _ in self.managers] if self.is_running(request_id)
               else self._new_computed_blocks(request_id, total_computed_tokens))
        return [m.get_num_blocks_to_allocate(request_id, num_tokens, blocks, total_computed_tokens,
                                             num_local_computed_tokens, num_tokens,
                                             apply_admission_cap=apply_admission_cap)
                for m, blocks in zip(self.managers, new)]

    def allocate(self, request_id: str, num_tokens: int, num_local_computed_tokens: int,
                 num_external_computed_tokens: int) -> list[list[int]]:
        """``allocate_new_computed_blocks`` (a new request with a host hit or an import) then
        ``allocate_new_blocks``; the new block ids of each group."""
        if not self.is_running(request_id) and (num_local_computed_tokens or num_external_computed_tokens):
            new = self._new_computed_blocks(request_id, num_local_computed_tokens + num_external_computed_tokens)
            for m, blocks in zip(self.managers, new):
                m.add_local_computed_blocks(request_id, blocks, num_local_computed_tokens,
                                            num_external_computed_tokens)
            if num_external_computed_tokens:
                for m in self.managers:
                    m.allocate_external_computed_blocks(request_id, num_local_computed_tokens,
                                                        num_external_computed_tokens)
        self._hits.pop(request_id, None)
        return [[b.block_id for b in m.allocate_new_blocks(request_id, num_tokens, num_tokens)]
                for m in self.managers]

    # ---------------------------------------------------------------- the HiSparse coordinator
    # What vLLM's scheduler and HiSparse connector call on ``HiSparseCoordinator`` (both pools hold
    # one as ``self.coordinator``, with vLLM's method names); answers in plain values.

    def update_residency(self, request_id: str) -> None:
        self.coordinator.update_residency(request_id)

    def advance_scheduled(self, requests: list[tuple[str, int]]) -> None:
        self.coordinator.advance_scheduled(list(requests))

    def build_offload_command(self) -> list[tuple] | None:
        """The page transfers planned since the last command: (id, host block, resident blocks,
        after_forward, restore); None when the layout has no resident group (a host-only pool sends
        the worker no offload command)."""
        command = self.coordinator.build_offload_command()
        if command is None:
            return None
        return [(t.transfer_id, t.host_block_id, tuple(t.resident_block_ids), t.after_forward, t.restore)
                for t in command.page_transfers]

    def update_spills(self, enqueued_counts: dict[int, int], completed_counts: dict[int, int]) -> None:
        self.coordinator.update_spills(dict(enqueued_counts), dict(completed_counts))

    def finish_host_import(self, request_id: str, failed: bool) -> None:
        self.coordinator.finish_host_import(request_id, failed=failed)

    def complete_host_import(self, request_id: str, num_computed_tokens: int) -> None:
        """The connector's completion of an import, called directly (what ``finish_host_import``
        calls with the tokens recorded): its pages become clean and its last page is restored."""
        self.coordinator.complete_host_import(request_id, num_computed_tokens)

    def plan_prefix_materialization(self, request_id: str, num_computed_tokens: int) -> None:
        """Plan the write-back of the request's sealed pages up to ``num_computed_tokens`` (what
        ``advance_scheduled`` calls, there less the re-prefillable tail)."""
        self.coordinator.plan_prefix_materialization(request_id, num_computed_tokens)

    def take_host_block_copies(self) -> list[tuple[int, int]]:
        """The host copy-on-write work drained for the worker, as ``(src, dst)`` block ids."""
        return [(c.src_block_id, c.dst_block_id) if hasattr(c, "src_block_id") else tuple(c)
                for c in self.coordinator.take_host_block_copies()]

    def release_completed_host_copies(self, dst_block_ids: list[int]) -> None:
        self.coordinator.release_completed_host_copies(list(dst_block_ids))

    def take_residency_updates(self, request_ids: list[str]) -> dict[str, tuple]:
        return {rid: (list(u.pages), [list(ids) for ids in u.block_ids])
                for rid, u in self.coordinator.take_residency_updates(list(request_ids)).items()}

    def build_row_mirrors(self, requests: list[tuple[str, int, int]]) -> list[tuple]:
        return [(tuple(m.source_starts), m.destination_start, m.num_rows)
                for m in self.coordinator.build_row_mirrors(list(requests))]

    def all_context_pages_resident(self, requests: list[tuple[str, int, int]]) -> bool:
        return self.coordinator.all_context_pages_resident(list(requests))

    def observe_pools(self, gpu_free_queue: list[int], host_free_queue: list[int]) -> dict[str, Any]:
        """Everything both sides can observe: every table (resident groups as residency rows), both
        pools' free counts and queues, the hot managers' state and the coordinator's: per-request
        page states, transfers planned and in flight, unpinned blocks' readers, imports."""
        kinds = self.config.group_kinds
        tables = []
        for kind, m in zip(kinds, self.managers):
            tables.append({rid: [b.block_id for b in (m.get_residency_row(rid) if kind == "resident" else blocks)]
                           for rid, blocks in m.req_to_blocks.items()})
        hot = [m for kind, m in zip(kinds, self.managers) if kind == "hot"]
        coord = self.coordinator
        gpu_pool = self.managers[1].block_pool
        return dict(
            tables=tables,
            gpu_free=gpu_pool.get_num_free_blocks(),
            host_free=coord.get_host_block_pool().get_num_free_blocks(),
            gpu_free_queue=gpu_free_queue,
            host_free_queue=host_free_queue,
            hot_required=[sorted(m.hot_required) for m in hot],
            has_hot=[sorted(rid for rid in m.req_to_blocks if m.has_hot(rid)) for m in hot],
            request_states={rid: _observe_request_state(s) for rid, s in sorted(coord.request_states.items())},
            pending_spills={i: _observe_spill(p) for i, p in sorted(coord.pending_spills.items())},
            spills_to_send=[t.transfer_id for t in coord.spills_to_send],
            next_spill_id=coord.next_spill_id,
            owners={bid: sorted(o) for bid, o in sorted(coord._owners.items())},
            watched_blocks=list(gpu_pool._reuse_watchers),
            pending_imports=dict(sorted(coord._pending_imports.items())),
            resident_requests=sorted(coord._resident_requests),
            pending_work=(coord.has_pending_work(), coord.has_pending_reclamation()),
            # prefix caching: the published blocks of each pool, the GPU copies of published host
            # pages and the host copies the worker has not reported run
            cached=[sorted(b.block_id for b in pool.blocks if b.block_hash is not None)
                    for pool in (gpu_pool, self.managers[0].block_pool)],
            copies=sorted(tuple(b.block_id for b in blocks) for blocks in coord.copies.values()),
            copy_by_block=sorted(coord._copy_by_block),
            retained_copies=sorted(coord._retained_copies),
        )


class HiSparseWholeManagerCalls:
    """Mixin: a HiSparse pool driven through its whole ``KVCacheManager`` (``get_computed_blocks``
    -> ``allocate_slots`` -> ``free``), the calls written once for vLLM's manager
    (:class:`kvref.impl.vllm.hisparse_kv_manager.VllmHiSparseKVCacheManager`) and the reference's
    (``kvref.models.conformance.hisparse_kv_manager.ReferenceHiSparseKVCacheManager``; #26: the
    duplicates tool's D17). Needs ``self._mgr`` (the manager), ``self.requests`` and
    ``self._request(request_id, prompt)`` (the pool's), ``self._whole_hits`` (a dict) and
    ``self._status(name)``, the side's own request status of a name."""

    _mgr: Any
    requests: dict[str, Any]
    _whole_hits: dict[str, Any]
    #: the side's request status for ``"WAITING"``, ``"RUNNING"`` and ``"FINISHED"``
    _status: Any

    def manager_hit(self, request_id: str, prompt: list[int],
                    report_mode: str = "incremental") -> tuple[int, list[list[int]]]:
        """``get_computed_blocks`` for a new request: (hit tokens, block ids per group). With KV
        cache events on and ``report_mode="full"`` (``kv_cache_report_mode``) the manager also
        announces the hit's blocks in ``BlockStored`` events, the host source's as medium CPU."""
        if request_id in self.requests:
            raise InvalidFieldError("request_id", request_id, "a request not admitted yet")
        if report_mode not in ("incremental", "full"):
            raise InvalidFieldError("report_mode", report_mode, "'incremental' or 'full'")
        req = self._request(request_id, prompt, report_mode)
        req.status = self._status("WAITING")
        blocks, num_hit, _ = self._mgr.get_computed_blocks(req)
        self._whole_hits[request_id] = (blocks, num_hit)
        return num_hit, [list(ids) for ids in blocks.get_block_ids()]

    def manager_allocate(self, request_id: str, num_new_tokens: int) -> list[list[int]] | None:
        """``allocate_slots`` with the hit found at admission (none when running): the new block
        ids per group, or None when the manager refuses."""
        check_int("num_new_tokens", num_new_tokens, minimum=1)
        req = self.requests.get(request_id)
        if req is None:
            raise InvalidFieldError("request_id", request_id, "a request asked for its hit first")
        blocks, num_hit = self._whole_hits.get(request_id, (None, 0))
        got = self._mgr.allocate_slots(req, num_new_tokens, num_hit, blocks)
        if got is None:
            return None
        self._whole_hits.pop(request_id, None)
        req.status = self._status("RUNNING")
        return [list(ids) for ids in got.get_block_ids()]

    def manager_computed(self, request_id: str, num_tokens: int) -> None:
        """The step ran: the request has ``num_tokens`` computed (``allocate_slots`` cached them)."""
        self.requests[request_id].num_computed_tokens = num_tokens

    def manager_free(self, request_id: str) -> None:
        req = self.requests.pop(request_id)
        self._whole_hits.pop(request_id, None)
        req.status = self._status("FINISHED")
        self._mgr.free(req)


def _observe_request_state(state: Any) -> dict[str, Any]:
    """A coordinator's per-request state (vLLM's ``_HiSparseRequestState`` or the reference's
    ``HiSparseRequestState``: the same field names) as plain values."""
    return dict(valid=sorted(state.valid_pages), ready=state.ready_prefix_pages,
                pending=dict(sorted(state.pending_pages.items())), pinned_clean=sorted(state.pinned_clean),
                unpinned=sorted(state.unpinned_pages), to_adopt=state.pages_to_adopt,
                copies_recorded=state.copies_recorded_blocks, synced=state.synced_pages,
                stale=sorted(state.stale_pages), publishing=_observe_publication(state.publication))


def _observe_publication(pub: Any) -> tuple | None:
    """A pending publication (vLLM's ``_PendingPublication`` or the reference's) as plain values."""
    if pub is None:
        return None
    return (pub.request.request_id, pub.num_computed_tokens, pub.num_pages, pub.retention_interval,
            tuple(pub.replay_boundaries), None if pub.detached_blocks is None
            else [b.block_id for b in pub.detached_blocks], pub.num_cached_blocks)


def _observe_spill(pending: Any) -> tuple:
    return (pending.page, pending.host_block.block_id, tuple(b.block_id for b in pending.resident_blocks),
            pending.restore, pending.expected_worker_completions, pending.worker_completions,
            pending.enqueue_applied, _observe_publication(pending.request_state.publication))
