"""vLLM's own ``FreeKVCacheBlockQueue`` behind block ids, for the free-queue conformance (issue #22).

vLLM's block pool only ever appends/prepends lists and pops from the front, so whole methods of its
queue (``append``, ``popleft`` on an empty queue, ``iter_blocks_after`` — the lazy CPU-offload scan's
walk) never run under the KV-manager conformance. This adapter builds the queue over vLLM's
``KVCacheBlock`` objects and speaks block ids, so generated op sequences can drive it beside the
reference's queue (:mod:`kvref.models.machines.free_queue_programs`). It adds no behaviour.
"""

from __future__ import annotations

from kvref.impl.vllm.loader import load_vllm
from kvref.spec.errors import check_int


class VllmFreeBlockQueue:
    """vLLM's queue over blocks ``0..num_blocks-1``, all free at the start, in id order."""

    def __init__(self, num_blocks: int) -> None:
        check_int("num_blocks", num_blocks, minimum=0)
        load_vllm()
        from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.queue = FreeKVCacheBlockQueue(list(self.blocks))

    @property
    def num_free_blocks(self) -> int:
        return self.queue.num_free_blocks

    def popleft(self) -> int:
        """The front block's id; vLLM raises ``ValueError`` on an empty queue."""
        return self.queue.popleft().block_id

    def popleft_n(self, n: int) -> list[int]:
        return [b.block_id for b in self.queue.popleft_n(n)]

    def remove(self, block_id: int) -> None:
        self.queue.remove(self.blocks[block_id])

    def append(self, block_id: int) -> None:
        self.queue.append(self.blocks[block_id])

    def append_n(self, block_ids: list[int]) -> None:
        self.queue.append_n([self.blocks[i] for i in block_ids])

    def prepend_n(self, block_ids: list[int]) -> None:
        self.queue.prepend_n([self.blocks[i] for i in block_ids])

    def free_block_ids(self) -> list[int]:
        """Front to back (``get_all_free_blocks``)."""
        return [b.block_id for b in self.queue.get_all_free_blocks()]

    def ids_after(self, cursor: int | None) -> list[int]:
        """``iter_blocks_after`` from a free block (or the front when None)."""
        return [b.block_id for b in self.queue.iter_blocks_after(None if cursor is None else self.blocks[cursor])]
