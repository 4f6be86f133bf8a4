"""kvref's scripted KV connector inside vLLM 0.33.0: a ``KVConnectorBase_V1`` that vLLM's own
``Scheduler`` builds from its ``kv_transfer_config`` and calls exactly as it calls NIXL, LMCache or
the offloading connector.

vLLM resolves the class by ``kv_connector`` name from ``kv_connector_module_path`` (this module)
through ``KVConnectorFactory.create_connector(role=SCHEDULER)``. Every scheduler-side call is
forwarded, with vLLM's objects turned into ids and block-id tuples, to a
:class:`kvref.impl.reference.scheduler_connector.ScriptedConnector` — the very class the
reference scheduler calls — registered under ``kv_connector_extra_config["kvref_script"]``. The
trace therefore drives both schedulers with the same connector answers, and the two call logs
(name and arguments, in order) must be equal. Worker-side methods are never called: the scheduler
is driven without a model runner; the driver hands the worker's report to ``update_from_output``
as ``ModelRunnerOutput.kv_connector_output`` (:func:`to_vllm_output`).
"""

from __future__ import annotations

import itertools
from typing import Any

from kvref.impl.reference.scheduler_connector import KVConnectorOutput, ScriptedConnector

from .loader import load_vllm

MODULE_PATH = __name__
CLASS_NAME = "KvrefScriptedConnector"
#: the same connector without vLLM's ``SupportsHMA`` (``ConnectorConfig.supports_hma=False``): the
#: scheduler then hands ``request_finished`` the single group's block ids
CLASS_NAME_NO_HMA = "KvrefScriptedConnectorNoHMA"
_SCRIPTS: dict[str, ScriptedConnector] = {}
_ids = itertools.count()


def register_script(script: ScriptedConnector) -> str:
    """Make ``script`` the behaviour of the next connector built with the returned key."""
    key = f"kvref-{next(_ids)}"
    _SCRIPTS[key] = script
    return key


def _child(script: ScriptedConnector) -> dict:
    name = CLASS_NAME if script.config.supports_hma else CLASS_NAME_NO_HMA
    return dict(kv_connector=name, kv_connector_module_path=MODULE_PATH, kv_role=script.config.kv_role,
                kv_load_failure_policy=script.config.kv_load_failure_policy,
                kv_connector_extra_config={"kvref_script": register_script(script)})


def kv_transfer_config(script):
    """vLLM's ``KVTransferConfig`` selecting :class:`KvrefScriptedConnector` with ``script``, or
    vLLM's own ``MultiConnector`` over one per child of a
    :class:`~kvref.impl.reference.scheduler_connector_multi.MultiScriptedConnector`."""
    load_vllm()
    from vllm.config import KVTransferConfig

    from kvref.impl.reference.scheduler_connector_multi import MultiScriptedConnector

    if isinstance(script, MultiScriptedConnector):
        cfg = script.config
        return KVTransferConfig(kv_connector="MultiConnector", kv_role=cfg.kv_role,
                                kv_load_failure_policy=cfg.kv_load_failure_policy,
                                kv_connector_extra_config={"connectors": [_child(c) for c in script.children]})
    return KVTransferConfig(**_child(script))


def to_vllm_output(out: KVConnectorOutput | None):
    """kvref's report -> vLLM's ``KVConnectorOutput`` (sets built from the tuples in order, as
    the reference builds them, so both iterate them alike)."""
    from vllm.v1.outputs import KVConnectorOutput as VOut

    out = out or KVConnectorOutput()
    return VOut(finished_sending=set(out.finished_sending), finished_recving=set(out.finished_recving),
                failed_recving=set(out.failed_recving), invalid_block_ids=set(out.invalid_block_ids))


def _block_ids(blocks) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(b) for b in g) for g in blocks)


def _make_class():
    load_vllm()
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        SupportsHMA,
    )

    class _Meta(KVConnectorMetadata):
        pass

    class _Forwarding:
        """Scheduler-side calls forwarded to the registered :class:`ScriptedConnector`."""

        def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
            super().__init__(vllm_config, role, kv_cache_config)
            key = self._kv_transfer_config.kv_connector_extra_config["kvref_script"]
            self.script: ScriptedConnector = _SCRIPTS.pop(key)

        @property
        def requires_kv_delivery(self) -> bool:
            return self.script.config.delivery

        @property
        def supports_divergent_local_hybrid_hits(self) -> bool:
            return self.script.config.divergent_local_hybrid_hits

        def on_new_request(self, request) -> None:
            self.script.on_new_request(request.request_id)

        def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
            return self.script.get_num_new_matched_tokens(request.request_id, request.num_tokens,
                                                          num_computed_tokens)

        def get_loaded_kv_cache_group_ids(self, request) -> tuple[int, ...]:
            # the script picks between vLLM's two answers: a P/D transfer's transfer groups, or the
            # base default's prefix-cacheable groups (a hash-addressed store holds no window)
            cfg = self._kv_cache_config
            return self.script.get_loaded_kv_cache_group_ids(request.request_id, tuple(cfg.transfer_group_ids),
                                                             tuple(cfg.prefix_cacheable_group_ids))

        def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
            self.script.update_state_after_alloc(request.request_id, _block_ids(blocks.get_block_ids()),
                                                 num_external_tokens)

        def build_connector_meta(self, scheduler_output) -> Any:
            self.script.build_connector_meta(tuple(scheduler_output.num_scheduled_tokens),
                                             tuple(sorted(scheduler_output.finished_req_ids)))
            return _Meta()

        def request_finished(self, request, block_ids):
            return self.request_finished_all_groups(request, (block_ids,))

        def request_finished_all_groups(self, request, block_ids):
            return self.script.request_finished(request.request_id, _block_ids(block_ids)), None

        def update_connector_output(self, connector_output) -> None:
            self.script.update_connector_output(KVConnectorOutput(
                finished_sending=tuple(connector_output.finished_sending or ()),
                finished_recving=tuple(connector_output.finished_recving or ()),
                failed_recving=tuple(connector_output.failed_recving or ()),
                invalid_block_ids=tuple(connector_output.invalid_block_ids or ())))

        def has_pending_block_frees(self) -> bool:
            return self.script.has_pending_block_frees()

        def reset_cache(self) -> bool | None:
            return self.script.reset_cache()

        def shutdown(self) -> None:
            self.script.shutdown()

        # ---- worker side: never called (no model runner) ----------------------------------------
        def start_load_kv(self, forward_context, **kwargs) -> None:
            raise NotImplementedError("kvref's scripted connector has no worker side")

        def wait_for_layer_load(self, layer_name: str) -> None:
            raise NotImplementedError("kvref's scripted connector has no worker side")

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
            raise NotImplementedError("kvref's scripted connector has no worker side")

        def wait_for_save(self) -> None:
            raise NotImplementedError("kvref's scripted connector has no worker side")

    class KvrefScriptedConnector(_Forwarding, KVConnectorBase_V1, SupportsHMA):
        """kvref's scripted connector as vLLM's scheduler sees it (hybrid-allocator aware)."""

    class KvrefScriptedConnectorNoHMA(_Forwarding, KVConnectorBase_V1):
        """The same forwarding without ``SupportsHMA`` (single-group pools only, as vLLM requires)."""

    return KvrefScriptedConnector, KvrefScriptedConnectorNoHMA


def __getattr__(name: str):
    # vLLM's factory does getattr(module, kv_connector): build the classes (importing vLLM) on demand
    if name in (CLASS_NAME, CLASS_NAME_NO_HMA):
        globals()[CLASS_NAME], globals()[CLASS_NAME_NO_HMA] = _make_class()
        return globals()[name]
    raise AttributeError(name)
