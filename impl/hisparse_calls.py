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


class HiSparseManagerCalls:
    """Mixin: needs ``self.managers``, the pool's single-type managers in KV cache group order."""

    managers: tuple[Any, ...]

    def is_running(self, request_id: str) -> bool:
        return any(request_id in m.num_cached_block for m in self.managers)

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, total_computed_tokens: int,
                                   num_local_computed_tokens: int, apply_admission_cap: bool) -> list[int]:
        return [m.get_num_blocks_to_allocate(request_id, num_tokens, [], total_computed_tokens,
                                             num_local_computed_tokens, num_tokens,
                                             apply_admission_cap=apply_admission_cap)
                for m in self.managers]

    def allocate(self, request_id: str, num_tokens: int, num_local_computed_tokens: int,
                 num_external_computed_tokens: int) -> list[list[int]]:
        """``allocate_new_computed_blocks`` (a new request with a host hit or an import) then
        ``allocate_new_blocks``; the new block ids of each group."""
        if not self.is_running(request_id) and (num_local_computed_tokens or num_external_computed_tokens):
            for m in self.managers:
                m.add_local_computed_blocks(request_id, [], num_local_computed_tokens, num_external_computed_tokens)
            if num_external_computed_tokens:
                for m in self.managers:
                    m.allocate_external_computed_blocks(request_id, num_local_computed_tokens,
                                                        num_external_computed_tokens)
        return [[b.block_id for b in m.allocate_new_blocks(request_id, num_tokens, num_tokens)]
                for m in self.managers]

    # ---------------------------------------------------------------- the HiSparse coordinator
    # What vLLM's scheduler and HiSparse connector call on ``HiSparseCoordinator`` (both pools hold
    # one as ``self.coordinator``, with vLLM's method names); answers in plain values.

    def update_residency(self, request_id: str) -> None:
        self.coordinator.update_residency(request_id)

    def advance_scheduled(self, requests: list[tuple[str, int]]) -> None:
        self.coordinator.advance_scheduled(list(requests))

    def build_offload_command(self) -> list[tuple]:
        """The page transfers planned since the last command: (id, host block, resident blocks,
        after_forward, restore)."""
        command = self.coordinator.build_offload_command()
        return [(t.transfer_id, t.host_block_id, tuple(t.resident_block_ids), t.after_forward, t.restore)
                for t in command.page_transfers]

    def update_spills(self, enqueued_counts: dict[int, int], completed_counts: dict[int, int]) -> None:
        self.coordinator.update_spills(dict(enqueued_counts), dict(completed_counts))

    def finish_host_import(self, request_id: str, failed: bool) -> None:
        self.coordinator.finish_host_import(request_id, failed=failed)

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
            host_free=self.managers[0].block_pool.get_num_free_blocks(),
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
        )


def _observe_request_state(state: Any) -> dict[str, Any]:
    """A coordinator's per-request state (vLLM's ``_HiSparseRequestState`` or the reference's
    ``HiSparseRequestState``: the same field names) as plain values."""
    return dict(valid=sorted(state.valid_pages), ready=state.ready_prefix_pages,
                pending=dict(sorted(state.pending_pages.items())), pinned_clean=sorted(state.pinned_clean),
                unpinned=sorted(state.unpinned_pages), to_adopt=state.pages_to_adopt,
                copies_recorded=state.copies_recorded_blocks, synced=state.synced_pages,
                stale=sorted(state.stale_pages), publishing=state.publication is not None)


def _observe_spill(pending: Any) -> tuple:
    return (pending.page, pending.host_block.block_id, tuple(b.block_id for b in pending.resident_blocks),
            pending.restore, pending.expected_worker_completions, pending.worker_completions,
            pending.enqueue_applied)
