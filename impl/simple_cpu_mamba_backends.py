"""kvref's SimpleCPU offload backend on a full-attention + Mamba "align" GPU pool (issue #22).

The SimpleCPU offload world (:mod:`kvref.models.offload.simple_cpu_mamba_world`) drives it like
:class:`~kvref.impl.offload_backends.SimpleCPUReferenceBackend`, plus what a Mamba "align" pool
adds to a scheduler step (vLLM's ``schedule()``): ``new_step_starts`` on the manager, a look-up
that also returns the shared-prefix junction (where chunks stop), the boundary-state hand-offs
drained for the connector, and the copy-on-write pairs whose retained endpoints are released.
Hashes are finer than blocks (``hash_block_size`` < ``block_size``), so hits land inside blocks.
vLLM's twin is :class:`kvref.impl.vllm.simple_offload_mamba.SimpleCPUMambaVllmBackend`.
"""

from __future__ import annotations

from typing import Any

from kvref.impl.interface import PoolConfig
from kvref.impl.offload_backends import SimpleCPUReferenceBackend
from kvref.impl.reference.kv_cache_manager import KVCacheManager
from kvref.impl.reference.offload.simple_cpu_offload_scheduler import SimpleCPUOffloadScheduler


def mamba_pool_config(cfg: Any) -> PoolConfig:
    """The GPU pool of a Mamba-align offload scenario (its block count is the scenario's)."""
    return PoolConfig.off_plan(
        "an offload scenario's GPU pool: its block count is the scenario's, not a startup plan's",
        num_blocks=cfg.num_gpu_blocks, groups=cfg.kvref_groups(), max_model_len=cfg.max_model_len,
        scheduler_block_size=cfg.block_size, hash_block_size=cfg.hash_block_size, enable_caching=True)


class MambaAlignStepCalls:
    """The calls a Mamba "align" pool adds to a scheduler step, once for both backends: kvref's
    ``KVCacheManager`` and vLLM's (``self.mgr``) answer the look-up, ``new_step_starts`` and the
    hand-off drain alike; each backend says how it drains its copy-on-write pairs
    (``_take_copies``) and reads its connector's hand-off counters (``_boundary_store_stats``).
    Mixed in before the backend class, so ``connector_state`` extends the backend's."""

    mgr: Any
    conn: Any

    def lookup(self, req) -> tuple[Any, int, int]:
        """(hit blocks, hit tokens, shared-prefix junction) of ``get_computed_blocks``."""
        return self.mgr.get_computed_blocks(req)

    def new_step_starts(self) -> None:
        self.mgr.new_step_starts()

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        return self.mgr.take_boundary_state_offloads()

    def release_kv_cache_block_copies(self) -> list[tuple[int, int]]:
        """Drain the copy-on-write pairs and free their retained endpoints (the scheduler's end of
        ``schedule()``, the copy's step not in flight)."""
        pairs, retained = self._take_copies()
        if retained:
            self.mgr.block_pool.free_blocks(retained)
        return pairs

    def connector_state(self) -> dict:
        state = super().connector_state()  # type: ignore[misc]  # the backend's, after this mixin
        state["boundary_store_stats"] = self._boundary_store_stats()
        return state

    def _take_copies(self) -> tuple[list[tuple[int, int]], list[Any]]:
        """(src, dst) block-id pairs of the pending copies, and the blocks they retain."""
        raise NotImplementedError("abstract: each backend drains its own manager's copies")

    def _boundary_store_stats(self) -> dict[str, int]:
        raise NotImplementedError("abstract: each backend reads its own connector's counters")


class SimpleCPUMambaReferenceBackend(MambaAlignStepCalls, SimpleCPUReferenceBackend):
    """kvref's KVCacheManager (FA + Mamba "align", fine-grained hashes) + SimpleCPUOffloadScheduler."""

    name = "reference"

    def __init__(self, cfg: Any, variant: str = "reference") -> None:  # noqa: D107 - the parent's is replaced
        self.mgr = KVCacheManager(mamba_pool_config(cfg))
        self.conn = SimpleCPUOffloadScheduler(
            cfg.kvref_groups(), cfg.num_cpu_blocks, cfg.max_model_len, cfg.block_size, cfg.hash_block_size,
            world_size=cfg.world_size, max_num_batched_tokens=cfg.max_num_batched_tokens,
            block_hasher=self.mgr.block_hashes, enable_kv_cache_events=cfg.kv_events, **self.VARIANTS[variant])
        self.conn.bind_gpu_block_pool(self.mgr.block_pool)
        self.gpu_pool = self.mgr.block_pool
        self.cpu_pool = self.conn.cpu_block_pool

    def _take_copies(self) -> tuple[list[tuple[int, int]], list[Any]]:
        pairs, retained = [], []
        for manager in self.mgr.coordinator.single_type_managers:
            for src, dst in manager.take_pending_cow_copies():
                pairs.append((src.block_id, dst.block_id))
                retained += (src, dst)
        return pairs, retained

    def stats(self) -> tuple[dict[str, int], dict, bool]:
        """(interval stats, boundary save outcomes since the last call, has_pending_stores())."""
        return self.conn.get_stats(), self.conn.take_save_outcomes(), self.conn.has_pending_stores()

    def _boundary_store_stats(self) -> dict[str, int]:
        return self.conn.get_boundary_store_stats()
