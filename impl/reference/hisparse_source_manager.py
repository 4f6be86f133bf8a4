"""HiSparse host source (vLLM ``HiSparseSourceManager``, ``v1/core/single_type_kv_cache_manager.py``).

A full-attention group whose blocks live in a private *host* pool (``bind_host_pool`` replaces the
device pool it was built with): every page of a request gets a host block, so each GPU-resident
page can be written back and its GPU block later reclaimed. Host blocks never count against the
GPU pool; when the host pool cannot back a request's pages the admission count is a sentinel no
GPU pool can meet (:func:`kvref.spec.hisparse.source_admission_count`), so the allocation is refused.

Publication is deferred: ``cache_blocks`` hands the request to the HiSparse coordinator
(:class:`~.hisparse_coordinator.HiSparseCoordinator`), which publishes a page's hash only once its
host copy is durable (``publish_blocks``), so a request gets no prefix hit from pages still being
written back. External imports are noted with the coordinator too: only a completed receive makes
them readable. Host copy-on-write pairs go to the coordinator (``take_host_cow_copies``), never to
the generic block-copy path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from kvref.impl.request import Request
from kvref.spec.errors import check_int
from kvref.spec.hisparse import source_admission_count

from .block_hash import BlockHash
from .hisparse_block_pool import SharedEventQueueBlockPool
from .full_attention_manager import FullAttentionManager
from .kv_cache_block import KVCacheBlock
from .kv_events import MEDIUM_CPU


class HiSparseSourceManager(FullAttentionManager):
    #: the host tier keeps prefixes the device groups have already lost (no hit truncation)
    retains_longer_hit: ClassVar[bool] = True

    #: the HiSparse coordinator, set when it binds the host pool
    coordinator = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        #: GPU pool size, for the admission sentinel (set by ``bind_host_pool``)
        self.num_gpu_blocks: int | None = None

    def bind_host_pool(self, num_blocks: int, num_gpu_blocks: int) -> None:
        """Replace the device pool by a private host pool of ``num_blocks`` blocks."""
        check_int("hisparse_host_num_blocks", num_blocks, minimum=1)
        check_int("num_gpu_blocks", num_gpu_blocks, minimum=1)
        assert not self.req_to_blocks, "bind the host pool before the first request"
        device_pool = self.block_pool
        # host events (medium CPU) go into the device pool's queue (vLLM SharedEventQueueBlockPool)
        self.block_pool = SharedEventQueueBlockPool(
            num_blocks, enable_caching=self.enable_caching, hash_block_size=device_pool.hash_block_size,
            enable_kv_cache_events=device_pool.enable_kv_cache_events, medium=MEDIUM_CPU, event_owner=device_pool)
        self._null_block = self.block_pool.null_block
        self.num_gpu_blocks = num_gpu_blocks

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock],
                                   total_computed_tokens: int, num_local_computed_tokens: int,
                                   num_tokens_main_model: int, apply_admission_cap: bool = False,
                                   prefill_end: int = 0) -> int:
        assert self.num_gpu_blocks is not None, "bind_host_pool first"
        required = super().get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks,
                                                      total_computed_tokens, num_local_computed_tokens,
                                                      num_tokens_main_model)
        return source_admission_count(required, self.block_pool.get_num_free_blocks(), self.num_gpu_blocks)

    @property
    def records_new_block_ids(self) -> bool:
        """Host blocks are never zeroed by the worker (vLLM: the source records none)."""
        return False

    def take_new_block_ids(self) -> list[int]:
        self.new_block_ids = []
        return []

    def take_pending_cow_copies(self) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        """Host copies never reach the worker's generic block-copy path."""
        return []

    def take_host_cow_copies(self) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        """Drain the host copy-on-write pairs for the coordinator."""
        copies, self._pending_cow_copies = self._pending_cow_copies, []
        return copies

    def allocate_external_computed_blocks(self, request_id: str, num_local_computed_tokens: int,
                                          num_external_computed_tokens: int, record_for_zeroing: bool = True) -> None:
        if num_external_computed_tokens <= 0:
            return
        # the connector writes these pages; only a successful receive makes them readable
        self.coordinator.record_pending_host_import(request_id, num_local_computed_tokens + num_external_computed_tokens)
        super().allocate_external_computed_blocks(request_id, num_local_computed_tokens,
                                                  num_external_computed_tokens, record_for_zeroing)

    def cache_blocks(self, request: Request, block_hashes: Sequence[BlockHash], num_tokens: int,
                     retention_interval: int | None = None, replay_boundaries: Sequence[int] = ()) -> None:
        """Publish only once durable: the coordinator calls ``publish_blocks`` as write-backs complete."""
        self.coordinator.publish_when_ready(request, block_hashes, num_tokens, retention_interval,
                                            replay_boundaries=replay_boundaries)

    def publish_blocks(self, request: Request, block_hashes: Sequence[BlockHash], num_tokens: int,
                       retention_interval: int | None = None, replay_boundaries: Sequence[int] = ()) -> None:
        super().cache_blocks(request, block_hashes, num_tokens, retention_interval, replay_boundaries)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        self.coordinator.free(request_id)
        return super().pop_blocks_for_free(request_id)
