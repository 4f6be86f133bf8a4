"""The engine side both offload worlds drive: a GPU ``KVCacheManager`` and requests, as vLLM's
``Scheduler`` uses them around a KV connector — kvref's reference here, vLLM's own in
:mod:`kvref.impl.vllm.offload`.

The two offload worlds (:mod:`kvref.models.offload.simple_cpu_world` for ``SimpleCPUOffloadScheduler`` and
:mod:`kvref.models.offload.offloading_connector_world` for the ``OffloadingConnector``) schedule the same way;
the calls they make on the manager, the request and the connector's ``get_num_new_matched_tokens``
are this interface, once, so the worlds cannot drift apart in how they build requests, allocate or
finish a load. Each world's backends (:mod:`kvref.impl.offload_backends`) add their connector.
"""

from __future__ import annotations

from typing import Any

from kvref.impl.interface import PoolConfig
from kvref.impl.reference.kv_cache_manager import KVCacheManager
from kvref.impl.request import Request, RequestStatus
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec


def kvref_kv_cache_groups(block_size: int, sliding_window: int | None) -> tuple[KVCacheGroupSpec, ...]:
    """One full-attention group, plus a sliding-window group when ``sliding_window`` is set."""
    kw = dict(block_size=block_size, num_kv_heads=1, head_size=1, dtype="float32")
    groups = [KVCacheGroupSpec(("full",), FullAttentionSpec(**kw))]
    if sliding_window is not None:
        groups.append(KVCacheGroupSpec(("swa",), SlidingWindowSpec(sliding_window=sliding_window, **kw)))
    return tuple(groups)


def kvref_kv_cache_manager(cfg: Any, groups: tuple[KVCacheGroupSpec, ...]) -> KVCacheManager:
    """kvref's GPU ``KVCacheManager`` with prefix caching: requests hashed every ``cfg.hash_block_size``
    tokens where the config sets it (finer than the blocks), else every block."""
    return KVCacheManager(PoolConfig.off_plan(
        "an offload scenario's GPU pool: its block count is the scenario's, not a startup plan's",
        num_blocks=cfg.num_gpu_blocks, groups=groups, max_model_len=cfg.max_model_len,
        scheduler_block_size=cfg.block_size, hash_block_size=getattr(cfg, "hash_block_size", None) or cfg.block_size,
        enable_caching=True,
        use_eagle=any(g.is_eagle_group for g in groups) or bool(getattr(cfg, "speculative_eagle", False)),
        prefix_cache_retention_interval=getattr(cfg, "prefix_cache_retention_interval", None)))


def note_shared_prefix_boundary(req: Any, junction: int, retention_interval: int | None) -> None:
    """What vLLM's ``Scheduler`` does with the third answer of ``get_computed_blocks``: the junction
    where a sparse-retention group's hit stopped short of the shared prefix becomes
    ``request.shared_prefix_boundary`` (the OffloadingConnector then keeps its tail, and the GPU
    cache its state). Only on pools with a retention interval, the one place the offload worlds
    read it: elsewhere their prefill chunks do not stop at the junction as vLLM's Mamba split
    does, so the worlds leave it at 0 on both sides."""
    if retention_interval is not None:
        req.shared_prefix_boundary = junction


# --------------------------------------------------------------------------------------------
# Engines: the calls vLLM's Scheduler makes on the KVCacheManager, the Request and the connector
# interface they share (``get_num_new_matched_tokens``). A backend sets ``mgr`` and ``conn``.


class ReferenceEngine:
    """kvref's ``KVCacheManager`` and ``Request``."""

    mgr: Any
    conn: Any

    def make_request(self, rid: str, prompt: list[int], max_tokens: int, prompt_logprobs: bool = False) -> Any:
        """``prompt_logprobs``: the request asks for its prompt's logprobs, so it never reads the
        prefix cache (vLLM's ``SamplingParams`` sets ``skip_reading_prefix_cache`` for it)."""
        return Request(rid, prompt, max_tokens=max_tokens, skip_reading_prefix_cache=prompt_logprobs)

    def append_token(self, req, tok: int) -> None:
        req.output_token_ids.append(tok)

    def block_hashes(self, req) -> list[bytes]:
        return self.mgr.block_hashes(req)

    def set_status(self, req, status: str) -> None:
        # kvref has one FINISHED status; vLLM's tell a stop from an abort (VllmEngine).
        req.status = {"waiting": RequestStatus.WAITING, "loading": RequestStatus.WAITING,
                      "running": RequestStatus.RUNNING, "preempted": RequestStatus.PREEMPTED,
                      "finished": RequestStatus.FINISHED, "aborted": RequestStatus.FINISHED}[status]

    def get_computed_blocks(self, req):
        blocks, n, junction = self.mgr.get_computed_blocks(req)
        note_shared_prefix_boundary(req, junction, self.mgr.coordinator.retention_interval)
        return blocks, n

    def allocate(self, req, n_new, n_hit=0, hits=None, n_ext=0, delay=False):
        out = self.mgr.allocate_slots(req, n_new, n_hit, hits, num_external_computed_tokens=n_ext,
                                      delay_cache_blocks=delay)
        return None if out is None else out.get_block_ids()

    def table(self, rid: str) -> tuple[list[int], ...]:
        return tuple(list(x) for x in self.mgr.get_block_ids(rid))

    def cache_blocks(self, req, n: int) -> None:
        self.mgr.coordinator.cache_blocks(req, self.mgr.block_hashes(req), n)

    def free(self, req) -> None:
        self.mgr.free(req)

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """The GPU cache's Mamba "align" boundary-state hand-offs since the last call, as vLLM's
        ``schedule()`` drains them into ``SchedulerOutput.kv_connector_block_state`` every step."""
        return self.mgr.take_boundary_state_offloads()

    def release_kv_cache_block_copies(self) -> list[tuple[int, int]]:
        """The step's copy-on-write pairs (source, destination ids), their retained endpoints freed,
        as vLLM's ``schedule()`` does (``take_kv_cache_block_copies`` + ``_free_cow_retained_blocks``,
        the copy's step not in flight)."""
        pairs, retained = [], []
        for manager in self.mgr.coordinator.single_type_managers:
            for src, dst in manager.take_pending_cow_copies():
                pairs.append((src.block_id, dst.block_id))
                retained += (src, dst)
        if retained:
            self.mgr.block_pool.free_blocks(retained)
        return pairs

    def match(self, req, n_computed):
        return self.conn.get_num_new_matched_tokens(req, n_computed)
