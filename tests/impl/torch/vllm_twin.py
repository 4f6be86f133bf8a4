"""Drive vLLM 0.33.0's own ``KVCacheManager`` through the kvref interface (plain ids).

Used by the torch differential tests only; the manager itself is built by the adapters' builder
(:func:`kvref.impl.vllm.specs.build_kv_cache_manager`), so it is configured as every vLLM adapter's. Import after ``require_vllm()``; it sets ``VLLM_TARGET_DEVICE=cpu`` via conftest.
"""

from __future__ import annotations

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id, get_request_block_hasher
from vllm.v1.request import Request as VRequest
from vllm.v1.request import RequestStatus as VStatus

from kvref.impl.interface import PoolConfig
from kvref.impl.vllm.specs import build_kv_cache_manager
from kvref.impl.request import Request, RequestStatus

_STATUS = {RequestStatus.WAITING: VStatus.WAITING, RequestStatus.RUNNING: VStatus.RUNNING,
           RequestStatus.PREEMPTED: VStatus.PREEMPTED, RequestStatus.FINISHED: VStatus.FINISHED_STOPPED}


class VllmTwin:
    """vLLM's KVCacheManager answering the kvref ``KVCacheManagerLike`` calls."""

    def __init__(self, cfg: PoolConfig) -> None:
        kv_cache_utils.init_none_hash(sha256)
        self.mgr = build_kv_cache_manager(cfg)  # the adapters' builder (kvref.impl.vllm.specs)
        self.pool = self.mgr.block_pool
        self.hasher = get_request_block_hasher(cfg.hash_block_size, sha256)
        self.num_groups = len(cfg.groups)
        self._reqs: dict[str, VRequest] = {}

    def _sync(self, r: Request) -> VRequest:
        v = self._reqs.get(r.request_id)
        if v is None:
            v = VRequest(request_id=r.request_id, prompt_token_ids=list(r.prompt_token_ids),
                         sampling_params=SamplingParams(max_tokens=r.max_tokens), pooling_params=None,
                         cache_salt=r.cache_salt, block_hasher=self.hasher)
            self._reqs[r.request_id] = v
        missing = r.output_token_ids[len(v.output_token_ids):]
        if missing:
            v.append_output_token_ids(list(missing))
        v.num_computed_tokens = r.num_computed_tokens
        v.num_in_flight_tokens = r.num_in_flight_tokens
        v.status = _STATUS[r.status]
        return v

    def _blocks(self, ids):
        if ids is None:
            return None
        return self.mgr.create_kv_cache_blocks(tuple([self.pool.blocks[b] for b in g] for g in ids))

    def get_computed_blocks(self, r: Request):
        blocks, hit, _ = self.mgr.get_computed_blocks(self._sync(r))
        return tuple(tuple(g) for g in blocks.get_block_ids()), hit

    def allocate_slots(self, r: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_block_ids=None, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                       full_sequence_must_fit: bool = False, reserved_blocks: int = 0,
                       has_scheduled_reqs: bool = True):
        out = self.mgr.allocate_slots(
            self._sync(r), num_new_tokens, num_new_computed_tokens, self._blocks(new_computed_block_ids),
            num_lookahead_tokens=num_lookahead_tokens,
            num_external_computed_tokens=num_external_computed_tokens,
            delay_cache_blocks=delay_cache_blocks, full_sequence_must_fit=full_sequence_must_fit,
            reserved_blocks=reserved_blocks, has_scheduled_reqs=has_scheduled_reqs)
        if out is None:
            return None
        return tuple(tuple(g) for g in out.get_block_ids())

    def free(self, r: Request) -> None:
        self.mgr.free(self._sync(r))

    def get_block_ids(self, rid: str):
        return tuple(tuple(b.block_id for b in g) for g in self.mgr.coordinator.get_blocks(rid))

    def get_num_free_blocks(self) -> int:
        return self.pool.get_num_free_blocks()

    def free_block_queue(self):
        return tuple(b.block_id for b in self.pool.free_block_queue.get_all_free_blocks())

    def cached_blocks(self):
        return {(get_group_id(b.block_hash), b.block_id): bytes(get_block_hash(b.block_hash))
                for b in self.pool.blocks if b.block_hash is not None}

    def hash_index(self) -> dict[bytes, tuple[int, ...]]:
        out = {}
        for key, v in self.pool.cached_block_hash_to_block._cache.items():
            out[bytes(key)] = (v.block_id,) if hasattr(v, "block_id") else tuple(v)
        return out

    def ref_counts(self) -> list[int]:
        return [b.ref_cnt for b in self.pool.blocks]

    def check_invariants(self) -> None:
        assert self.pool.get_num_free_blocks() == len(self.free_block_queue())
