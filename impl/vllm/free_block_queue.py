"""vLLM's own ``FreeKVCacheBlockQueue`` behind block ids, for the free-queue conformance (issue #22).

vLLM's block pool only ever appends/prepends lists and pops from the front, so whole methods of its
queue (``append``, ``popleft`` on an empty queue, ``iter_blocks_after`` — the lazy CPU-offload scan's
walk) never run under the KV-manager conformance. This adapter builds the queue over vLLM's
``KVCacheBlock`` objects and speaks block ids, so generated op sequences can drive it beside the
reference's queue (:mod:`kvref.models.machines.free_queue_programs`). It adds no behaviour.
"""

from __future__ import annotations

from kvref.impl.free_block_queue_view import FreeBlockQueueView
from kvref.impl.vllm.loader import load_vllm
from kvref.spec.errors import check_int


class VllmFreeBlockQueue(FreeBlockQueueView):
    """vLLM's queue over blocks ``0..num_blocks-1``, all free at the start, in id order."""

    def __init__(self, num_blocks: int) -> None:
        check_int("num_blocks", num_blocks, minimum=0)
        load_vllm()
        from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

        blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        super().__init__(blocks, FreeKVCacheBlockQueue(list(blocks)))
