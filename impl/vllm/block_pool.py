"""vLLM's own ``BlockPool`` behind the block-id interface of :mod:`kvref.impl.block_pool_driver`."""

from __future__ import annotations

from types import SimpleNamespace

from kvref.impl.block_pool_driver import GROUP_ID, ReferenceBlockPoolDriver


class VllmBlockPoolDriver(ReferenceBlockPoolDriver):
    """The installed vLLM's BlockPool with the same calls (its ``cache_full_blocks`` takes a request)."""

    name = "vllm"

    def __init__(self, num_blocks: int, hash_block_size: int) -> None:  # noqa: D107
        from vllm.v1.core.block_pool import BlockPool

        self.pool = BlockPool(num_blocks, True, hash_block_size)

    def cache(self, hashes, ids, start, end, block_size):  # noqa: D102
        self.pool.cache_full_blocks(SimpleNamespace(block_hashes=hashes), self.blocks(ids), start, end,
                                    block_size, GROUP_ID)

    def free_queue(self) -> list[int]:
        return [b.block_id for b in self.pool.free_block_queue.get_all_free_blocks()]

    def check_invariants(self) -> None:
        """I1-I6 on vLLM's ``BlockPool`` itself, links of the free queue included
        (:func:`kvref.impl.vllm.invariants.check_block_pool`)."""
        from kvref.impl.vllm.invariants import check_block_pool

        check_block_pool(self.pool)
