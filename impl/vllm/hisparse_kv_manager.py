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

from kvref.impl.hisparse_calls import HiSparseWholeManagerCalls
from kvref.impl.vllm.hisparse import VllmHiSparsePool


class VllmHiSparseKVCacheManager(HiSparseWholeManagerCalls, VllmHiSparsePool):
    """The pool of :class:`VllmHiSparsePool`, driven through its ``KVCacheManager`` (the calls:
    :class:`~kvref.impl.hisparse_calls.HiSparseWholeManagerCalls`)."""

    def __init__(self, config: Any, enable_kv_cache_events: bool = False) -> None:
        super().__init__(config, enable_kv_cache_events=enable_kv_cache_events)
        self._whole_hits: dict[str, Any] = {}

    def take_kv_events(self) -> list[dict[str, Any]]:
        """vLLM's ``KVCacheManager.take_events()`` as plain dicts (:mod:`kvref.impl.vllm.kv_events`):
        the device pool's queue, which the host pool (``SharedEventQueueBlockPool``, medium CPU)
        shares; [] with events off."""
        from kvref.impl.vllm.kv_events import vllm_event_to_plain

        return [vllm_event_to_plain(e) for e in self._mgr.take_events()]

    def _status(self, name: str) -> Any:
        statuses = self._v["VStatus"]
        return statuses.FINISHED_STOPPED if name == "FINISHED" else getattr(statuses, name)
