"""The explorer over the SimpleCPU offload path: every order of steps, per-worker store
completions, load completions and preemptions, at a small scope.

It explores :class:`~kvref.models.offload.simple_cpu_world.SimpleOffloadWorld` — the reference GPU
``KVCacheManager`` + the reference ``SimpleCPUOffloadScheduler`` driven the way vLLM's scheduler
does, with a content model beside them (a GPU block never the source of two in-flight stores,
vLLM #41289; a block in a transfer is never free; a load reads exactly the content its position
needs). Transfer completions are the point: with ``world_size`` workers, each store is reported
by each worker separately, and stores and loads complete in every order.

Transfer event ids come from counters that only grow; the state key renames the ids in use by
rank and leaves the counters out (:class:`_EventRenaming` says why that is sound), so states
reached by commuting interleavings merge and the state space is finite: scopes with
``max_depth=None`` are explored *completely*, with deadlock checks (``offload-lazy``: ≈5,500
states; ``offload-complete``, the eager default workload: ≈58,000 states, nightly). The ``offload``
scope stays depth-bounded (10 actions) for the mutant campaign and CI. The key is a structural
freeze of the whole world (every block's ref count and hash, the free queue's order, dicts in
insertion order) minus its history logs.
"""

from __future__ import annotations

import pickle
from collections import deque
from enum import Enum
from dataclasses import dataclass
from typing import Any, Hashable

from kvref.spec.errors import InvalidFieldError, check_int


@dataclass(frozen=True)
class OffloadScope:
    name: str = "offload"
    # r1 evicts r0's GPU blocks, so r2 (r0's prefix) loads them back from the CPU
    prompts: tuple[tuple[int, ...], ...] = ((1, 2, 3, 4, 5), (7, 8, 9, 10, 11), (1, 2, 3, 4, 6))
    max_out: int = 1
    block_size: int = 2
    num_gpu_blocks: int = 6
    num_cpu_blocks: int = 4
    world_size: int = 2
    lazy: bool = False
    chunk: int = 4
    max_depth: int | None = 10  # None: explore every reachable state

    def __post_init__(self) -> None:
        check_int("world_size", self.world_size, minimum=1)
        check_int("max_depth", self.max_depth, minimum=1, allow_none=True)
        if not self.prompts:
            raise InvalidFieldError("prompts", self.prompts, "at least one prompt")

    def config(self):
        from kvref.models.offload.simple_cpu_world import SimpleOffloadConfig

        return SimpleOffloadConfig(block_size=self.block_size, num_gpu_blocks=self.num_gpu_blocks,
                                   num_cpu_blocks=self.num_cpu_blocks, lazy=self.lazy,
                                   world_size=self.world_size, max_model_len=32,
                                   max_num_batched_tokens=max(8, self.chunk))


OFFLOAD_SCOPES = {
    "offload": OffloadScope(),
    "offload-deep": OffloadScope(name="offload-deep", max_depth=14),
    # every reachable state (the default workload, eager stores, two workers): nightly
    "offload-complete": OffloadScope(name="offload-complete", max_depth=None),
    "offload-lazy": OffloadScope(name="offload-lazy", lazy=True, world_size=1, max_depth=None),
}


class IdRenaming:
    """Ids from ever-growing counters renamed by rank among the ids in use, for a state key.

    A subclass names where its ids live, by attribute name: ``keyed`` (dicts keyed by an id),
    ``valued`` (an id, or a set / dict values holding ids), ``thresholds`` (a bound the code
    compares ids with, ``id < bound``: renamed to the number of ids in use below it) and
    ``skipped`` (the counters themselves, and history logs nothing reads). ``_freeze`` applies
    the renaming to every attribute with one of those names.

    Why this is sound: the code under exploration uses these ids only to look them up, to
    compare them with each other or with a threshold, and to check them against the counter; the
    next id it issues is larger than every id in use. An order-preserving renaming of the ids in
    use that leaves the counter out keeps every comparison the future can make, so two states
    equal under it behave alike (a bisimulation) and merging them is sound. Each subclass's
    docstring says where its code iterates a *set* of ids (whose order an order-preserving
    renaming does not keep) and why that order cannot change what happens. An id in a place the
    tables do not name keeps its raw value: that can only merge fewer states, never more.
    """

    keyed: dict[str, str] = {}      # attribute -> id space
    valued: dict[str, str] = {}
    thresholds: dict[str, str] = {}
    skipped: frozenset[str] = frozenset()

    def __init__(self, in_use: dict[str, set[int]]) -> None:
        self.names = frozenset(self.keyed) | frozenset(self.valued) | frozenset(self.thresholds)
        self.rank = {space: {ev: i for i, ev in enumerate(sorted(ids))} for space, ids in in_use.items()}
        self._sorted = {space: sorted(ids) for space, ids in in_use.items()}

    def renamed(self, name: str, value: Any) -> Any:
        """``value`` of attribute ``name`` with its ids renamed (a new object), or ``value``."""
        space = self.keyed.get(name)
        if space is not None and isinstance(value, dict):
            r = self.rank[space]
            return {r.get(k, k): v for k, v in value.items()}
        space = self.valued.get(name)
        if space is not None:
            r = self.rank[space]
            if isinstance(value, (set, frozenset)):
                return {r.get(v, v) for v in value}
            if isinstance(value, dict):
                return {k: ({r.get(x, x) for x in v} if isinstance(v, (set, frozenset)) else r.get(v, v))
                        for k, v in value.items()}
            if isinstance(value, int) and not isinstance(value, bool):
                return r.get(value, value)
        space = self.thresholds.get(name)
        if space is not None and isinstance(value, int):
            from bisect import bisect_left

            return bisect_left(self._sorted[space], value)
        return value


class _EventRenaming(IdRenaming):
    """The SimpleCPU connector's store / load event ids (and the world's copies of them).

    The connector and the world iterate event ids only in sorted order or in dict order (which
    follows issue order, kept by the renaming); sets of them are only tested and updated.
    """

    keyed = {name: "store" for name in ("_store_event_to_blocks", "_abandoned_store_event_to_blocks",
                                        "_store_event_to_reqs", "_store_event_pending_counts", "stores")}
    keyed["_load_event_to_reqs"] = "load"
    valued = {"store_events": "store", "load_event": "load", "load_event_of": "load"}
    skipped = frozenset({"_store_event_counter", "_load_event_counter", "duplicate_stores", "metas"})

    def __init__(self, world: Any) -> None:
        conn = world.b.conn
        store: set[int] = set(world.stores)
        for name, space in self.keyed.items():
            if space == "store" and name != "stores":
                store.update(getattr(conn, name, {}))
        for st in getattr(conn, "_reqs_to_store", {}).values():
            store.update(getattr(st, "store_events", ()))
        load: set[int] = set(world.load_event_of.values())
        load.update(getattr(conn, "_load_event_to_reqs", {}))
        for ls in list(getattr(conn, "_reqs_to_load", {}).values()) + list(
                getattr(conn, "_abandoned_reqs_to_load", {}).values()):
            ev = getattr(ls, "load_event", None)
            if ev is not None:
                load.add(ev)
        super().__init__({"store": store, "load": load})


#: values that describe themselves in a key
_ATOMS = frozenset({type(None), bool, int, float, str, bytes})


def _freeze(obj: Any, memo: dict[int, Any], ren: IdRenaming | None = None) -> Hashable:
    """A hashable, structural description of ``obj``: blocks by id with their ref count and hash,
    the free queue as its order.

    Dicts keep their insertion order (the reference iterates them: which request's blocks are
    stored first depends on it); sets are sorted. With ``ren``, event ids are renamed by rank.
    Enum members, classes and functions are constants: described by name, not walked.
    (The key is most of the offload explorers' time, so atoms are tested inline.)
    """
    t = type(obj)
    if t in _ATOMS:
        return obj
    oid = id(obj)
    if oid in memo:
        return memo[oid]
    cls = t.__name__
    if cls == "KVCacheBlock":  # everything but the free-list links (the queue's order is below)
        return ("B", obj.block_id, obj.ref_cnt, obj.block_hash, obj.block_hash_num_tokens, obj.is_null)
    if cls == "FreeKVCacheBlockQueue":  # the eviction order: which block the next allocation takes
        out = ("FQ", tuple([b.block_id for b in obj.iter_blocks()]))
        memo[oid] = out
        return out
    memo[oid] = ("cycle", cls)
    atoms = _ATOMS
    if t is dict:
        out = ("d", tuple([(k if type(k) in atoms else _freeze(k, memo, ren),
                            v if type(v) in atoms else _freeze(v, memo, ren)) for k, v in obj.items()]))
    elif t is list or t is tuple or t is deque:
        out = ("l", tuple([x if type(x) in atoms else _freeze(x, memo, ren) for x in obj]))
    elif t is set or t is frozenset:
        out = ("s", tuple(sorted([x if type(x) in atoms else _freeze(x, memo, ren) for x in obj], key=repr)))
    elif isinstance(obj, Enum):
        out = ("E", cls, obj.name)
    elif isinstance(obj, type):
        out = ("T", obj.__qualname__)
    elif isinstance(obj, dict):
        out = ("d", tuple((_freeze(k, memo, ren), _freeze(v, memo, ren)) for k, v in obj.items()))
    elif isinstance(obj, (list, tuple, deque)):
        out = ("l", tuple(_freeze(x, memo, ren) for x in obj))
    elif isinstance(obj, (set, frozenset)):
        out = ("s", tuple(sorted((_freeze(x, memo, ren) for x in obj), key=repr)))
    elif callable(obj) and not hasattr(obj, "__dict__"):
        out = ("f", getattr(obj, "__qualname__", cls))
    else:
        out = _freeze_fields(obj, cls, memo, ren)
    memo[oid] = out
    return out


def _freeze_fields(obj: Any, cls: str, memo: dict[int, Any], ren: IdRenaming | None) -> Hashable:
    fields = getattr(obj, "__dict__", None)
    fields = {} if fields is None else dict(fields)
    for slot in getattr(type(obj), "__slots__", ()):
        if hasattr(obj, slot):
            fields[slot] = getattr(obj, slot)
    skipped = ren.skipped if ren is not None else ()
    renamed = ren.names if ren is not None else ()
    atoms = _ATOMS
    items = []
    for k in sorted(fields):
        if k.startswith("__") or k in skipped:
            continue
        v = fields[k]
        if k in renamed:
            v2 = ren.renamed(k, v)  # type: ignore[union-attr]
            if v2 is not v:  # a new container: keep it alive while ``memo`` (keyed by id) is in use,
                memo.setdefault(-1, []).append(v2)  # or a later temporary could reuse its id
                v = v2
        items.append((k, v if type(v) in atoms else _freeze(v, memo, ren)))
    return (cls, tuple(items))


class WorldSystem:
    """What the offload explorers share: a state is ``(world, requests arrived so far)``, copied
    by one pickle per expanded state (unpickled per action; the last action steps the state in
    place), and the actions every world has (arrive, step, preempt). Subclasses say which actions
    are enabled and apply their own transfer actions in :meth:`_apply`."""

    def __init__(self, scope: Any) -> None:
        self.scope = scope
        self._last_blob: tuple[Any, bytes] | None = None  # (state, its pickle): see step

    def step(self, s, a):
        # the engine expands a state by all its actions in a row: pickle it once, unpickle per action
        cached = self._last_blob
        if cached is None or cached[0] is not s:
            cached = self._last_blob = (s, pickle.dumps(s, protocol=pickle.HIGHEST_PROTOCOL))
        return self._step(pickle.loads(cached[1]), a)

    def step_consuming(self, s, a):
        """:meth:`step` on ``s`` itself (the engine's last action on a state it then drops)."""
        self._last_blob = None
        return self._step(s, a)

    def _step(self, s, a):
        w, arrived = s
        kind = a[0]
        if kind == "arrive":
            w.add_request(list(self.scope.prompts[a[1]]), self.scope.max_out)
            arrived += 1
        elif kind == "step":
            w.step(self.scope.chunk)
        elif kind == "preempt":
            w.preempt(a[1])
        else:
            self._apply(w, a)
        w.metas.clear()  # history only
        return (w, arrived)

    def _apply(self, w: Any, a: Hashable) -> None:
        raise InvalidFieldError("action", a, "arrive / step / preempt or one of this world's transfer actions")

    def explore(self, **kwargs: Any):
        """Explore this scope (bounded by its ``max_depth``; None: completely, with deadlock
        checks; kwargs go to :func:`~kvref.models.explorer.engine.explore`)."""
        from kvref.models.explorer.engine import explore

        kwargs.setdefault("max_depth", self.scope.max_depth)
        # a depth-bounded search cuts states off mid-work: only a complete one can call a state stuck
        kwargs.setdefault("check_deadlocks", kwargs["max_depth"] is None)
        return explore(self, **kwargs)


class OffloadSystem(WorldSystem):
    """A :class:`~kvref.models.explorer.engine.TransitionSystem` over ``SimpleOffloadWorld``."""

    def initial_states(self):
        from kvref.models.offload.simple_cpu_world import SimpleOffloadWorld

        return [(SimpleOffloadWorld(self.scope.config(), "reference"), 0)]

    def actions(self, s) -> list[Hashable]:
        w, arrived = s
        acts: list[Hashable] = []
        if arrived < len(self.scope.prompts):
            acts.append(("arrive", arrived))  # arrivals in workload order (ids are arrival counters)
        if w.live():
            acts.append(("step",))
        for k, ev in enumerate(sorted(w.stores)):
            acts.append(("store_done", k))  # one worker reports this store
        for k in range(len(w.loads)):
            acts.append(("load_done", k))
        for k in range(len(w.live("running"))):
            acts.append(("preempt", k))
        return acts

    def _apply(self, w, a) -> None:
        if a[0] == "store_done":
            w.complete_store(a[1], 1)
        elif a[0] == "load_done":
            w.complete_load(a[1])
        else:
            super()._apply(w, a)

    def key(self, s) -> Hashable:
        w, arrived = s
        return (arrived, _freeze(w, {}, _EventRenaming(w)))

    def check(self, s) -> None:
        s[0]._check()

    def is_final(self, s) -> bool:
        w, arrived = s
        return arrived == len(self.scope.prompts) and not w.live() and not w.stores and not w.loads

    def describe(self, s) -> dict[str, str]:
        w, arrived = s
        reqs = " ".join(f"{rid}:{r.phase} c{r.computed}" for rid, r in w.reqs.items())
        return {"requests": reqs or "-", "stores in flight": str(sorted(w.stores)),
                "loads in flight": str(sorted(w.loads)),
                "gpu free": " ".join(str(b.block_id) for b in w.b.gpu_pool.free_block_queue.get_all_free_blocks())}


def explore_offload(scope: OffloadScope | str = "offload", **kwargs: Any):
    """Explore ``scope`` (see :meth:`WorldSystem.explore`)."""
    from kvref.models.explorer.scope_lookup import named_scope

    return OffloadSystem(named_scope(scope, OFFLOAD_SCOPES, OffloadScope)).explore(**kwargs)
