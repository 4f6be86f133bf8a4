"""vLLM 0.33.0's ``SimpleCPUOffloadScheduler`` over its own ``KVCacheManager`` on a full-attention +
Mamba "align" pool with fine-grained hashes (issue #22): the twin of
:class:`kvref.impl.simple_cpu_mamba_backends.SimpleCPUMambaReferenceBackend`.

Each step's ``SchedulerOutput`` carries vLLM's ``KVConnectorBlockState`` with the boundary-state
hand-offs drained from this manager (as ``Scheduler.schedule()`` builds it), so the connector's
hand-off path (``_prepare_eager_store_specs``) and, at finish, its full-attention partial-tail
search (``_find_fa_partial_tail_source``) run on vLLM's own code.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kvref.impl.simple_cpu_mamba_backends import MambaAlignStepCalls, mamba_pool_config

from .offload import SimpleCPUVllmBackend, vllm_scheduler_output


class SimpleCPUMambaVllmBackend(MambaAlignStepCalls, SimpleCPUVllmBackend):
    """vLLM's KVCacheManager (FA + Mamba "align") + SimpleCPUOffloadScheduler bound to its pool."""

    name = "vllm"

    def __init__(self, cfg: Any, variant: str = "reference") -> None:  # noqa: D107 - the parent's is replaced
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager as VKVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import KVCacheTensor
        from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler as VSched

        from .specs import kv_cache_manager_kwargs, to_vllm_kv_cache_config

        assert variant == "reference", "vLLM runs as released"
        pool = mamba_pool_config(cfg)
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(cfg.hash_block_size, sha256)
        kcfg = to_vllm_kv_cache_config(pool)
        page = max(g.kv_cache_spec.page_size_bytes for g in kcfg.kv_cache_groups)
        # The connector sizes its CPU pool from the GPU tensors: one shared backing allocation.
        kcfg.kv_cache_tensors = [KVCacheTensor(size=page * cfg.num_gpu_blocks,
                                               layers=[g.layer_names[0] for g in kcfg.kv_cache_groups],
                                               layer_stride=page, block_stride=page)]
        self.mgr = VKVCacheManager(kcfg, **kv_cache_manager_kwargs(pool))
        vcfg = SimpleNamespace(
            kv_events_config=SimpleNamespace(enable_kv_cache_events=bool(cfg.kv_events)), speculative_config=None,
            max_in_flight_tokens=cfg.max_model_len, num_prefill_lookahead_tokens=0,
            parallel_config=SimpleNamespace(decode_context_parallel_size=1, world_size=cfg.world_size),
            model_config=SimpleNamespace(max_model_len=cfg.max_model_len),
            scheduler_config=SimpleNamespace(max_num_batched_tokens=cfg.max_num_batched_tokens))
        self.conn = VSched(vcfg, kcfg, cpu_capacity_bytes=10**12, scheduler_block_size=cfg.block_size,
                           hash_block_size=cfg.hash_block_size, lazy_offload=False, num_cpu_blocks=cfg.num_cpu_blocks)
        self.conn.bind_gpu_block_pool(self.mgr.block_pool)
        self.gpu_pool = self.mgr.block_pool
        self.cpu_pool = self.conn.cpu_block_pool

    def _take_copies(self) -> tuple[list[tuple[int, int]], list[Any]]:
        copies, retained = self.mgr.take_kv_cache_block_copies()
        return [(c.src_block_id, c.dst_block_id) for c in copies], retained

    def build_meta(self, step):
        from vllm.v1.core.sched.output import KVConnectorBlockState

        out = vllm_scheduler_output(step)
        # As Scheduler.schedule(): the requests scheduled this step plus those with a hand-off.
        out.kv_connector_block_state = KVConnectorBlockState(
            req_ids=set(step.num_scheduled_tokens) | set(step.boundary_state_offloads),
            resolve_block_ids=self.mgr.get_block_ids,
            boundary_state_offloads={rid: list(e) for rid, e in step.boundary_state_offloads.items()})
        m = self.conn.build_connector_meta(out)
        return (m.load_event, list(m.load_gpu_blocks), list(m.load_cpu_blocks), m.store_event,
                list(m.store_gpu_blocks), list(m.store_cpu_blocks), m.need_flush)

    def _boundary_store_stats(self) -> dict[str, int]:
        from dataclasses import asdict

        return asdict(self.conn.get_boundary_store_stats())
