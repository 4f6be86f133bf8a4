"""What a recording scheduler's KV connector answered: the ``kv`` lists of a run trace (format 4).

A run with a KV connector (offloading, NIXL/P2P, LMCache, vLLM's ``MultiConnector``, any
``KVConnectorBase_V1``) cannot be replayed from the scheduler's calls alone: how many tokens the
external store held, whether a load ran asynchronously, whether the connector kept a finished
request's blocks — only the connector knew (issue #28). :class:`ConnectorTap` wraps the
scheduler-role methods of the connector vLLM's ``Scheduler`` built (on the instance: vLLM's code
and the connector's run unchanged) and logs, in call order, each question and answer:

* ``get_num_new_matched_tokens`` -> ``["m", id, local tokens asked, external tokens or None, async, kids]``
* ``update_state_after_alloc`` -> ``["a", id, block ids per group, external tokens, kids]``
* ``request_finished`` / ``request_finished_all_groups`` -> ``["f", id, block ids per group, delay,
  kv_transfer_params keys or None, kids]``
* ``has_pending_block_frees`` -> ``["p", answer]``; ``reset_cache`` -> ``["r", answer]``
* ``get_loaded_kv_cache_group_ids`` asked by vLLM's ``_load_restores_replay_window`` (SWA bounded
  replay, session 20) -> ``["w", id, group ids]``

``kids`` holds, for vLLM's ``MultiConnector``, what each child answered or was given (the replay
checks the composition rules against them), else None. The recorder attaches the log to the record
of the scheduler call during which the connector was asked (:meth:`ConnectorTap.take`).
"""

from __future__ import annotations

from typing import Any

from kvref.spec.errors import InvalidFieldError


def _groups(block_ids) -> list[list[int]]:
    """Block ids per group as plain int lists (a single group's list, or a tuple of them)."""
    if block_ids and not isinstance(block_ids[0], (list, tuple)):
        return [[int(b) for b in block_ids]]
    return [[int(b) for b in g] for g in block_ids]


def connector_header(scheduler) -> dict:
    """The header's ``connector``: what the replay's connector config needs."""
    vc = scheduler.vllm_config
    ktc = vc.kv_transfer_config
    conn = scheduler.connector
    kids = list(getattr(conn, "_connectors", None) or [])
    return {"kv_role": str(ktc.kv_role), "kv_load_failure_policy": str(ktc.kv_load_failure_policy),
            "requires_kv_delivery": bool(getattr(scheduler, "requires_kv_delivery", False)),
            "divergent_local_hybrid_hits": bool(getattr(conn, "supports_divergent_local_hybrid_hits", False)),
            # a HiSparse host pool: with deferred frees, vLLM defers async loads behind the steps in
            # flight too (defer_async_loads); replayed since session 20 (#28)
            "hisparse_host_pool": getattr(scheduler.kv_cache_config, "hisparse_host_num_blocks", None) is not None,
            "classes": [type(conn).__name__] + [type(c).__name__ for c in kids]}


class ConnectorTap:
    """Logs a connector's scheduler-side answers (see the module docstring).

    Args:
        connector: the ``KVConnectorBase_V1`` instance vLLM's scheduler calls.
        rename: maps a request id to the one the trace writes (the anonymizer's, or identity).
    """

    def __init__(self, connector: Any, rename=None) -> None:
        if connector is None:
            raise InvalidFieldError("connector", connector, "a KV connector instance")
        self.connector = connector
        self.rename = rename or (lambda rid: rid)
        self.log: list[list] = []
        self.children = list(getattr(connector, "_connectors", None) or [])
        self._kids: list | None = None  # the children's answers during one top-level call
        self._finishing = False  # inside a wrapped request_finished* (one may call the other)
        #: inside vLLM's _load_restores_replay_window: get_loaded_kv_cache_group_ids is logged (session 20)
        self.window_query = False
        self._wrap_top()
        for child in self.children:
            self._wrap_child(child)

    def take(self) -> list[list]:
        """The log since the last take (and a fresh one)."""
        log, self.log = self.log, []
        return log

    def _wrap_top(self) -> None:
        c = self.connector
        matched, alloc = c.get_num_new_matched_tokens, c.update_state_after_alloc
        tap = self

        def get_num_new_matched_tokens(request, num_computed_tokens):
            tap._kids = [] if tap.children else None
            try:
                toks, load_async = matched(request, num_computed_tokens)
            finally:
                kids, tap._kids = tap._kids, None
            tap.log.append(["m", tap.rename(request.request_id), int(num_computed_tokens),
                            None if toks is None else int(toks), bool(load_async), kids])
            return toks, load_async

        def update_state_after_alloc(request, blocks, num_external_tokens):
            tap._kids = [] if tap.children else None
            try:
                out = alloc(request, blocks, num_external_tokens)
            finally:
                kids, tap._kids = tap._kids, None
            tap.log.append(["a", tap.rename(request.request_id), _groups(blocks.get_block_ids()),
                            int(num_external_tokens), kids])
            return out

        def finished(orig):
            def request_finished(request, block_ids):
                if tap._finishing:
                    return orig(request, block_ids)
                tap._finishing = True
                tap._kids = [] if tap.children else None
                try:
                    delay, params = orig(request, block_ids)
                finally:
                    tap._finishing = False
                    kids, tap._kids = tap._kids, None
                # (an empty block_ids is a non-HMA connector's single group, request_finished(request, []))
                tap.log.append(["f", tap.rename(request.request_id), _groups(block_ids) if len(block_ids) else [[]],
                                bool(delay),
                                sorted(params) if isinstance(params, dict) else None, kids])
                return delay, params
            return request_finished

        def answer(kind, orig):
            def call():
                out = orig()
                tap.log.append([kind, out if out in (True, False, None) else bool(out)])
                return out
            return call

        _install(c, get_num_new_matched_tokens, update_state_after_alloc, finished)
        c.has_pending_block_frees = answer("p", c.has_pending_block_frees)
        c.reset_cache = answer("r", c.reset_cache)
        loaded = getattr(c, "get_loaded_kv_cache_group_ids", None)
        if loaded is not None:
            def get_loaded_kv_cache_group_ids(request):
                out = loaded(request)
                if tap.window_query:
                    tap.log.append(["w", tap.rename(request.request_id), sorted(int(g) for g in out)])
                return out
            c.get_loaded_kv_cache_group_ids = get_loaded_kv_cache_group_ids

    def _wrap_child(self, child) -> None:
        """A ``MultiConnector`` child: its answers go to the top-level entry's ``kids``."""
        tap = self
        matched, alloc = child.get_num_new_matched_tokens, child.update_state_after_alloc

        def get_num_new_matched_tokens(request, num_computed_tokens):
            toks, load_async = matched(request, num_computed_tokens)
            if tap._kids is not None:
                tap._kids.append([None if toks is None else int(toks), bool(load_async)])
            return toks, load_async

        def update_state_after_alloc(request, blocks, num_external_tokens):
            if tap._kids is not None:
                tap._kids.append(int(num_external_tokens))
            return alloc(request, blocks, num_external_tokens)

        state = {"in": False}  # shared: one request_finished* may call the other

        def finished(orig):
            def request_finished(request, block_ids):
                if state["in"]:
                    return orig(request, block_ids)
                state["in"] = True
                try:
                    delay, params = orig(request, block_ids)
                finally:
                    state["in"] = False
                if tap._kids is not None:
                    tap._kids.append(bool(delay))
                return delay, params
            return request_finished

        _install(child, get_num_new_matched_tokens, update_state_after_alloc, finished)

    def check_invariants(self) -> None:
        assert self._kids is None and not self._finishing, "a connector call still open between scheduler calls"


def _install(connector, get_num_new_matched_tokens, update_state_after_alloc, finished) -> None:
    """Put a tap's wrappers on a connector (the top-level one or a ``MultiConnector`` child): the
    two lookup/allocation calls replaced, and both ``request_finished`` hooks (the per-group one
    when the connector has it) wrapped by ``finished``."""
    connector.get_num_new_matched_tokens = get_num_new_matched_tokens
    connector.update_state_after_alloc = update_state_after_alloc
    connector.request_finished = finished(connector.request_finished)
    if hasattr(connector, "request_finished_all_groups"):
        connector.request_finished_all_groups = finished(connector.request_finished_all_groups)


__all__ = ["ConnectorTap", "connector_header"]
