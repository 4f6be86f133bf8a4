"""A free block queue behind block ids (issue #22's free-queue conformance).

vLLM's ``FreeKVCacheBlockQueue`` and the reference's have the same API over block objects; the
generated programs (:mod:`kvref.models.machines.free_queue_programs`) speak block ids. One view
maps ids to the blocks of either queue, so both sides are driven by exactly the same calls; it adds
no behaviour.
"""

from __future__ import annotations

from typing import Any


class FreeBlockQueueView:
    """``queue`` over ``blocks`` (block ``i`` has id ``i``), spoken to in block ids."""

    def __init__(self, blocks: list[Any], queue: Any) -> None:
        self.blocks = blocks
        self.queue = queue

    @property
    def num_free_blocks(self) -> int:
        return self.queue.num_free_blocks

    def popleft(self) -> int:
        """The front block's id; both queues raise ``ValueError`` on an empty queue."""
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
