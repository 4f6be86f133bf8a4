"""vLLM's own ``BlockHashToBlockMap`` behind block ids, for the index conformance (issue #22).

vLLM's block pool inserts a block under its own hash and pops it with its own id, so the map's
branches for a key asked about with another block's id (``pop`` putting a lone block back,
``contain`` on a duplicate set), ``get_one_block`` on duplicates and ``__len__`` never ran under
the KV-manager conformance. This adapter builds the map over vLLM's ``KVCacheBlock`` objects and
speaks block ids, so generated op sequences drive it beside the reference's map
(:mod:`kvref.models.machines.block_index_programs`). It adds no behaviour.
"""

from __future__ import annotations

from kvref.impl.block_hash_map_view import BlockHashMapView
from kvref.impl.vllm.loader import load_vllm
from kvref.spec.errors import check_int


class VllmBlockHashToBlockMap(BlockHashMapView):
    """vLLM's empty map over blocks ``0..num_blocks-1``."""

    def __init__(self, num_blocks: int) -> None:
        check_int("num_blocks", num_blocks, minimum=1)
        load_vllm()
        from vllm.v1.core.block_pool import BlockHashToBlockMap
        from vllm.v1.core.kv_cache_utils import KVCacheBlock

        super().__init__([KVCacheBlock(block_id=i) for i in range(num_blocks)], BlockHashToBlockMap())
