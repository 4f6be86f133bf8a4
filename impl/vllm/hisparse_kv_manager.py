"""vLLM 0.33.0's whole ``KVCacheManager`` over a HiSparse pool (issue #22/#23).

:class:`~kvref.impl.vllm.hisparse.VllmHiSparsePool` calls vLLM's managers one by one; this adapter
goes through ``KVCacheManager.get_computed_blocks`` and ``allocate_slots`` instead, where vLLM
trims the host source's longer hit to what the request reuses (``retained_hit_group_ids``: the
source ``retains_longer_hit``) and the hybrid coordinator lets the source keep it
(``HybridKVCacheCoordinator.find_longest_cache_hit``). Answers are plain block ids and counts;
:class:`kvref.models.conformance.hisparse_kv_manager.ReferenceHiSparseKVCacheManager` gives the
reference's over the same pool.
"""

from __future__ import annotations

from typing import Any

from kvref.impl.vllm.hisparse import VllmHiSparsePool
from kvref.spec.errors import InvalidFieldError, check_int


class VllmHiSparseKVCacheManager(VllmHiSparsePool):
    """The pool of :class:`VllmHiSparsePool`, driven through its ``KVCacheManager``."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self._whole_hits: dict[str, Any] = {}

    def manager_hit(self, request_id: str, prompt: list[int]) -> tuple[int, list[list[int]]]:
        """``get_computed_blocks`` for a new request: (hit tokens, block ids per group)."""
        if request_id in self.requests:
            raise InvalidFieldError("request_id", request_id, "a request not admitted yet")
        req = self._request(request_id, prompt)
        req.status = self._v["VStatus"].WAITING
        blocks, num_hit, _ = self._mgr.get_computed_blocks(req)
        self._whole_hits[request_id] = (blocks, num_hit)
        return num_hit, [list(ids) for ids in blocks.get_block_ids()]

    def manager_allocate(self, request_id: str, num_new_tokens: int) -> list[list[int]] | None:
        """``allocate_slots`` with the hit found at admission (none when running): the new block
        ids per group, or None when vLLM refuses."""
        check_int("num_new_tokens", num_new_tokens, minimum=1)
        req = self.requests.get(request_id)
        if req is None:
            raise InvalidFieldError("request_id", request_id, "a request asked for its hit first")
        blocks, num_hit = self._whole_hits.get(request_id, (None, 0))
        got = self._mgr.allocate_slots(req, num_new_tokens, num_hit, blocks)
        if got is None:
            return None
        self._whole_hits.pop(request_id, None)
        req.status = self._v["VStatus"].RUNNING
        return [list(ids) for ids in got.get_block_ids()]

    def manager_computed(self, request_id: str, num_tokens: int) -> None:
        """The step ran: the request has ``num_tokens`` computed (``allocate_slots`` cached them)."""
        self.requests[request_id].num_computed_tokens = num_tokens

    def manager_free(self, request_id: str) -> None:
        req = self.requests.pop(request_id)
        self._whole_hits.pop(request_id, None)
        req.status = self._v["VStatus"].FINISHED_STOPPED
        self._mgr.free(req)
