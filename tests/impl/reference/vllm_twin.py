"""Drive vLLM 0.33.0's own KVCacheManager beside the reference (test helper, needs vLLM).

Builds vLLM's manager from a :class:`~kvref.impl.interface.PoolConfig` with the adapter's builder
(:func:`kvref.impl.vllm.specs.build_kv_cache_manager`, the one every vLLM adapter uses), turns kvref
requests into vLLM requests, and reads back what both can observe: block ids per group, the free
queue, and the cached hashes. Import only after ``require_vllm()``.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.request import Request as VllmRequest  # noqa: E402
from vllm.v1.request import RequestStatus as VllmStatus  # noqa: E402

from kvref.impl.interface import PoolConfig
from kvref.impl.vllm.specs import build_kv_cache_manager  # noqa: E402
from kvref.impl.request import Request, RequestStatus  # noqa: E402

_STATUS = {RequestStatus.WAITING: VllmStatus.WAITING, RequestStatus.RUNNING: VllmStatus.RUNNING,
           RequestStatus.PREEMPTED: VllmStatus.PREEMPTED}


class VllmTwin:
    """A vLLM KVCacheManager plus the vLLM twin of each kvref request."""

    def __init__(self, cfg: PoolConfig) -> None:
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(cfg.hash_block_size, sha256) if cfg.enable_caching else None
        self.mgr = build_kv_cache_manager(cfg)
        self.reqs: dict[str, VllmRequest] = {}

    def request(self, req: Request) -> VllmRequest:
        """The twin of ``req``, synced: tokens appended, counters and status copied."""
        vr = self.reqs.get(req.request_id)
        if vr is None:
            vr = VllmRequest(req.request_id, list(req.prompt_token_ids), SamplingParams(max_tokens=req.max_tokens),
                             None, block_hasher=self.hasher, cache_salt=req.cache_salt)
            self.reqs[req.request_id] = vr
        missing = req.output_token_ids[vr.num_output_tokens:]
        if missing:
            vr.append_output_token_ids(list(missing))
        vr.num_computed_tokens = req.num_computed_tokens
        vr.num_in_flight_tokens = req.num_in_flight_tokens
        vr.status = _STATUS.get(req.status, VllmStatus.RUNNING)
        return vr

    def free_queue(self) -> tuple[int, ...]:
        return tuple(b.block_id for b in self.mgr.block_pool.free_block_queue.get_all_free_blocks())

    def cached_blocks(self) -> dict[tuple[int, int], bytes]:
        out = {}
        for block in self.mgr.block_pool.blocks:
            if block.block_hash is not None:
                key = block.block_hash
                out[(int.from_bytes(key[-4:], "big"), block.block_id)] = bytes(key[:-4])
        return out
