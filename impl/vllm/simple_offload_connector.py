"""vLLM 0.33.0's whole ``SimpleCPUOffloadConnector`` (``kv_connector/v1/simple_cpu_offload_connector.py``)
built from a ``VllmConfig`` with ``kv_transfer_config``, its SCHEDULER role driven through
``KVConnectorBase_V1``'s calls in the SimpleCPU offload world
(:mod:`kvref.models.offload.simple_cpu_world`), so every step compares it with the reference
backend as ``conform-offload`` compares vLLM's bare ``SimpleCPUOffloadScheduler``.

The connector reads its settings from ``kv_connector_extra_config`` (``cpu_bytes_to_use`` shared by
the ranks, ``num_cpu_blocks``, ``lazy_offload``, ``kv_offload_backend``) and the scheduler's block
sizes from the cache config, as a server does. Its WORKER role is built too (the constructor runs
on CPU) but not driven: ``SimpleCPUOffloadWorker.register_kv_caches`` creates CUDA streams and
pins the host pool with ``cudaHostRegister`` (kvref/data/reach_exclusions.toml, ``needs-gpu``).
"""

from __future__ import annotations

import copy
from typing import Any

from kvref.impl.vllm.offload import (
    SimpleCPUVllmBackend,
    merged_worker_meta,
    vllm_kv_cache_manager,
    vllm_scheduler_output,
)
from kvref.impl.vllm.offload_worker import base_vllm_config

#: the per-rank CPU budget the bare-scheduler backend gives vLLM (the pool is sized by num_cpu_blocks)
CPU_BYTES_PER_RANK = 10**12


def simple_offload_vllm_config(cfg: Any) -> Any:
    """A ``VllmConfig`` selecting vLLM's ``SimpleCPUOffloadConnector`` for ``cfg`` (a
    :class:`~kvref.models.offload.simple_cpu_world.SimpleOffloadConfig`)."""
    from vllm.config import KVTransferConfig

    base = base_vllm_config()
    vc = copy.copy(base)
    vc.cache_config = copy.copy(base.cache_config)
    vc.cache_config.block_size = cfg.block_size
    vc.cache_config.enable_prefix_caching = True
    vc.parallel_config = copy.copy(base.parallel_config)
    vc.parallel_config.tensor_parallel_size = cfg.world_size
    vc.parallel_config.world_size = cfg.world_size
    vc.scheduler_config = copy.copy(base.scheduler_config)
    vc.scheduler_config.max_num_batched_tokens = cfg.max_num_batched_tokens
    vc.scheduler_config.max_model_len = cfg.max_model_len
    vc.model_config = copy.copy(base.model_config)
    vc.model_config.max_model_len = cfg.max_model_len
    # The connector publishes its CPU cache's KV events when the config turns them on (compared by
    # the world like the scheduler's); no publisher is built here, only the flag is read.
    from vllm.config.kv_events import KVEventsConfig

    vc.kv_events_config = KVEventsConfig(enable_kv_cache_events=bool(getattr(cfg, "kv_events", False)),
                                         publisher="null")
    vc.kv_transfer_config = KVTransferConfig(
        kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both", engine_id="kvref-simple-cpu",
        kv_connector_extra_config={"cpu_bytes_to_use": CPU_BYTES_PER_RANK * cfg.world_size,
                                   "num_cpu_blocks": cfg.num_cpu_blocks, "lazy_offload": cfg.lazy,
                                   "kv_offload_backend": "cpu"})
    return vc


def build_simple_cpu_connector(cfg: Any, extra: dict, role: str, *, enable_prefix_caching: bool = True,
                               aligned_num_cpu_blocks: int | None = None) -> Any:
    """vLLM's ``SimpleCPUOffloadConnector`` in ``role`` ("scheduler" or "worker") for ``cfg``'s GPU
    pool, with ``extra`` as its whole ``kv_connector_extra_config`` (the construction path a server
    takes: budgets, explicit or agreed block counts, backend, store mode); vLLM's own error when it
    refuses the configuration. Returns ``(connector, gpu KVCacheConfig)``."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (
        SimpleCPUOffloadConnector,
    )

    _, kcfg, _ = vllm_kv_cache_manager(cfg)
    vc = simple_offload_vllm_config(cfg)
    vc.cache_config.enable_prefix_caching = enable_prefix_caching
    vc.cache_config.simple_cpu_offload_num_blocks = aligned_num_cpu_blocks
    vc.kv_transfer_config = KVTransferConfig(kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both",
                                             engine_id="kvref-simple-cpu", kv_connector_extra_config=dict(extra))
    roles = {"scheduler": KVConnectorRole.SCHEDULER, "worker": KVConnectorRole.WORKER}
    from .multi_connector_worker import quiet

    # vLLM's "experimental API" line per build, and its warnings about the generated configurations
    with quiet("vllm.distributed.kv_transfer.kv_connector.v1.base",
               "vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector"):
        return SimpleCPUOffloadConnector(vc, roles[role], kcfg), kcfg


def find_simple_cpu_in_multi(cfg: Any, extra: dict, position: int | None, num_children: int) -> tuple[int | None, Any]:
    """vLLM's ``MultiConnector`` (WORKER role, as a worker process holds it) over ``num_children``
    scripted children with a ``SimpleCPUOffloadConnector`` (configured by ``extra``) at
    ``position`` (None: none), and what vLLM's ``_find_simple_cpu_offload_connector`` finds in it
    (the worker asks it for the agreed pool size). Returns ``(index of the found child or None,
    its get_aligned_num_cpu_blocks())``."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (
        _find_simple_cpu_offload_connector,
    )

    from kvref.impl.reference.connector_worker_child import ScriptedWorkerChild

    from .multi_connector_worker import multi_connector_config, quiet

    _, kcfg, _ = vllm_kv_cache_manager(cfg)
    vc = multi_connector_config([ScriptedWorkerChild(i) for i in range(num_children)], cfg.world_size)
    vc.cache_config = simple_offload_vllm_config(cfg).cache_config
    children = list(vc.kv_transfer_config.kv_connector_extra_config["connectors"])
    if position is not None:
        children.insert(position, dict(kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both",
                                       kv_connector_extra_config=dict(extra)))
    vc.kv_transfer_config = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both", engine_id="kvref-multi",
                                             kv_connector_extra_config={"connectors": children})
    with quiet("vllm.distributed.kv_transfer.kv_connector.v1.base",
               "vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector"):
        multi = MultiConnector(vc, KVConnectorRole.WORKER, kcfg)
    found = _find_simple_cpu_offload_connector(multi)
    if found is None:
        return None, None
    index = next(i for i, c in enumerate(multi.sub_connectors) if c is found)
    return index, found.get_aligned_num_cpu_blocks()


def _beside_non_hma_child(vc: Any, kcfg: Any) -> Any:
    """vLLM's ``MultiConnector`` (SCHEDULER role) over the SimpleCPU connector ``vc`` selects and
    vLLM's ``ExampleConnector`` (not ``SupportsHMA``; its scheduler side answers no hits and
    finishes without delay); with a child lacking HMA vLLM needs the hybrid KV cache manager off."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    from .multi_connector_worker import quiet

    simple = vc.kv_transfer_config
    mvc = copy.copy(vc)
    mvc.scheduler_config = copy.copy(vc.scheduler_config)
    mvc.scheduler_config.disable_hybrid_kv_cache_manager = True
    mvc.kv_transfer_config = KVTransferConfig(
        kv_connector="MultiConnector", kv_role="kv_both", engine_id=simple.engine_id,
        kv_connector_extra_config={"connectors": [
            dict(kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both",
                 kv_connector_extra_config=dict(simple.kv_connector_extra_config)),
            dict(kv_connector="ExampleConnector", kv_role="kv_both")]})
    with quiet("vllm.distributed.kv_transfer.kv_connector.v1.base",
               "vllm.distributed.kv_transfer.kv_connector.v1.example_connector"):
        multi = MultiConnector(mvc, KVConnectorRole.SCHEDULER, kcfg)
    assert not MultiConnector.all_children_support_hma(mvc.kv_transfer_config)
    return multi


class SimpleCPUConnectorVllmBackend(SimpleCPUVllmBackend):
    """vLLM's ``SimpleCPUOffloadConnector`` (SCHEDULER role) over its GPU ``KVCacheManager``;
    ``conn`` is the connector's ``SimpleCPUOffloadScheduler`` (read for the compared state only),
    every call goes through ``connector``."""

    name = "vllm-connector"

    def __init__(self, cfg: Any, variant: str = "reference") -> None:  # noqa: D107 - the parent's is replaced
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (
            SimpleCPUOffloadConnector,
        )

        assert variant == "reference", "vLLM runs as released"
        self._hasher, kcfg, self.mgr = vllm_kv_cache_manager(cfg)
        vc = simple_offload_vllm_config(cfg)
        self.multi = _beside_non_hma_child(vc, kcfg) if getattr(cfg, "non_hma_sibling", False) else None
        self.connector = SimpleCPUOffloadConnector(vc, KVConnectorRole.SCHEDULER, kcfg) if self.multi is None \
            else self.multi.sub_connectors[0]
        (self.multi or self.connector).bind_gpu_block_pool(self.mgr.block_pool)
        # a best-effort cache: a lost store is a later miss, so the scheduler must not wait for delivery
        assert self.connector.requires_kv_delivery is False
        self.conn = self.connector.scheduler_manager
        self.gpu_pool = self.mgr.block_pool
        self.cpu_pool = self.conn.cpu_block_pool
        # the worker role as a worker process builds it (its KV caches need CUDA: not registered)
        self.worker = SimpleCPUOffloadConnector(vc, KVConnectorRole.WORKER, kcfg)
        assert self.worker.get_aligned_num_cpu_blocks() is None  # nothing registered yet

    def match(self, req, n_computed):
        return self.connector.get_num_new_matched_tokens(req, n_computed)

    def after_alloc(self, req, n_ext):
        self.connector.update_state_after_alloc(req, self.mgr.get_blocks(req.request_id), n_ext)

    def build_meta(self, step):
        m = self.connector.build_connector_meta(vllm_scheduler_output(step))
        return (m.load_event, list(m.load_gpu_blocks), list(m.load_cpu_blocks), m.store_event,
                list(m.store_gpu_blocks), list(m.store_cpu_blocks), m.need_flush)

    def complete(self, recv, events):
        from vllm.v1.outputs import KVConnectorOutput
        self.connector.update_connector_output(KVConnectorOutput(
            finished_recving=set(recv), kv_connector_worker_meta=merged_worker_meta(events)))

    def finished(self, req, table):
        # the engine's finish; beside a non-HMA sibling it reaches the connector through
        # MultiConnector, which falls back to each child's request_finished
        (self.multi or self.connector).request_finished_all_groups(req, table)

    def reset(self) -> bool:
        return self.connector.reset_cache()

    def take_kv_events(self):
        from kvref.impl.vllm.kv_events import vllm_event_to_plain

        return [vllm_event_to_plain(e) for e in self.connector.take_events()]

    def stats(self):
        """The scheduler's interval stats through the connector's ``get_kv_connector_stats``, read
        as the logger process reads them (rebuilt from their serialized data by the class's
        ``build_kv_connector_stats``), the cumulative boundary hand-off counters
        (``get_boundary_store_stats``: a counter the reference has at zero is reported beside the
        save outcomes, so it shows as a difference) and ``has_pending_push_work`` (what the engine
        asks before it lets a finished request go)."""
        import copy
        from dataclasses import asdict

        from vllm.v1.simple_kv_offload.metrics import MetricName as M

        sent = self.connector.get_kv_connector_stats()
        values = type(self.connector).build_kv_connector_stats(data=copy.deepcopy(sent.data)).data["data"]
        outcomes = dict(values.get(M.SAVE_OUTCOMES, {}))
        outcomes.update({f"boundary.{k}": v for k, v in asdict(self.connector.get_boundary_store_stats()).items() if v})
        return ({"load_blocks": values.get(M.LOAD_BLOCKS, {}).get((), 0),
                 "used_blocks": values.get(M.USED_BLOCKS, {}).get(()),  # None where the rebuild lost it
                 "pending_store_blocks": values.get(M.PENDING_STORE_BLOCKS, {}).get(())},
                outcomes, self.connector.has_pending_push_work())


def role_answers(conn: Any, role: str, cfg: Any) -> dict[str, Any]:
    """What a built connector of ``role`` answers to the calls of the *other* role's side that
    a process may still make on it: the worker role to every scheduler-side call (a lookup, an
    allocation, metadata, completions, finishes, pending work, events, a reset, a pool binding,
    the hand-off counters, stats), the scheduler role to the worker-side questions (the pool size,
    finished transfers, the worker metadata)."""
    if role == "scheduler":
        return {"aligned_num_cpu_blocks": conn.get_aligned_num_cpu_blocks(),
                "worker_finished": conn.get_finished({"kvref-role"}), "worker_meta": conn.build_connector_worker_meta()}
    from kvref.impl.reference.offload.simple_cpu_offload_scheduler import SimpleOffloadStep
    from vllm.v1.outputs import KVConnectorOutput

    from kvref.impl.vllm.vrequest import vllm_request, vllm_sampling_params

    hasher, _, mgr = vllm_kv_cache_manager(cfg)
    req = vllm_request("kvref-role", list(range(2 * cfg.block_size + 1)), vllm_sampling_params(max_tokens=2),
                       block_hasher=hasher)
    m = conn.build_connector_meta(vllm_scheduler_output(SimpleOffloadStep()))
    return {"match": tuple(conn.get_num_new_matched_tokens(req, 0)),
            "alloc": conn.update_state_after_alloc(req, mgr.empty_kv_cache_blocks, 0),
            "meta": (m.load_event, list(m.load_gpu_blocks), list(m.load_cpu_blocks), m.store_event,
                     list(m.store_gpu_blocks), list(m.store_cpu_blocks), m.need_flush),
            "output": conn.update_connector_output(KVConnectorOutput()),
            "finished": tuple(conn.request_finished(req, [])),
            "finished_all_groups": tuple(conn.request_finished_all_groups(req, ([],))),
            "pending": conn.has_pending_push_work(), "events": list(conn.take_events()),
            "reset": conn.reset_cache(), "bind": conn.bind_gpu_block_pool(mgr.block_pool),
            "boundary_stats": conn.get_boundary_store_stats(), "stats": conn.get_kv_connector_stats()}
