"""vLLM 0.33.0's ``MultiConnector`` in both roles — one SCHEDULER instance and one WORKER instance
per tensor-parallel rank — over children that are kvref's
:class:`~kvref.impl.reference.connector_worker_child.ScriptedWorkerChild` behind vLLM's
``KVConnectorBase_V1`` (issue #22).

vLLM builds the children itself from ``kv_connector_extra_config["connectors"]`` (each naming
:data:`CLASS_NAME` in this module and a script key), so its own config handling, metadata
plumbing, worker-side merging (``get_transfer_results`` with the extra async saves,
``build_connector_worker_meta``, ``get_finished_count``, …) and ``KVOutputAggregator`` run as in
an engine. Every call a child gets is recorded by its script with plain-valued arguments, as the
reference's children record theirs; nothing here needs a GPU (the KV caches are CPU tensors that
the children only name).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from kvref.impl.reference.connector_worker_child import ScriptedWorkerChild, aggregate_stats

from .loader import load_vllm

MODULE_PATH = __name__
CLASS_NAME = "KvrefWorkerScriptConnector"
_SCRIPTS: dict[str, ScriptedWorkerChild] = {}


def nothing_to_log(data: dict) -> bool:
    """The scripted child rebuilds no stats from a serialized interval without jobs."""
    return not data.get("jobs")
_ids = itertools.count()


def _register(script: ScriptedWorkerChild) -> str:
    key = f"kvref-worker-{next(_ids)}"
    _SCRIPTS[key] = script
    return key


def multi_connector_config(children: list[ScriptedWorkerChild], world_size: int = 1) -> Any:
    """A ``VllmConfig`` selecting vLLM's ``MultiConnector`` over one scripted child per script."""
    from vllm.config import KVTransferConfig

    from .offload_worker import base_vllm_config

    base = base_vllm_config()
    vc = copy.copy(base)
    vc.parallel_config = copy.copy(base.parallel_config)
    vc.parallel_config.tensor_parallel_size = world_size
    vc.parallel_config.world_size = world_size
    vc.kv_transfer_config = KVTransferConfig(
        kv_connector="MultiConnector", kv_role="kv_both", engine_id="kvref-multi",
        kv_connector_extra_config={"connectors": [
            dict(kv_connector=CLASS_NAME, kv_connector_module_path=MODULE_PATH, kv_role="kv_both",
                 kv_connector_extra_config={"kvref_worker_script": _register(c), "kvref_layout": c.kv_cache_layout,
                                            "kvref_sleep": c.sleep_mode, "kvref_piecewise": c.piecewise_cudagraph})
            for c in children]})
    return vc


@contextlib.contextmanager
def quiet(*modules: str):
    """vLLM's log lines from ``modules`` held back: every connector built logs an "experimental
    API" warning, and ``MultiConnector.shutdown`` logs each failing child's traceback, which the
    check provokes on purpose and compares."""
    loggers = [logging.getLogger(m) for m in modules]
    before = [lg.disabled for lg in loggers]
    for lg in loggers:
        lg.disabled = True
    try:
        yield
    finally:
        for lg, was in zip(loggers, before):
            lg.disabled = was


_V1 = "vllm.distributed.kv_transfer.kv_connector.v1"


def build_multi_connector(children: list[ScriptedWorkerChild], role: str, world_size: int = 1) -> Any:
    """vLLM's ``MultiConnector`` in ``role`` ("scheduler" or "worker") over ``children``."""
    load_vllm()
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    roles = {"scheduler": KVConnectorRole.SCHEDULER, "worker": KVConnectorRole.WORKER}
    with quiet(f"{_V1}.base"):
        multi = MultiConnector(multi_connector_config(children, world_size), roles[role], None)
    assert [c.script for c in multi.sub_connectors] == children
    return multi


def class_answers(multi) -> tuple:
    """What vLLM's ``MultiConnector`` class says from the config alone: ``(required KV cache layout
    or the refusal, supports sleep mode, requires piecewise CUDA graphs)``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    ktc = multi._vllm_config.kv_transfer_config
    try:
        layout = MultiConnector.get_required_kvcache_layout(multi._vllm_config)
    except ValueError:
        layout = ValueError
    return (layout, MultiConnector.supports_sleep_mode(ktc),
            MultiConnector.requires_piecewise_for_cudagraph(ktc.kv_connector_extra_config))


def shutdown(multi) -> None:
    """``multi.shutdown()`` without the tracebacks it logs for the children that fail."""
    with quiet(f"{_V1}.multi_connector"):
        multi.shutdown()


def block_pool(num_blocks: int) -> Any:
    """A GPU ``BlockPool`` of vLLM's for the scheduler to bind (the children only read its size)."""
    load_vllm()
    from vllm.v1.core.block_pool import BlockPool

    return BlockPool(num_blocks, enable_caching=True, hash_block_size=4)


def scheduler_output(finished_ids) -> Any:
    """What a child's ``build_connector_meta`` reads of the step (the requests finished since)."""
    return SimpleNamespace(finished_req_ids=set(finished_ids), num_scheduled_tokens={})


def request(request_id: str) -> Any:
    return SimpleNamespace(request_id=request_id)


def multi_metadata(meta) -> tuple[tuple, dict | None]:
    """vLLM's ``MultiKVConnectorMetadata`` as the reference writes it: the children's tags and the
    extra async saves."""
    return tuple(m.tag for m in meta.metadata), (dict(meta.extra_async_saves) if meta.extra_async_saves else None)


def worker_meta_items(meta) -> tuple | None:
    """vLLM's ``MultiKVConnectorWorkerMetadata`` as plain tuples (a child's entry: its items)."""
    if meta is None:
        return None
    return tuple(None if m is None else m.items for m in meta.metadata)


def multi_stats(stats) -> dict | None:
    """vLLM's ``MultiKVConnectorStats`` as the reference writes it (kind -> counters)."""
    if stats is None:
        return None
    return {("scripted" if k == CLASS_NAME else k): dict(v.data) for k, v in stats.data.items()}


def rebuilt_stats(stats) -> Any:
    """What the logging side rebuilds from a worker's stats (``MultiConnector.build_kv_connector_stats``)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    return MultiConnector.build_kv_connector_stats(data=None if stats is None else dict(stats.data))


def stats_payload(stats) -> dict | None:
    """What the scheduler puts in ``SchedulerStats.kv_connector_stats`` for the logger process:
    ``MultiKVConnectorStats.to_dict()`` (connector class name -> that child's serialized stats)."""
    return None if stats is None else stats.to_dict()


def register_child_class() -> None:
    """The scripted child registered with vLLM's ``KVConnectorFactory`` under its class name, as a
    plugin registers itself, so the logging side can rebuild its serialized stats by name
    (``MultiConnector.build_kv_connector_stats``). Once per process."""
    load_vllm()
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CLASS_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CLASS_NAME, MODULE_PATH, CLASS_NAME)


def connector_logging(multi) -> Any:
    """vLLM's logger-side ``KVConnectorLogging`` for ``multi``'s config (it resolves MultiConnector)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    register_child_class()
    return KVConnectorLogging(multi._vllm_config.kv_transfer_config)


def connector_prom(multi, num_engines: int, children: list[dict] | None = None) -> Any:
    """vLLM's ``KVConnectorProm`` for ``multi``'s config (``MultiConnector.build_prom_metrics``
    with prometheus_client's metric types), its children replaced by ``children`` if given;
    returns it and the scripted child metrics it built."""
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    vc = multi._vllm_config
    if children is not None:
        vc = copy.copy(vc)
        vc.kv_transfer_config = _with_children(vc.kv_transfer_config, children)
    before = len(PROM_BUILT)
    prom = KVConnectorProm(vc, ["model_name", "engine"], {i: ["kvref", str(i)] for i in range(num_engines)})
    return prom, PROM_BUILT[before:]


def _with_children(ktc, children: list[dict]) -> Any:
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both", engine_id=ktc.engine_id,
                            kv_connector_extra_config={"connectors": children})


def children_support_hma(multi, extra: list[dict] | None) -> bool:
    """``MultiConnector.all_children_support_hma`` for ``multi``'s config with its children
    replaced by ``extra`` (None: as configured)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    ktc = multi._vllm_config.kv_transfer_config
    if extra is not None:
        ktc = _with_children(ktc, extra)
    return MultiConnector.all_children_support_hma(ktc)


#: every child Prometheus-metrics object vLLM asked the scripted class to build, in order
PROM_BUILT: list[Any] = []


def model_runner_output(sending, recving, invalid, worker_meta, stats=None) -> Any:
    """One rank's ``ModelRunnerOutput`` carrying its ``KVConnectorOutput`` (for
    ``KVOutputAggregator``)."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    return ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=KVConnectorOutput(
        finished_sending=set(sending or ()) or None, finished_recving=set(recving or ()) or None,
        invalid_block_ids=set(invalid), kv_connector_worker_meta=worker_meta, kv_connector_stats=stats))


def kv_output_aggregator(connector, world_size: int) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

    return KVOutputAggregator.from_connector(connector, world_size)


def _make_class():
    load_vllm()
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorWorkerMetadata,
        SupportsHMA,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

    class _ChildMeta(KVConnectorMetadata):
        def __init__(self, tag) -> None:
            self.tag = tag

    class _ChildWorkerMeta(KVConnectorWorkerMetadata):
        def __init__(self, items: tuple) -> None:
            self.items = tuple(items)

        def aggregate(self, other):
            return _ChildWorkerMeta(self.items + other.items)

    @dataclass
    class _ChildStats(KVConnectorStats):
        def aggregate(self, other):
            return _ChildStats(data=aggregate_stats(self.data, other.data))

        def reduce(self):
            return dict(self.data)

        def reset(self):
            self.data = {}

        def is_empty(self):
            return not any(self.data.values())

    class _ChildProm(KVConnectorPromMetrics):
        """Records what the metrics endpoint is asked to observe (no Prometheus series made)."""

        def __init__(self, *args) -> None:
            super().__init__(*args)
            self.observed: list[tuple[dict, int]] = []

        def observe(self, transfer_stats_data, engine_idx: int = 0):
            self.observed.append((dict(transfer_stats_data), engine_idx))

    class KvrefWorkerScriptConnector(KVConnectorBase_V1, SupportsHMA):
        """Every call recorded by, and answered from, the registered script."""

        def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
            super().__init__(vllm_config, role, kv_cache_config)
            self.script: ScriptedWorkerChild = _SCRIPTS.pop(
                self._kv_transfer_config.kv_connector_extra_config["kvref_worker_script"])

        # ---- from the config alone ---------------------------------------------------------------
        @classmethod
        def get_required_kvcache_layout(cls, vllm_config):
            return vllm_config.kv_transfer_config.kv_connector_extra_config.get("kvref_layout")

        @classmethod
        def supports_sleep_mode(cls, kv_transfer_config) -> bool:
            return bool(kv_transfer_config.kv_connector_extra_config.get("kvref_sleep"))

        @classmethod
        def requires_piecewise_for_cudagraph(cls, extra_config) -> bool:
            return bool(extra_config.get("kvref_piecewise"))

        @classmethod
        def build_kv_connector_stats(cls, data=None):
            """The logger's rebuild of this child's serialized stats: nothing to log for an
            interval without jobs (kvref's child; :func:`nothing_to_log`)."""
            if data is None:
                return _ChildStats()
            return None if nothing_to_log(data) else _ChildStats(data=dict(data))

        @classmethod
        def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
            prom = _ChildProm(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            PROM_BUILT.append(prom)
            return prom

        # ---- scheduler side ----------------------------------------------------------------------
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return 0, False

        def update_state_after_alloc(self, request, blocks, num_external_tokens) -> None:
            return None

        def build_connector_meta(self, scheduler_output):
            return _ChildMeta(self.script.build_connector_meta(tuple(sorted(scheduler_output.finished_req_ids))))

        def request_finished(self, request, block_ids):
            return self.script.call("request_finished", request.request_id)

        def request_finished_all_groups(self, request, block_ids):
            return self.script.call("request_finished", request.request_id)

        def update_connector_output(self, connector_output) -> None:
            meta = connector_output.kv_connector_worker_meta
            self.script.call("update_connector_output", (tuple(sorted(connector_output.finished_sending or ())),
                                                         None if meta is None else meta.items))

        def has_pending_push_work(self) -> bool:
            return self.script.call("has_pending_push_work")

        def register_finished_partial_tail(self, request, block_ids, partial_tail_offloads) -> bool:
            return self.script.call("register_finished_partial_tail", request.request_id)

        def get_handshake_metadata(self):
            return self.script.call("get_handshake_metadata")

        # ---- worker side -------------------------------------------------------------------------
        def bind_connector_metadata(self, connector_metadata) -> None:
            super().bind_connector_metadata(connector_metadata)
            self.script.call("bind_connector_metadata", connector_metadata.tag)

        def clear_connector_metadata(self) -> None:
            super().clear_connector_metadata()
            self.script.call("clear_connector_metadata")

        def handle_preemptions(self, kv_connector_metadata) -> None:
            self.script.call("handle_preemptions", kv_connector_metadata.tag)

        def register_kv_caches(self, kv_caches) -> None:
            self.script.call("register_kv_caches", tuple(sorted(kv_caches)))

        def unregister_kv_caches(self) -> None:
            self.script.call("unregister_kv_caches")

        def restore_kv_caches(self) -> None:
            self.script.call("restore_kv_caches")

        def set_host_xfer_buffer_ops(self, copy_operation) -> None:
            self.script.call("set_host_xfer_buffer_ops", copy_operation.__name__)

        def set_xfer_handshake_metadata(self, metadata) -> None:
            self.script.call("set_xfer_handshake_metadata", tuple(sorted(metadata.items())))

        def set_xfer_handshake_metadata_pp_aware(self, metadata) -> None:
            self.script.call("set_xfer_handshake_metadata_pp_aware", tuple(sorted(metadata.items())))

        def bind_gpu_block_pool(self, gpu_block_pool) -> None:
            self.script.call("bind_gpu_block_pool", gpu_block_pool.num_gpu_blocks)

        def start_load_kv(self, forward_context, **kwargs) -> None:
            self.script.call("start_load_kv", forward_context)

        def wait_for_layer_load(self, layer_name: str) -> None:
            self.script.call("wait_for_layer_load", layer_name)

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
            self.script.call("save_kv_layer", (layer_name, tuple(kv_layer.shape)))

        def wait_for_save(self) -> None:
            self.script.call("wait_for_save")

        def finish_forward(self) -> None:
            self.script.call("finish_forward")

        def reset_capture_state(self) -> None:
            self.script.call("reset_capture_state")

        def get_finished(self, finished_req_ids):
            sending, recving = self.script.call("get_finished", tuple(sorted(finished_req_ids)))
            return (None if sending is None else set(sending)), (None if recving is None else set(recving))

        def get_block_ids_with_load_errors(self) -> set[int]:
            return set(self.script.call("get_block_ids_with_load_errors"))

        def get_finished_count(self):
            return self.script.call("get_finished_count")

        def build_connector_worker_meta(self):
            items = self.script.call("build_connector_worker_meta")
            return None if items is None else _ChildWorkerMeta(items)

        def get_kv_connector_stats(self):
            stats = self.script.call("get_kv_connector_stats")
            return None if stats is None else _ChildStats(data=dict(stats))

        def get_mem_pool_context(self):
            return self.script.call("get_mem_pool_context")

        def shutdown(self) -> None:
            self.script.call("shutdown")

    return KvrefWorkerScriptConnector


def __getattr__(name: str):
    # vLLM's factory does getattr(module, kv_connector): build the class (importing vLLM) on demand
    if name == CLASS_NAME:
        cls = _make_class()
        globals()[CLASS_NAME] = cls
        return cls
    raise AttributeError(name)
