"""HiSparse host publication and GPU copies (vLLM 0.33.0 ``HiSparseCoordinator``, the publication and
copy halves of ``v1/hisparse/coordinator.py``; issue #23).

* **Publication.** The host source group owns prefix caching, but a host page's hash is published
  only once its host copy is durable: ``cache_blocks`` on the source records a pending publication,
  and the durable prefix of it (``ready_prefix_pages``) is published whenever write-backs complete.
  (Host writes trail a long prefill by about a chunk; waiting for the whole prefix would publish
  nothing until the prefill ends, and a prefill preempted before then would recompute from the
  start.) A finished request whose last write-backs are still in flight keeps (touches) its sealed
  host blocks and publishes them when the last one completes; a preempted one drops its
  publication, since its planned copies no longer prove the KV was computed.
* **GPU copies.** Each published host block remembers the GPU blocks that held the page; a later
  prefix hit on that host block reads those blocks again (``_adopt_copies``, after the admitting
  allocation) until the pool reuses them.
* **Host copy-on-write.** Copies of host blocks a hit must not share are drained for the worker
  with both endpoints held until it reports them run.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .block_hash import BlockHashWithGroupId
from .block_pool import BlockPoolCore
from .hisparse_state import HiSparseRequestState, KVCacheBlockCopy, PendingPublication
from .kv_cache_block import KVCacheBlock


class HiSparsePublication:
    """Mixin of :class:`~.hisparse_coordinator.HiSparseCoordinator` (needs its managers and states)."""

    def _init_publication(self) -> None:
        #: published host block hash -> the GPU copies of that page, readable until reused
        self.copies: dict[BlockHashWithGroupId, tuple[KVCacheBlock, ...]] = {}
        self._copy_by_block: dict[int, BlockHashWithGroupId] = {}
        #: host copy-on-write destination block id -> (source, destination), until the worker ran it
        self._retained_copies: dict[int, tuple[KVCacheBlock, KVCacheBlock]] = {}

    # ------------------------------------------------------------------ publication

    def publish_when_ready(self, request, block_hashes, num_computed_tokens: int, retention_interval: int | None,
                           *, replay_boundaries: Sequence[int] = ()) -> None:
        """The source group's ``cache_blocks``: publish what is durable now, the rest as it becomes so."""
        self._get_request_state(request.request_id).publication = PendingPublication(
            request=request, block_hashes=block_hashes, num_computed_tokens=num_computed_tokens,
            num_pages=num_computed_tokens // self.host_manager.block_size, retention_interval=retention_interval,
            replay_boundaries=tuple(replay_boundaries))
        self._publish_host_blocks_if_ready(request.request_id)

    def _publish_host_blocks_if_ready(self, request_id: str) -> None:
        state = self.request_states.get(request_id)
        if state is None or state.publication is None:
            return
        pub = state.publication
        num_tokens = min(pub.num_computed_tokens, state.ready_prefix_pages * self.host_manager.block_size)
        self.host_manager.publish_blocks(pub.request, pub.block_hashes, num_tokens,
                                         retention_interval=pub.retention_interval,
                                         replay_boundaries=pub.replay_boundaries)
        self._record_copies(request_id, num_tokens)
        if state.ready_prefix_pages >= pub.num_pages:
            state.publication = None

    def _detach_publication(self, request_id: str, state: HiSparseRequestState) -> None:
        """On free: a finished request with write-backs in flight keeps its sealed host blocks for
        the publication its last completion makes; any other drops the publication."""
        pub = state.publication
        if pub is not None and pub.request.is_finished and state.pending_pages:  # kvref Request: a property
            pub.detached_blocks = self.host_manager.req_to_blocks[request_id][:pub.num_pages]
            pub.num_cached_blocks = self.host_manager.num_cached_block.get(request_id, 0)
            # completed pages need leases too: an allocation may evict them before the rest finish
            BlockPoolCore.touch(self.host_manager.block_pool, pub.detached_blocks)
        else:
            state.publication = None

    def _publish_detached_blocks(self, state: HiSparseRequestState) -> None:
        pub = state.publication
        if pub is None or state.pending_pages or pub.detached_blocks is None:
            return
        while state.ready_prefix_pages in state.valid_pages:
            state.ready_prefix_pages += 1
        host = self.host_manager
        # only sealed pages with completed copies outlive the request, cancellation included
        host.block_pool.cache_full_blocks(pub.block_hashes, pub.detached_blocks,
                                          pub.num_cached_blocks, min(state.ready_prefix_pages, pub.num_pages),
                                          host.block_size, host.kv_cache_group_id, request=pub.request)
        BlockPoolCore.free_blocks(host.block_pool, pub.detached_blocks[::-1])
        state.publication = None

    # ------------------------------------------------------------------ GPU copies

    def _adopt_copies(self, request_id: str, state: HiSparseRequestState,
                      host_blocks: Sequence[KVCacheBlock]) -> None:
        """Point host-only prefix pages at readable GPU copies of their contents (pinned again)."""
        if not self.copies:
            return
        for host_idx, host_block in enumerate(host_blocks):
            if host_block.is_null or host_block.block_hash is None:
                continue
            blocks = self.copies.get(host_block.block_hash)
            if blocks is None:
                continue
            for m, block in zip(self.resident_managers, blocks):
                if m.adopt_resident_page(request_id, host_idx, block):
                    BlockPoolCore.touch(m.block_pool, [block])
                    state.pinned_clean.add(host_idx)
                    if host_idx < state.synced_pages:
                        state.stale_pages.add(host_idx)

    def _record_copies(self, request_id: str, num_computed_tokens: int) -> None:
        if not self.resident_managers:
            return
        host_blocks = self.host_manager.req_to_blocks.get(request_id)
        if not host_blocks:
            return
        state = self._get_request_state(request_id)
        num_host_blocks = min(num_computed_tokens // self.host_manager.block_size, len(host_blocks))
        for host_idx in range(state.copies_recorded_blocks, num_host_blocks):
            if host_idx not in state.pending_pages:
                self._record_copy(request_id, host_idx, host_blocks[host_idx])
        state.copies_recorded_blocks = max(state.copies_recorded_blocks, num_host_blocks)

    def _record_copy(self, request_id: str, page_idx: int, host_block: KVCacheBlock) -> None:
        if host_block.is_null or host_block.block_hash is None:
            return
        blocks = []
        for m in self.resident_managers:
            block = m.get_resident_page(request_id, page_idx)
            if block is None:
                return
            blocks.append(block)
        self._drop_copy(host_block.block_hash)
        self.copies[host_block.block_hash] = tuple(blocks)
        for block in blocks:
            self._copy_by_block[block.block_id] = host_block.block_hash

    def _drop_copy(self, host_hash: BlockHashWithGroupId) -> None:
        for block in self.copies.pop(host_hash, ()):
            self._copy_by_block.pop(block.block_id, None)

    def _forget_copy_of(self, block: KVCacheBlock) -> None:
        """The pool reused ``block``: the copy it held is gone."""
        host_hash = self._copy_by_block.get(block.block_id)
        if host_hash is not None:
            self._drop_copy(host_hash)

    # ------------------------------------------------------------------ host copy-on-write

    def take_host_block_copies(self) -> tuple[KVCacheBlockCopy, ...]:
        """Drain the host source's copy-on-write pairs for the worker, keeping both endpoints
        referenced until ``release_completed_host_copies``."""
        pairs = self.host_manager.take_host_cow_copies()
        for src, dst in pairs:
            self._retained_copies[dst.block_id] = (src, dst)
        return tuple(KVCacheBlockCopy(src.block_id, dst.block_id) for src, dst in pairs)

    def release_completed_host_copies(self, dst_block_ids: Iterable[int]) -> None:
        blocks: list[KVCacheBlock] = []
        for dst in dst_block_ids:
            pair = self._retained_copies.pop(dst, None)
            if pair is not None:
                blocks.extend(pair)
        if blocks:
            BlockPoolCore.free_blocks(self.host_manager.block_pool, blocks[::-1])

    def get_host_block_pool(self):
        return self.host_manager.block_pool

    def _check_publication_invariants(self) -> None:
        """M18 (copies): every block the reverse index names is a copy of the hash it names.
        M19 (publication): no published host block is the destination of a write-back still in
        flight (a page's hash is published only once its host copy is durable; a restore reads a
        durable page); a live request's pending publication covers at most its host table; a
        detached publication (a finished request's) exists only while its write-backs are in
        flight, and every copy-on-write pair held for the worker has both endpoints referenced."""
        for bid, host_hash in self._copy_by_block.items():
            assert any(b.block_id == bid for b in self.copies.get(host_hash, ())), \
                f"M18: block {bid} is indexed as a copy of a hash that does not list it"
        for pending in self.pending_spills.values():
            assert pending.restore or pending.host_block.block_hash is None, \
                f"M19: host block {pending.host_block.block_id} is published while its write-back is in flight"
            pub = pending.request_state.publication
            if pub is not None and pub.detached_blocks is not None:
                assert pending.request_state.pending_pages, "M19: a detached publication with nothing in flight"
        for rid, state in self.request_states.items():
            pub = state.publication
            if pub is not None:
                assert pub.detached_blocks is None, f"M19: live request {rid} has a detached publication"
                assert pub.num_pages <= len(self.host_manager.req_to_blocks.get(rid, ())), \
                    f"M19: request {rid}'s publication covers {pub.num_pages} pages beyond its host table"
        for dst, (src, cow) in self._retained_copies.items():
            assert cow.block_id == dst and src.ref_cnt > 0 and cow.ref_cnt > 0, \
                f"M19: host copy into {dst} lost a referenced endpoint before the worker ran it"
