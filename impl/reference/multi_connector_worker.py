"""vLLM 0.33.0's ``MultiConnector`` (``kv_connector/v1/multi_connector.py``) on both sides of one
step, over :class:`~kvref.impl.reference.connector_worker_child.ScriptedWorkerChild` children:
the rules a worker process relies on, beside the scheduler-side lookup rules of
:mod:`kvref.impl.reference.scheduler_connector_multi`.

* ``request_finished``: every child is asked; the request waits for its blocks if *any* child
  saves asynchronously, and each saving child beyond the first is an *extra async save*; the
  children's ``kv_transfer_params`` are merged, a key given twice is an error (RuntimeError);
* ``build_connector_meta``: every child's metadata, in config order, plus the extra saves counted
  since the last step (then forgotten on the scheduler side);
* worker: ``bind_connector_metadata`` hands child i its own metadata and adds the extra saves to
  the worker's count; every forward-pass hook goes to every child in order;
* ``get_transfer_results``: loads finished / failed are the union over the children; a request a
  child finished sending is reported only once no extra save of it is outstanding — each report
  while one is outstanding uses one up. Without this a request saved by two children is freed when
  the *first* save ends (the blocks reused while the second still reads them);
* ``get_block_ids_with_load_errors``: the union; ``get_finished_count``: None if any child says
  None, the children's common count, an error (ValueError) if they disagree;
* ``build_connector_worker_meta``: None when no child has any, else one entry per child (None
  for a child without); ``aggregate`` (across ranks) entry by entry; ``update_connector_output``
  gives child i entry i;
* ``get_kv_connector_stats``: the children's stats by connector class, a class's aggregated; across
  ranks class by class (``MultiKVConnectorStats``);
* from the config alone: the KV cache layout the children need (two different ones are an error,
  ValueError), sleep mode only if every child supports it, piecewise CUDA graphs if any child
  needs them;
* ``get_mem_pool_context``: at most one child may have one (ValueError otherwise);
  ``get_handshake_metadata``: the first child's that is not None; ``has_pending_push_work`` and
  ``register_finished_partial_tail``: any child; ``shutdown``: every child, then the last failure
  is raised.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvref.spec.errors import InvalidFieldError

from .connector_worker_child import ScriptedWorkerChild, aggregate_stats, aggregate_worker_meta

#: the key under which MultiConnector files a scripted child's stats (vLLM: the child's class name)
SCRIPTED = "scripted"

FORWARD_HOOKS = ("start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save", "finish_forward",
                 "reset_capture_state", "register_kv_caches", "unregister_kv_caches", "restore_kv_caches",
                 "set_host_xfer_buffer_ops", "set_xfer_handshake_metadata", "set_xfer_handshake_metadata_pp_aware",
                 "clear_connector_metadata", "bind_gpu_block_pool")


class MultiConnectorModel:
    """One ``MultiConnector`` instance (a scheduler's or one worker rank's) over ``children``."""

    def __init__(self, children: Sequence[ScriptedWorkerChild]) -> None:
        if isinstance(children, (str, bytes)) or not isinstance(children, Sequence) or not children:
            raise InvalidFieldError("children", children, "a non-empty list of ScriptedWorkerChild")
        for c in children:
            if not isinstance(c, ScriptedWorkerChild):
                raise InvalidFieldError("children[i]", c, "a ScriptedWorkerChild")
        self.children = list(children)
        #: request -> saves still to finish beyond the first (scheduler: counted since the last
        #: metadata; worker: received and not used up)
        self.extra_async_saves: dict[str, int] = {}
        self.bound: tuple | None = None  # the metadata bound on a worker (child metas, extra saves)

    # ---- from the config alone (classmethods in vLLM) ---------------------------------------------
    def required_kvcache_layout(self) -> str | None:
        """The one layout the children need (None: none needs one); two different is an error."""
        layouts = {c.kv_cache_layout for c in self.children if c.kv_cache_layout is not None}
        if len(layouts) > 1:
            raise ValueError(f"KV cache layout mismatch: {sorted(layouts)}")
        return next(iter(layouts), None)

    def supports_sleep_mode(self) -> bool:
        return all(c.sleep_mode for c in self.children)

    def requires_piecewise_for_cudagraph(self) -> bool:
        return any(c.piecewise_cudagraph for c in self.children)

    # ---- scheduler side ---------------------------------------------------------------------------
    def request_finished(self, request_id: str) -> tuple[bool, dict | None]:
        async_saves = 0
        params: dict | None = None
        for c in self.children:
            save, p = c.call("request_finished", request_id)
            async_saves += bool(save)
            if p is not None:
                if params is None:
                    params = dict(p)
                else:
                    clashes = set(params) & set(p)
                    if clashes:
                        raise RuntimeError(f"Key clash in kv_transfer_params from multiple connectors: {clashes}")
                    params.update(p)
        if async_saves > 1:
            self.extra_async_saves[request_id] = async_saves - 1
        return async_saves > 0, params

    def build_connector_meta(self, finished_ids: tuple[str, ...]) -> tuple[tuple, dict | None]:
        metas = tuple(c.build_connector_meta(finished_ids) for c in self.children)
        extra = self.extra_async_saves or None
        if extra:
            self.extra_async_saves = {}
        return metas, extra

    def update_connector_output(self, finished_sending: Iterable[str], worker_meta: tuple | None) -> None:
        for i, c in enumerate(self.children):
            c.call("update_connector_output",
                   (tuple(sorted(finished_sending)), None if worker_meta is None else worker_meta[i]))

    def has_pending_push_work(self) -> bool:
        return any(c.call("has_pending_push_work") for c in self.children)

    def register_finished_partial_tail(self, request_id: str) -> bool:
        return any([c.call("register_finished_partial_tail", request_id) for c in self.children])

    def get_handshake_metadata(self) -> Any:
        for c in self.children:
            meta = c.call("get_handshake_metadata")
            if meta is not None:
                return meta
        return None

    # ---- worker side ------------------------------------------------------------------------------
    def bind_connector_metadata(self, meta: tuple[tuple, dict | None]) -> None:
        metas, extra = meta
        if extra:
            self.extra_async_saves.update(extra)
        for c, m in zip(self.children, metas):
            c.call("bind_connector_metadata", m)
        self.bound = meta

    def clear_connector_metadata(self) -> None:
        self.forward("clear_connector_metadata")
        self.bound = None

    def handle_preemptions(self, meta: tuple[tuple, dict | None]) -> None:
        for c, m in zip(self.children, meta[0]):
            c.call("handle_preemptions", m)

    def forward(self, name: str, args: Any = ()) -> None:
        """A hook every child gets, in config order, with the same arguments."""
        if name not in FORWARD_HOOKS:
            raise InvalidFieldError("name", name, f"one of {FORWARD_HOOKS}")
        for c in self.children:
            c.call(name, args)

    def get_transfer_results(self, finished_req_ids: frozenset[str]) -> tuple[frozenset, frozenset, frozenset]:
        """``(finished_sending, finished_recving, failed_recving)``; each child answers
        ``get_finished`` (the base class's ``get_transfer_results`` asks it)."""
        sending: set[str] = set()
        recving: set[str] = set()
        for c in self.children:
            s, r = c.call("get_finished", tuple(sorted(finished_req_ids)))
            recving.update(r or ())
            for rid in sorted(s or ()):
                extra = self.extra_async_saves.get(rid)
                if extra is None:
                    sending.add(rid)
                elif extra == 1:
                    del self.extra_async_saves[rid]
                else:
                    self.extra_async_saves[rid] = extra - 1
        return frozenset(sending), frozenset(recving), frozenset()

    def get_finished(self, finished_req_ids: frozenset[str]) -> tuple[frozenset | None, frozenset | None]:
        sending, recving, _ = self.get_transfer_results(finished_req_ids)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> frozenset[int]:
        out: set[int] = set()
        for c in self.children:
            out |= set(c.call("get_block_ids_with_load_errors"))
        return frozenset(out)

    def get_finished_count(self) -> int | None:
        counts = [c.call("get_finished_count") for c in self.children]
        if any(n is None for n in counts):
            return None
        if len(set(counts)) > 1:
            raise ValueError(f"MultiConnector children returned incompatible finished counts: {sorted(set(counts))}")
        return counts[0]

    def build_connector_worker_meta(self) -> tuple | None:
        metas = [c.call("build_connector_worker_meta") for c in self.children]
        if all(m is None for m in metas):
            return None
        return tuple(metas)

    def get_kv_connector_stats(self) -> dict | None:
        """The children's transfer stats grouped by connector kind (one kind here: every child is
        scripted), aggregated within a kind; None when no child has any."""
        out: dict[str, dict] | None = None
        for c in self.children:
            stats = c.call("get_kv_connector_stats")
            if stats is None:
                continue
            out = out if out is not None else {}
            out[SCRIPTED] = aggregate_stats(out[SCRIPTED], stats) if SCRIPTED in out else dict(stats)
        return out

    def get_mem_pool_context(self) -> Any:
        found = [ctx for ctx in (c.call("get_mem_pool_context") for c in self.children) if ctx is not None]
        if len(found) > 1:
            raise ValueError("Multiple connectors provide a KV cache memory pool")
        return found[0] if found else None

    def shutdown(self) -> None:
        failure: BaseException | None = None
        for c in self.children:
            try:
                c.call("shutdown")
            except Exception as exc:  # every child is shut down; the last failure is raised
                failure = exc
        if failure is not None:
            raise failure

    def check_invariants(self) -> None:
        assert all(n >= 1 for n in self.extra_async_saves.values()), f"C1: extra async saves {self.extra_async_saves}"
        for c in self.children:
            c.check_invariants()


def aggregate_multi_stats(a: dict | None, b: dict | None) -> dict | None:
    """``MultiKVConnectorStats.aggregate`` across ranks: kind by kind, a kind new to ``a`` taken as
    it is."""
    if a is None or b is None:
        return a if b is None else b
    return {**a, **{k: aggregate_stats(a[k], v) if k in a else v for k, v in b.items()}}


def aggregate_multi_worker_meta(a: tuple | None, b: tuple | None) -> tuple | None:
    """``MultiKVConnectorWorkerMetadata.aggregate`` of two ranks' metadata (entry by entry, an
    entry missing on one rank taken from the other). vLLM asserts both have as many entries."""
    if a is None or b is None:
        return a if b is None else b
    if len(a) != len(b):
        raise ValueError(f"worker metadata of {len(a)} and {len(b)} children")
    return tuple(y if x is None else x if y is None else aggregate_worker_meta(x, y) for x, y in zip(a, b))


class RankOutputAggregator:
    """The engine's merge of the ranks' connector outputs (vLLM's ``KVOutputAggregator``): a
    request finished sending or receiving once ``expected`` ranks have reported it; load errors
    are the union; worker metadata is aggregated rank by rank."""

    def __init__(self, expected: int) -> None:
        if type(expected) is not int or expected < 1:
            raise InvalidFieldError("expected", expected, "an int >= 1 (ranks that must report)")
        self.expected = expected
        self.send_remaining: dict[str, int] = {}
        self.recv_remaining: dict[str, int] = {}

    @classmethod
    def from_connector(cls, connector: MultiConnectorModel, world_size: int) -> RankOutputAggregator:
        """Sized as the engine sizes it: the connector's finished count, else the world size."""
        return cls(connector.get_finished_count() or world_size)

    def _count(self, ids: Iterable[str], remaining: dict[str, int], out: set[str]) -> None:
        for rid in ids:
            remaining[rid] = remaining.get(rid, self.expected) - 1
            if remaining[rid] == 0:
                out.add(rid)
                del remaining[rid]

    def aggregate(self, outputs: Sequence[tuple]) -> tuple:
        """``outputs``: per rank ``(sending, recving, invalid_block_ids, worker_meta, stats)``;
        returns the same five, merged."""
        sending: set[str] = set()
        recving: set[str] = set()
        invalid: set[int] = set()
        meta: tuple | None = None
        stats: dict | None = None
        for s, r, bad, m, st in outputs:
            self._count(s or (), self.send_remaining, sending)
            self._count(r or (), self.recv_remaining, recving)
            invalid |= set(bad)
            meta = aggregate_multi_worker_meta(meta, m)
            stats = aggregate_multi_stats(stats, st)
        return frozenset(sending), frozenset(recving), frozenset(invalid), meta, stats


__all__ = ["FORWARD_HOOKS", "SCRIPTED", "MultiConnectorModel", "RankOutputAggregator", "aggregate_multi_stats",
           "aggregate_multi_worker_meta"]
