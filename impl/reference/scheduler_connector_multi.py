"""vLLM 0.33.0's ``MultiConnector`` composition over scripted connectors (e.g. an offloading
connector beside a P/D transfer connector), for the reference scheduler.

The rules, as ``kv_connector/v1/multi_connector.py`` applies them on the scheduler side:

* lookup: every child is asked in order; a child that cannot answer yet (``None``) makes the
  whole answer ``None`` (children after it are not asked); the *first* child with a positive hit
  is chosen to load the request, the others' hits are ignored;
* allocation: the chosen child gets the external tokens, every other child the same blocks with 0;
* ``get_loaded_kv_cache_group_ids``: the chosen child's answer;
* ``on_new_request``, ``build_connector_meta``, ``update_connector_output``: every child;
* ``request_finished``: every child; the blocks stay while *any* child still sends them;
* ``has_pending_block_frees``: any child (stops at the first that says True);
* ``requires_kv_delivery``: any child; ``supports_divergent_local_hybrid_hits``: all children;
* ``reset_cache``: every child is reset; a success unless a child answered False.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvref.spec.errors import InvalidFieldError

from .scheduler_connector import BlockIdsT, ConnectorConfig, KVConnectorOutput, SchedulerConnector, ScriptedConnector


class MultiScriptedConnector(SchedulerConnector):
    """The ``MultiConnector`` rules over :class:`ScriptedConnector` children (same interface as one).

    Args:
        children: the child connectors, in config order (at least one).
        config: the MultiConnector's own ``kv_transfer_config`` (role, failure policy); its
            ``requires_kv_delivery`` and ``divergent_local_hybrid_hits`` follow the children.
    """

    def __init__(self, children: Sequence[ScriptedConnector], config: ConnectorConfig | None = None) -> None:
        if isinstance(children, (str, bytes)) or not isinstance(children, Sequence) or not children:
            raise InvalidFieldError("children", children, "a non-empty list of ScriptedConnectors")
        for c in children:
            if not isinstance(c, ScriptedConnector):
                raise InvalidFieldError("children[i]", c, "a ScriptedConnector")
        base = children[0].config if config is None else config
        if not isinstance(base, ConnectorConfig):
            raise InvalidFieldError("config", config, "a ConnectorConfig or None")
        self.children = list(children)
        for c in self.children:  # the fake world: siblings know each other's loads in flight
            c.siblings = self.children
        self.config = ConnectorConfig(
            kv_role=base.kv_role, kv_load_failure_policy=base.kv_load_failure_policy,
            requires_kv_delivery=any(c.config.delivery for c in children),
            divergent_local_hybrid_hits=all(c.config.divergent_local_hybrid_hits for c in children),
            hisparse_host_pool=base.hisparse_host_pool)
        self.requests_to_connector: dict[str, int] = {}

    # ---- what a driver reads (merged over the children) ----------------------------------------
    @property
    def calls(self) -> list[list[tuple]]:
        return [c.calls for c in self.children]

    @property
    def pending_loads(self) -> dict:
        return {rid: load for c in self.children for rid, load in c.pending_loads.items()}

    @property
    def sync_loads(self) -> list:
        return [s for c in self.children for s in c.sync_loads]

    @property
    def pending_sends(self) -> dict[str, None]:
        return {rid: None for c in self.children for rid in c.pending_sends}

    # ---- the scheduler-side API ------------------------------------------------------------------
    def on_new_request(self, request_id: str) -> None:
        for c in self.children:
            c.on_new_request(request_id)

    def get_num_new_matched_tokens(self, request_id: str, num_tokens: int,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        answer: tuple[int | None, bool] = (0, False)
        for i, c in enumerate(self.children):
            toks, load_async = c.get_num_new_matched_tokens(request_id, num_tokens, num_computed_tokens)
            if toks is None:
                return None, False
            if answer[0] == 0 and toks > 0:
                self.requests_to_connector[request_id] = i
                answer = (toks, load_async)
        return answer

    def get_loaded_kv_cache_group_ids(self, request_id: str, transfer_group_ids: tuple[int, ...],
                                      prefix_cacheable_group_ids: tuple[int, ...]) -> tuple[int, ...]:
        """vLLM ``MultiConnector.get_loaded_kv_cache_group_ids``: the answer of the child chosen to
        load the request (a request no child chose is a ``KeyError``, as in vLLM)."""
        child = self.children[self.requests_to_connector[request_id]]
        return child.get_loaded_kv_cache_group_ids(request_id, transfer_group_ids, prefix_cacheable_group_ids)

    def update_state_after_alloc(self, request_id: str, block_ids: BlockIdsT, num_external_tokens: int) -> None:
        chosen = self.requests_to_connector.get(request_id, -1)
        for i, c in enumerate(self.children):
            c.update_state_after_alloc(request_id, block_ids, num_external_tokens if i == chosen else 0)

    def build_connector_meta(self, scheduled_ids: tuple[str, ...], finished_ids: tuple[str, ...]) -> None:
        for c in self.children:
            c.build_connector_meta(scheduled_ids, finished_ids)

    def request_finished(self, request_id: str, block_ids: BlockIdsT) -> bool:
        saves = [c.request_finished(request_id, block_ids) for c in self.children]
        self.requests_to_connector.pop(request_id, None)
        return any(saves)

    def update_connector_output(self, out: KVConnectorOutput) -> None:
        for c in self.children:
            c.update_connector_output(out)

    def has_pending_block_frees(self) -> bool:
        return any(c.has_pending_block_frees() for c in self.children)

    def reset_cache(self) -> bool:
        results = [c.reset_cache() is not False for c in self.children]
        return all(results)

    def shutdown(self) -> None:
        """vLLM ``MultiConnector.shutdown``: every child in order."""
        for c in self.children:
            c.shutdown()

__all__ = ["MultiScriptedConnector"]
