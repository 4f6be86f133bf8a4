"""HiSparse host source (vLLM ``HiSparseSourceManager``, ``v1/core/single_type_kv_cache_manager.py``).

A full-attention group whose blocks live in a private *host* pool (``bind_host_pool`` replaces the
device pool it was built with): every page of a request gets a host block, so each GPU-resident
page can be written back and its GPU block later reclaimed. Host blocks never count against the
GPU pool; when the host pool cannot back a request's pages the admission count is a sentinel no
GPU pool can meet (:func:`kvref.spec.hisparse.source_admission_count`), so the allocation is refused.

Publication is deferred: a page's hash is published only once its host copy is durable (vLLM's
HiSparse coordinator tracks that with worker write completions). The reference is told how many
leading pages are durable (``set_ready_prefix_pages``); until then ``cache_blocks`` publishes
nothing, so a request on a HiSparse pool gets no prefix hit from pages still being written back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from kvref.impl.request import Request
from kvref.spec.errors import check_int
from kvref.spec.hisparse import source_admission_count

from .block_hash import BlockHash
from .block_pool import BlockPool
from .full_attention_manager import FullAttentionManager
from .kv_cache_block import KVCacheBlock
from .kv_events import MEDIUM_CPU


class HiSparseSourceManager(FullAttentionManager):
    #: the host tier keeps prefixes the device groups have already lost (no hit truncation)
    retains_longer_hit: ClassVar[bool] = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        #: GPU pool size, for the admission sentinel (set by ``bind_host_pool``)
        self.num_gpu_blocks: int | None = None
        #: request -> leading pages whose host copies are durable (publishable)
        self.ready_prefix_pages: dict[str, int] = {}

    def bind_host_pool(self, num_blocks: int, num_gpu_blocks: int) -> None:
        """Replace the device pool by a private host pool of ``num_blocks`` blocks."""
        check_int("hisparse_host_num_blocks", num_blocks, minimum=1)
        check_int("num_gpu_blocks", num_gpu_blocks, minimum=1)
        assert not self.req_to_blocks, "bind the host pool before the first request"
        device_pool = self.block_pool
        self.block_pool = BlockPool(num_blocks, enable_caching=self.enable_caching,
                                    hash_block_size=device_pool.hash_block_size, medium=MEDIUM_CPU)
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

    def set_ready_prefix_pages(self, request_id: str, num_pages: int) -> None:
        check_int("num_pages", num_pages, minimum=0)
        self.ready_prefix_pages[request_id] = max(num_pages, self.ready_prefix_pages.get(request_id, 0))

    def cache_blocks(self, request: Request, block_hashes: Sequence[BlockHash], num_tokens: int,
                     retention_interval: int | None = None, replay_boundaries: Sequence[int] = ()) -> None:
        """Publish only the durable prefix of the computed tokens."""
        durable = self.ready_prefix_pages.get(request.request_id, 0) * self.block_size
        super().cache_blocks(request, block_hashes, min(num_tokens, durable), retention_interval,
                             replay_boundaries)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        self.ready_prefix_pages.pop(request_id, None)
        return super().pop_blocks_for_free(request_id)
