"""M16, the reference-count rule of a HiSparse pool (docs/invariants.md; issue #23).

Shared by :class:`~.hisparse_pool.HiSparsePool` (the conformance pool) and the reference
``KVCacheManager`` when it builds a HiSparse pool (``PoolConfig.group_roles`` /
``hisparse_host_num_blocks``): there the plain I9 rule (reference count = table slots) does not
hold, because the coordinator releases clean resident pages while still read and pins blocks for
transfers in flight.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .hisparse_coordinator import HiSparseCoordinator
from .hisparse_resident_manager import HiSparseResidentManager
from .hisparse_source_manager import HiSparseSourceManager
from .kv_cache_block import KVCacheBlock
from .single_type_manager import SingleTypeKVCacheManager


def check_hisparse_ref_counts(managers: Sequence[SingleTypeKVCacheManager], coord: HiSparseCoordinator) -> None:
    """M16: every block's reference count equals its readers that pin it: the tables reading it
    (resident groups: residency rows without their unpinned pages), copy-on-write pairs not yet
    run (both endpoints), the transfers in flight (a GPU block until every worker enqueued it, a
    host block until it completed) and a finished request's host blocks kept for its last
    publication. Host-source blocks are counted in the host pool, the rest in the GPU pool."""
    held: dict[int, int] = {}
    host_held: dict[int, int] = {}

    def hold(counts: dict[int, int], blocks: Iterable[KVCacheBlock]) -> None:
        for b in blocks:
            if not b.is_null:
                counts[b.block_id] = counts.get(b.block_id, 0) + 1

    gpu_pool = coord.gpu_pool
    for m in managers:
        counts = host_held if isinstance(m, HiSparseSourceManager) else held
        if gpu_pool is None and counts is held:
            gpu_pool = m.block_pool
        for rid, table in m.req_to_blocks.items():
            if isinstance(m, HiSparseResidentManager):
                state = coord.request_states.get(rid)
                unpinned = state.unpinned_pages if state is not None else set()
                table = [b for i, b in enumerate(m.get_residency_row(rid)) if i not in unpinned]
            hold(counts, table)
        for src, dst in m._pending_cow_copies:  # both endpoints retained until the worker copied
            hold(counts, (src, dst))
    for src, dst in coord._retained_copies.values():  # host copies handed to the worker
        hold(host_held, (src, dst))
    for pending in coord.pending_spills.values():
        if not pending.enqueue_applied:
            hold(held, pending.resident_blocks)
        hold(host_held, [pending.host_block])
    for state in {id(p.request_state): p.request_state for p in coord.pending_spills.values()}.values():
        if state.publication is not None and state.publication.detached_blocks is not None:
            hold(host_held, state.publication.detached_blocks)
    pools = [(coord.host_manager.block_pool, host_held)] + ([(gpu_pool, held)] if gpu_pool is not None else [])
    for pool, counts in pools:
        for b in pool.blocks:
            if not b.is_null:
                assert b.ref_cnt == counts.get(b.block_id, 0), \
                    f"M16: block {b.block_id} has ref_cnt {b.ref_cnt} but {counts.get(b.block_id, 0)} readers pin it"
