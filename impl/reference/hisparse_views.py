"""What the HiSparse coordinator tells the worker each step (vLLM 0.33.0 ``HiSparseCoordinator``'s
worker-facing views, ``v1/hisparse/coordinator.py``; issue #23).

The block table stays append-only; residency reaches the worker separately:

* ``take_residency_updates``: for each scheduled request, the GPU block ids of the pages the worker
  does not hold yet (pages changed since the last update, then pages appended since), per resident
  group, the null block id for a page read from host. An unscheduled request keeps its changes.
* ``build_row_mirrors``: the row spans a step writes, mirrored from the GPU pages into their host
  blocks; a page without a GPU source or a host destination is skipped alone (a window only moves
  forward, so dropping its neighbours would leave their host rows stale for good).
* ``all_context_pages_resident``: whether every scheduled request reads only GPU-resident KV.
* ``build_offload_command``: the page transfers planned since the last command.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvref.spec.mathutil import cdiv

from .hisparse_state import SparseKVOffloadCommand, SparseKVResidencyUpdate, SparseKVRowMirror


class HiSparseWorkerViews:
    """Mixin of :class:`~.hisparse_coordinator.HiSparseCoordinator`."""

    def build_offload_command(self) -> SparseKVOffloadCommand | None:
        if not self.resident_managers:
            return None
        command = SparseKVOffloadCommand(page_transfers=self.spills_to_send)
        self.spills_to_send = []
        return command

    def take_residency_updates(self, request_ids: Iterable[str]) -> dict[str, SparseKVResidencyUpdate]:
        updates: dict[str, SparseKVResidencyUpdate] = {}
        if not self.resident_managers:
            return updates
        first = self.resident_managers[0]
        for request_id in request_ids:
            state = self._get_request_state(request_id)
            num_pages = len(first.req_to_blocks.get(request_id, ()))
            start = state.synced_pages
            if not state.stale_pages and start >= num_pages:
                continue
            stale = sorted(state.stale_pages)
            block_ids = []
            for m in self.resident_managers:
                null_id = m.block_pool.null_block.block_id
                ids = [null_id if b is None else b.block_id
                       for b in (m.get_resident_page(request_id, p) for p in stale)]
                ids.extend(b.block_id for b in m.get_residency_row(request_id, start))
                block_ids.append(ids)
            updates[request_id] = SparseKVResidencyUpdate(pages=[*stale, *range(start, num_pages)],
                                                           block_ids=tuple(block_ids))
            state.stale_pages.clear()
            state.synced_pages = num_pages
        return updates

    def build_row_mirrors(self, requests: Iterable[tuple[str, int, int]]) -> tuple[SparseKVRowMirror, ...]:
        """``requests``: ``(request id, computed tokens, scheduled tokens)`` of the step."""
        if not self.resident_managers:
            return ()
        bs = self.resident_managers[0].block_size
        mirrors = []
        for request_id, num_computed, num_scheduled in requests:
            host_blocks = self.host_manager.req_to_blocks.get(request_id)
            if host_blocks is None or any(request_id not in m.req_to_blocks for m in self.resident_managers):
                continue
            pos, end = num_computed, num_computed + num_scheduled
            while pos < end:
                page_idx, offset = divmod(pos, bs)
                num_rows = min(bs - offset, end - pos)
                pos += num_rows
                sources = [m.get_resident_page(request_id, page_idx) for m in self.resident_managers]
                if any(b is None for b in sources) or page_idx >= len(host_blocks) or host_blocks[page_idx].is_null:
                    continue
                mirrors.append(SparseKVRowMirror(tuple(b.block_id * bs + offset for b in sources),
                                                 host_blocks[page_idx].block_id * bs + offset, num_rows))
        return tuple(mirrors)

    def all_context_pages_resident(self, requests: Iterable[tuple[str, int, int]]) -> bool:
        if not self.resident_managers:
            return False
        first = self.resident_managers[0]
        for request_id, num_computed, num_scheduled in requests:
            if len(first.req_to_blocks.get(request_id, ())) < cdiv(num_computed + num_scheduled, first.block_size):
                return False
            if request_id in self._resident_requests:
                continue
            if any(b.is_null for m in self.resident_managers for b in m.get_residency_row(request_id)):
                return False
            self._resident_requests.add(request_id)
        return True
