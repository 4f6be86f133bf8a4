"""A HiSparse pool in the reference: the host source, indexer, resident and hot managers over one
GPU pool and a private host pool, with the HiSparse coordinator (issue #23).

The group layout is :class:`kvref.spec.hisparse.HiSparsePoolConfig`'s. The operations are those
vLLM's ``KVCacheManager`` / ``KVCacheCoordinator`` run on the managers (admission counts, hit and
import set-up, allocation, free) and those the scheduler and the HiSparse connector run on the
coordinator (:class:`~.hisparse_coordinator.HiSparseCoordinator`: per-step write-back planning and
residency, the offload command, the workers' completion reports, host-import completion, residency
updates and row mirrors for the worker). The GPU pool is a :class:`~.hisparse_block_pool.ReuseWatchingBlockPool`,
so clean pages can be released while still read.
"""

from __future__ import annotations

from typing import Any

from kvref.impl.hisparse_calls import HiSparseManagerCalls
from kvref.spec.errors import InvalidFieldError
from kvref.spec.hisparse import HiSparsePoolConfig
from kvref.spec.kv_cache_interface import FullAttentionSpec

from kvref.impl.request import Request, RequestStatus
from kvref.spec.mathutil import round_down
from kvref.spec.prefix_cache_retention import replay_boundaries

from .block_hash import RequestBlockHasher, sha256
from .block_pool import BlockPoolCore
from .hisparse_block_pool import ReuseWatchingBlockPool
from .hisparse_coordinator import HiSparseCoordinator
from .hisparse_invariants import check_hisparse_ref_counts
from .full_attention_manager import FullAttentionManager
from .hisparse_hot_manager import HiSparseHotManager
from .hisparse_resident_manager import HiSparseResidentManager
from .hisparse_source_manager import HiSparseSourceManager
from .single_type_manager import SingleTypeKVCacheManager


class HiSparsePool(HiSparseManagerCalls):
    kind = "reference"

    def __init__(self, config: HiSparsePoolConfig) -> None:
        if not isinstance(config, HiSparsePoolConfig):
            raise InvalidFieldError("config", config, "a kvref.spec.hisparse.HiSparsePoolConfig")
        self.config = config
        bs = config.block_size
        caching = config.enable_caching
        self.gpu_pool = ReuseWatchingBlockPool(config.num_gpu_blocks, enable_caching=caching, hash_block_size=bs)
        fa = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype="float32")
        common = dict(block_pool=self.gpu_pool, enable_caching=caching, scheduler_block_size=bs)
        source = HiSparseSourceManager(fa, kv_cache_group_id=0, **common)
        managers: list[SingleTypeKVCacheManager] = [source, FullAttentionManager(fa, kv_cache_group_id=1, **common)]
        resident_spec, hot_spec = config.resident_spec(), config.hot_spec()
        cap = resident_spec.max_admission_blocks_per_request(config.max_in_flight_tokens, config.max_model_len)
        for kind in config.group_kinds[2:]:
            gid = len(managers)
            if kind == "resident":
                managers.append(HiSparseResidentManager(resident_spec, kv_cache_group_id=gid,
                                                        max_admission_blocks_per_request=cap, **common))
            else:
                managers.append(HiSparseHotManager(hot_spec, kv_cache_group_id=gid, has_resident_groups=True,
                                                   **common))
        self.managers = tuple(managers)
        # binds the source's private host pool, as vLLM's get_hisparse_coordinator does
        self.coordinator = HiSparseCoordinator(self.managers, config.num_gpu_blocks, config.host_num_blocks,
                                               config.max_model_len)
        self.host_pool = source.block_pool
        self.resident_managers = self.coordinator.resident_managers
        self.hot_managers = self.coordinator.hot_managers
        self._hits = {}
        self._hasher = RequestBlockHasher(bs, sha256) if caching else None
        #: the requests prefix caching hashes and publishes, by id
        self.requests: dict[str, Request] = {}

    @property
    def transition_watermark(self) -> int:
        return self.coordinator.transition_watermark

    def bound_coordinator(self) -> HiSparseCoordinator:
        """The coordinator the managers are bound to (vLLM's ``get_hisparse_coordinator`` returns
        it on every call after the first instead of building, and binding, another)."""
        bound = {id(m.coordinator): m.coordinator for m in self.managers if getattr(m, "coordinator", None)}
        if len(bound) != 1:
            raise RuntimeError(f"HiSparse managers bound to {len(bound)} coordinators, expected one")
        return next(iter(bound.values()))

    def require_hot(self, request_id: str) -> None:
        for m in self.hot_managers:
            m.require_hot(request_id)

    def adopt(self, request_id: str, page: int, donor_id: str, donor_page: int) -> list[bool]:
        """Point a host-only page of each resident group at the donor's GPU block of that group and
        pin it (vLLM ``HiSparseCoordinator._adopt_copies`` does it for GPU copies of host pages)."""
        out = []
        for m in self.resident_managers:
            block = m.get_resident_page(donor_id, donor_page)
            ok = block is not None and m.adopt_resident_page(request_id, page, block)
            if ok:
                BlockPoolCore.touch(m.block_pool, [block])
            out.append(ok)
        return out

    def drop(self, request_id: str, page: int) -> list[int | None]:
        """Stop reading an adopted page from the GPU and release its pin."""
        out = []
        for m in self.resident_managers:
            block = m.drop_resident_page(request_id, page)
            if block is not None:
                BlockPoolCore.free_blocks(m.block_pool, [block])
            out.append(None if block is None else block.block_id)
        return out

    def _request(self, request_id: str, prompt: list[int], report_mode: str = "incremental") -> Request:
        """The request of ``request_id`` on ``prompt``, made anew when the prompt or the KV-event
        ``report_mode`` (``kv_cache_report_mode``: ``"full"`` announces a prefix hit's blocks) changed."""
        req = self.requests.get(request_id)
        if req is None or req.prompt_token_ids != list(prompt) or req.kv_cache_report_mode != report_mode:
            req = self.requests[request_id] = Request(request_id, list(prompt), max_tokens=1,
                                                      status=RequestStatus.RUNNING, kv_cache_report_mode=report_mode)
        return req

    def block_hashes(self, request_id: str, prompt: list[int]) -> list:
        return [] if self._hasher is None else self._hasher.block_hashes(self._request(request_id, prompt))

    def cache_blocks(self, request_id: str, num_tokens: int) -> None:
        """``KVCacheCoordinator.cache_blocks`` after an allocation: every caching group publishes up
        to ``num_tokens`` rounded down to the scheduler block (the host source only once durable)."""
        req = self.requests[request_id]
        boundaries = replay_boundaries(len(req.prompt_token_ids), self.config.block_size, use_eagle=False)
        hashes = self._hasher.block_hashes(req)
        for m in self.managers:
            if m.enable_caching:
                m.cache_blocks(req, hashes, round_down(num_tokens, self.config.block_size),
                               retention_interval=None, replay_boundaries=boundaries)

    def free(self, request_id: str, finished: bool = True) -> None:
        """``KVCacheCoordinator.free`` of a finished (or, ``finished=False``, a preempted) request."""
        self._hits.pop(request_id, None)
        req = self.requests.get(request_id)
        if req is not None:
            req.status = RequestStatus.FINISHED if finished else RequestStatus.PREEMPTED
        for m in self.managers:
            m.free(request_id)
        if self._hasher is not None:
            self._hasher.forget(request_id)
        self.requests.pop(request_id, None)

    def observe(self) -> dict[str, Any]:
        return self.observe_pools(list(self.gpu_pool.free_block_ids()), list(self.host_pool.free_block_ids()))

    def check_invariants(self) -> None:
        """Each pool's own rules, each manager's, the coordinator's, and M16: every block's reference
        count equals its readers that pin it: the tables reading it (resident groups: residency
        rows without their unpinned pages), the transfers in flight (a GPU block until every
        worker enqueued it, a host block until it completed) and a finished request's host blocks
        kept for its last publication."""
        self.gpu_pool.check_invariants()
        self.host_pool.check_invariants()
        for m in self.managers:
            m.check_invariants()
        self.coordinator.check_invariants()
        check_hisparse_ref_counts(self.managers, self.coordinator)
