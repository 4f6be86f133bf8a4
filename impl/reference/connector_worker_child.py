"""A scripted KV-connector child for the MultiConnector worker-side check (issue #22): it answers
every scheduler- and worker-side call from what the driver put in :attr:`answers` and records the
call (name and arguments, reduced to plain values) in :attr:`calls`.

The same class stands behind the reference's composition
(:mod:`kvref.impl.reference.multi_connector_worker`) and, wrapped as a ``KVConnectorBase_V1``,
behind each child of vLLM's ``MultiConnector`` (:mod:`kvref.impl.vllm.multi_connector_worker`):
with the same answers, the two sets of children must see the same calls in the same order.
"""

from __future__ import annotations

from typing import Any

from kvref.spec.errors import InvalidFieldError


class ChildShutdownError(RuntimeError):
    """What a child told to fail raises from ``shutdown`` (the composition must still shut the
    others down and re-raise the last failure)."""


class ScriptedWorkerChild:
    """One child connector's script.

    Args:
        index: the child's position in the MultiConnector's config (named in its metadata).
        kv_cache_layout, sleep_mode, piecewise_cudagraph: the child's class-level answers.

    Attributes:
        answers: the answer for each call name, set by the driver before the call; a missing
            name answers the base class's default (see :data:`DEFAULTS`).
        calls: ``(name, args)`` of every call, in order.
    """

    #: what ``KVConnectorBase_V1`` answers when a connector does not override the call
    DEFAULTS: dict[str, Any] = {"get_finished": (None, None), "get_block_ids_with_load_errors": frozenset(),
                                "get_finished_count": None, "build_connector_worker_meta": None,
                                "get_mem_pool_context": None, "get_handshake_metadata": None,
                                "request_finished": (False, None), "has_pending_push_work": False,
                                "register_finished_partial_tail": False, "shutdown": None,
                                "get_kv_connector_stats": None}

    def __init__(self, index: int, kv_cache_layout: str | None = None, sleep_mode: bool = False,
                 piecewise_cudagraph: bool = False) -> None:
        if type(index) is not int or index < 0:
            raise InvalidFieldError("index", index, "an int >= 0")
        if kv_cache_layout is not None and not isinstance(kv_cache_layout, str):
            raise InvalidFieldError("kv_cache_layout", kv_cache_layout, "None or a layout name")
        for name, value in (("sleep_mode", sleep_mode), ("piecewise_cudagraph", piecewise_cudagraph)):
            if not isinstance(value, bool):
                raise InvalidFieldError(name, value, "True or False")
        self.index = index
        #: what the child's class says from its config alone (classmethods in vLLM): the KV cache
        #: layout it needs, whether it supports sleep mode, whether it needs piecewise CUDA graphs
        self.kv_cache_layout = kv_cache_layout
        self.sleep_mode = sleep_mode
        self.piecewise_cudagraph = piecewise_cudagraph
        self.answers: dict[str, Any] = {}
        self.calls: list[tuple[str, Any]] = []
        self._step = 0

    def call(self, name: str, args: Any = ()) -> Any:
        """Record ``name(args)`` and give the scripted answer (raise it when it is an exception)."""
        self.calls.append((name, args))
        answer = self.answers.get(name, self.DEFAULTS.get(name))
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def build_connector_meta(self, finished_ids: tuple[str, ...]) -> tuple[int, int]:
        """The child's own metadata for a step: ``(child index, step number)``, so a worker child
        can say which one it was bound to."""
        self.calls.append(("build_connector_meta", finished_ids))
        self._step += 1
        return (self.index, self._step)

    def check_invariants(self) -> None:
        assert self._step >= 0 and all(isinstance(c, tuple) and len(c) == 2 for c in self.calls), \
            f"C2: step {self._step}, calls {self.calls[-3:]}"


def aggregate_worker_meta(a: tuple, b: tuple) -> tuple:
    """The scripted child's worker-metadata ``aggregate`` (ranks' items concatenated, in order)."""
    return tuple(a) + tuple(b)


def aggregate_stats(a: dict, b: dict) -> dict:
    """The scripted child's transfer-stats ``aggregate``: counters summed by name."""
    return {k: a.get(k, 0) + b.get(k, 0) for k in sorted(set(a) | set(b))}


__all__ = ["ChildShutdownError", "ScriptedWorkerChild", "aggregate_stats", "aggregate_worker_meta"]
