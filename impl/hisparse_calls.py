"""The single-type-manager calls both HiSparse pools make, in the order vLLM 0.33.0's
``KVCacheManager.allocate_slots`` / ``KVCacheCoordinator`` make them (issue #23).

:class:`kvref.impl.reference.hisparse_pool.HiSparsePool` (kvref's managers) and
:class:`kvref.impl.vllm.hisparse.VllmHiSparsePool` (vLLM's) hold a ``managers`` tuple in group
order with the same method names, so the way a request is admitted and allocated is written once
here: a difference between the two pools is then a difference in the managers, never in how each
side happens to drive them (#26: the two copies were the duplicates tool's D1).
"""

from __future__ import annotations

from typing import Any


class HiSparseManagerCalls:
    """Mixin: needs ``self.managers``, the pool's single-type managers in KV cache group order."""

    managers: tuple[Any, ...]

    def is_running(self, request_id: str) -> bool:
        return any(request_id in m.num_cached_block for m in self.managers)

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, total_computed_tokens: int,
                                   num_local_computed_tokens: int, apply_admission_cap: bool) -> list[int]:
        return [m.get_num_blocks_to_allocate(request_id, num_tokens, [], total_computed_tokens,
                                             num_local_computed_tokens, num_tokens,
                                             apply_admission_cap=apply_admission_cap)
                for m in self.managers]

    def allocate(self, request_id: str, num_tokens: int, num_local_computed_tokens: int,
                 num_external_computed_tokens: int) -> list[list[int]]:
        """``allocate_new_computed_blocks`` (a new request with a host hit or an import) then
        ``allocate_new_blocks``; the new block ids of each group."""
        if not self.is_running(request_id) and (num_local_computed_tokens or num_external_computed_tokens):
            for m in self.managers:
                m.add_local_computed_blocks(request_id, [], num_local_computed_tokens, num_external_computed_tokens)
            if num_external_computed_tokens:
                for m in self.managers:
                    m.allocate_external_computed_blocks(request_id, num_local_computed_tokens,
                                                        num_external_computed_tokens)
        return [[b.block_id for b in m.allocate_new_blocks(request_id, num_tokens, num_tokens)]
                for m in self.managers]
