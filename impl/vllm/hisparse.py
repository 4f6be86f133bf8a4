"""vLLM 0.33.0's HiSparse managers, driven the way its KV-cache coordinator drives them (issue #23).

Builds vLLM's own ``KVCacheManager`` for a :class:`~kvref.spec.hisparse.HiSparsePoolConfig` (host
source group with the ``HISPARSE_SOURCE`` role, an indexer group, resident and hot groups) and binds
its ``HiSparseCoordinator`` (``get_hisparse_coordinator``: the host source moves to its private
host pool). Every operation calls vLLM's single-type managers in the order
``KVCacheManager.allocate_slots`` / ``KVCacheCoordinator.free`` do, and every observation reads
vLLM's objects; :class:`kvref.impl.reference.hisparse_pool.HiSparsePool` answers the same calls.
"""

from __future__ import annotations

from typing import Any

from kvref.impl.vllm.loader import load_vllm
from kvref.impl.vllm.specs import to_vllm_spec
from kvref.impl.vllm.vrequest import vllm_request, vllm_sampling_params
from kvref.impl.hisparse_calls import HiSparseManagerCalls
from kvref.spec.errors import InvalidFieldError
from kvref.spec.hisparse import HiSparsePoolConfig
from kvref.spec.kv_cache_interface import FullAttentionSpec


class VllmHiSparsePool(HiSparseManagerCalls):
    kind = "vllm"

    def __init__(self, config: HiSparsePoolConfig, enable_kv_cache_events: bool = False) -> None:
        """``enable_kv_cache_events``: vLLM's ``KVCacheManager`` queues KV cache events (the host
        pool's, medium CPU, in the device pool's queue: ``SharedEventQueueBlockPool``)."""
        if not isinstance(config, HiSparsePoolConfig):
            raise InvalidFieldError("config", config, "a kvref.spec.hisparse.HiSparsePoolConfig")
        if not isinstance(enable_kv_cache_events, bool):
            raise InvalidFieldError("enable_kv_cache_events", enable_kv_cache_events, "True or False")
        v = load_vllm()
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.hisparse.coordinator import get_hisparse_coordinator
        from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupRole, KVCacheGroupSpec

        self.config = config
        fa = to_vllm_spec(FullAttentionSpec(block_size=config.block_size, num_kv_heads=1, head_size=1,
                                            dtype="float32"))
        groups = [KVCacheGroupSpec(["source"], fa, role=KVCacheGroupRole.HISPARSE_SOURCE, host_resident=True),
                  KVCacheGroupSpec(["indexer"], fa, role=KVCacheGroupRole.HISPARSE_INDEXER)]
        for i in range(config.num_resident_groups):
            groups.append(KVCacheGroupSpec([f"resident_{i}"], to_vllm_spec(config.resident_spec())))
            groups.append(KVCacheGroupSpec([f"hot_{i}"], to_vllm_spec(config.hot_spec()), enable_kv_transfer=False))
        kv_config = KVCacheConfig(num_blocks=config.num_gpu_blocks, hisparse_host_num_blocks=config.host_num_blocks,
                                  kv_cache_tensors=[], kv_cache_groups=groups)
        self._mgr = KVCacheManager(kv_config, max_model_len=config.max_model_len,
                                   max_in_flight_tokens=config.max_in_flight_tokens,
                                   enable_caching=config.enable_caching, enable_kv_cache_events=enable_kv_cache_events,
                                   hash_block_size=config.block_size, scheduler_block_size=config.block_size)
        self.coordinator = get_hisparse_coordinator(self._mgr)
        self.managers: tuple[Any, ...] = tuple(self._mgr.coordinator.single_type_managers)
        self.gpu_pool = self._mgr.block_pool
        self.host_pool = self.managers[0].block_pool
        self._hits = {}
        self._v = v
        self._hasher = v["get_request_block_hasher"](config.block_size, v["sha256"]) if config.enable_caching else None
        # NONE_HASH is process-global in vLLM and another adapter may have re-seeded it: seed it for
        # sha256 as the reference does and remember it (``_request`` re-seeds if it changed since)
        v["init_none_hash"](v["sha256"])
        self._none_hash = v["utils"].NONE_HASH
        #: vLLM ``Request`` objects prefix caching hashes and publishes, by id
        self.requests: dict[str, Any] = {}

    @property
    def transition_watermark(self) -> int:
        return self.coordinator.transition_watermark

    def bound_coordinator(self) -> Any:
        """``get_hisparse_coordinator`` asked again: the coordinator memoised on the managers (a
        second one would bind the host source to a fresh host pool)."""
        from vllm.v1.hisparse.coordinator import get_hisparse_coordinator

        return get_hisparse_coordinator(self._mgr)

    def require_hot(self, request_id: str) -> None:
        for m in self.coordinator.hot_managers:
            m.require_hot(request_id)

    def adopt(self, request_id: str, page: int, donor_id: str, donor_page: int) -> list[bool]:
        """Point a host-only page of each resident group at the donor's GPU block of that group and
        pin it, as ``HiSparseCoordinator._adopt_copies`` does for a GPU copy of a host page."""
        out = []
        for m in self.coordinator.resident_managers:
            block = m.get_resident_page(donor_id, donor_page)
            ok = block is not None and m.adopt_resident_page(request_id, page, block)
            if ok:
                m.block_pool.touch([block])
            out.append(ok)
        return out

    def drop(self, request_id: str, page: int) -> list[int | None]:
        """Stop reading an adopted page from the GPU and release its pin (as the coordinator's free
        unpins a clean page, then drops it)."""
        out = []
        for m in self.coordinator.resident_managers:
            block = m.drop_resident_page(request_id, page)
            if block is not None:
                m.block_pool.free_blocks([block])
            out.append(None if block is None else block.block_id)
        return out

    def _request(self, request_id: str, prompt: list[int], report_mode: str = "incremental") -> Any:
        """vLLM's request of ``request_id`` on ``prompt``, made anew when the prompt or the KV-event
        ``report_mode`` changed (``extra_args["kv_cache_report_mode"]``, what ``get_computed_blocks``
        reads)."""
        req = self.requests.get(request_id)
        if (req is None or list(req.prompt_token_ids) != list(prompt)
                or getattr(req, "kv_cache_report_mode", "incremental") != report_mode):
            if self._hasher is not None and self._v["utils"].NONE_HASH != self._none_hash:
                # NONE_HASH is process-global in vLLM: another adapter may have re-seeded it since;
                # the hashes (published in KV events) must be the ones the reference computes
                self._v["init_none_hash"](self._v["sha256"])
            req = self.requests[request_id] = vllm_request(
                request_id, list(prompt), vllm_sampling_params(max_tokens=1, kv_cache_report_mode=report_mode),
                block_hasher=self._hasher)
            req.status = self._v["VStatus"].RUNNING
        return req

    def block_hashes(self, request_id: str, prompt: list[int]) -> list:
        return [] if self._hasher is None else list(self._request(request_id, prompt).block_hashes)

    def cache_blocks(self, request_id: str, num_tokens: int) -> None:
        """vLLM's ``KVCacheCoordinator.cache_blocks``, as ``allocate_slots`` calls it."""
        self._mgr.coordinator.cache_blocks(self.requests[request_id], num_tokens)

    def free(self, request_id: str, finished: bool = True) -> None:
        """``KVCacheCoordinator.free``: each manager frees its table (the host source and resident
        managers detach the request from the HiSparse coordinator first); the request is finished
        (or, ``finished=False``, preempted) first, as the scheduler leaves it."""
        self._hits.pop(request_id, None)
        req = self.requests.pop(request_id, None)
        if req is not None:
            req.status = self._v["VStatus"].FINISHED_STOPPED if finished else self._v["VStatus"].PREEMPTED
        self._mgr.coordinator.free(request_id)

    def observe(self) -> dict[str, Any]:
        return self.observe_pools([b.block_id for b in self.gpu_pool.free_block_queue.get_all_free_blocks()],
                                  [b.block_id for b in self.host_pool.free_block_queue.get_all_free_blocks()])


def vllm_hisparse_coordinator_for_layout(layout: list[tuple[str, int]], host_num_blocks: int | None,
                                         num_gpu_blocks: int, max_model_len: int, blocks_per_request: int = 1) -> Any:
    """vLLM's ``KVCacheManager`` over the groups of ``layout`` (``(kind, block_size)`` in group
    order, kinds as :data:`kvref.impl.reference.hisparse_group_layout.GROUP_KINDS`) and its
    ``get_hisparse_coordinator``: the coordinator, or vLLM's own error for a layout it rejects.
    The scheduler block is the layout's largest block size (all are powers of two), the hash
    block its smallest, so ``KVCacheManager`` itself accepts every mix and the coordinator decides."""
    from kvref.impl.reference.hisparse_group_layout import check_group_layout

    layout = check_group_layout(layout)
    load_vllm()
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.hisparse.coordinator import get_hisparse_coordinator
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupRole, KVCacheGroupSpec

    groups = []
    for i, (kind, bs) in enumerate(layout):
        fa = to_vllm_spec(FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype="float32"))
        config = HiSparsePoolConfig(block_size=bs, num_gpu_blocks=num_gpu_blocks, host_num_blocks=2,
                                    blocks_per_request=blocks_per_request, num_resident_groups=1,
                                    max_model_len=max_model_len, max_in_flight_tokens=max_model_len)
        if kind == "source":
            groups.append(KVCacheGroupSpec([f"g{i}"], fa, role=KVCacheGroupRole.HISPARSE_SOURCE, host_resident=True))
        elif kind == "indexer":
            groups.append(KVCacheGroupSpec([f"g{i}"], fa, role=KVCacheGroupRole.HISPARSE_INDEXER))
        elif kind == "full":
            groups.append(KVCacheGroupSpec([f"g{i}"], fa))
        elif kind == "resident":
            groups.append(KVCacheGroupSpec([f"g{i}"], to_vllm_spec(config.resident_spec())))
        else:
            groups.append(KVCacheGroupSpec([f"g{i}"], to_vllm_spec(config.hot_spec()), enable_kv_transfer=False))
    sizes = [bs for _, bs in layout]
    kv_config = KVCacheConfig(num_blocks=num_gpu_blocks, hisparse_host_num_blocks=host_num_blocks,
                              kv_cache_tensors=[], kv_cache_groups=groups)
    manager = KVCacheManager(kv_config, max_model_len=max_model_len, max_in_flight_tokens=max_model_len,
                             enable_caching=False, hash_block_size=min(sizes), scheduler_block_size=max(sizes))
    return get_hisparse_coordinator(manager)


#: the layouts vLLM's coordinator accepts, as the HiSparse programs compare them (#22)
VllmHiSparsePool.coordinator_for_layout = staticmethod(vllm_hisparse_coordinator_for_layout)
