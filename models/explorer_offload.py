"""The explorer over the SimpleCPU offload path: every order of steps, per-worker store
completions, load completions and preemptions, at a small scope.

It explores :class:`~kvref.models.offload_machine.SimpleOffloadWorld` — the reference GPU
``KVCacheManager`` + the reference ``SimpleCPUOffloadScheduler`` driven the way vLLM's scheduler
does, with a content model beside them (a GPU block never the source of two in-flight stores,
vLLM #41289; a block in a transfer is never free; a load reads exactly the content its position
needs). Transfer completions are the point: with ``world_size`` workers, each store is reported
by each worker separately, and stores and loads complete in every order.

The state carries monotone counters (transfer event ids), so exploration is *bounded*
(``max_depth`` actions); the key is a generic freeze of the whole world minus its history log
(``metas``): states reached by commuting interleavings merge.
"""

from __future__ import annotations

import pickle
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
    max_depth: int = 10

    def __post_init__(self) -> None:
        check_int("world_size", self.world_size, minimum=1)
        check_int("max_depth", self.max_depth, minimum=1)
        if not self.prompts:
            raise InvalidFieldError("prompts", self.prompts, "at least one prompt")

    def config(self):
        from .offload_machine import SimpleOffloadConfig

        return SimpleOffloadConfig(block_size=self.block_size, num_gpu_blocks=self.num_gpu_blocks,
                                   num_cpu_blocks=self.num_cpu_blocks, lazy=self.lazy,
                                   world_size=self.world_size, max_model_len=32,
                                   max_num_batched_tokens=max(8, self.chunk))


OFFLOAD_SCOPES = {
    "offload": OffloadScope(),
    "offload-deep": OffloadScope(name="offload-deep", max_depth=14),
    "offload-lazy": OffloadScope(name="offload-lazy", lazy=True, world_size=1),
}


def _freeze(obj: Any, memo: dict[int, Any]) -> Hashable:
    """A hashable, structural description of ``obj`` (blocks by id, requests by id)."""
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    oid = id(obj)
    if oid in memo:
        return memo[oid]
    cls = type(obj).__name__
    if cls == "KVCacheBlock":
        return ("B", obj.block_id)
    if cls in ("Request", "Request_") or (hasattr(obj, "request_id") and hasattr(obj, "prompt_token_ids")):
        memo[oid] = ("R", obj.request_id)
        out = ("R", obj.request_id, tuple(obj.prompt_token_ids), tuple(getattr(obj, "output_token_ids", ())),
               getattr(obj, "num_computed_tokens", 0), str(getattr(obj, "status", "")))
        memo[oid] = out
        return out
    memo[oid] = ("cycle", cls)
    if isinstance(obj, dict):
        out = ("d", tuple(sorted(((_freeze(k, memo), _freeze(v, memo)) for k, v in obj.items()), key=repr)))
    elif isinstance(obj, (list, tuple)):
        out = ("l", tuple(_freeze(x, memo) for x in obj))
    elif isinstance(obj, (set, frozenset)):
        out = ("s", tuple(sorted((_freeze(x, memo) for x in obj), key=repr)))
    elif callable(obj) and not hasattr(obj, "__dict__"):
        out = ("f", getattr(obj, "__qualname__", cls))
    else:
        fields = dict(getattr(obj, "__dict__", {}))
        for slot in getattr(type(obj), "__slots__", ()):
            if hasattr(obj, slot):
                fields[slot] = getattr(obj, slot)
        out = (cls, tuple(sorted((k, _freeze(v, memo)) for k, v in fields.items() if not k.startswith("__"))))
    memo[oid] = out
    return out


class OffloadSystem:
    """A :class:`~kvref.models.explorer.TransitionSystem` over ``SimpleOffloadWorld``."""

    def __init__(self, scope: OffloadScope) -> None:
        self.scope = scope

    def initial_states(self):
        from .offload_machine import SimpleOffloadWorld

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

    def step(self, s, a):
        w, arrived = pickle.loads(pickle.dumps(s, protocol=pickle.HIGHEST_PROTOCOL))
        kind = a[0]
        if kind == "arrive":
            w.add_request(list(self.scope.prompts[a[1]]), self.scope.max_out)
            arrived += 1
        elif kind == "step":
            w.step(self.scope.chunk)
        elif kind == "store_done":
            w.complete_store(a[1], 1)
        elif kind == "load_done":
            w.complete_load(a[1])
        elif kind == "preempt":
            w.preempt(a[1])
        w.metas.clear()  # history only
        return (w, arrived)

    def key(self, s) -> Hashable:
        w, arrived = s
        return (arrived, _freeze(w, {}))

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
    from .explorer import explore

    if isinstance(scope, str):
        if scope not in OFFLOAD_SCOPES:
            raise InvalidFieldError("scope", scope, "one of " + ", ".join(OFFLOAD_SCOPES))
        scope = OFFLOAD_SCOPES[scope]
    kwargs.setdefault("max_depth", scope.max_depth)
    kwargs.setdefault("check_deadlocks", False)  # bounded: an idle step still advances counters
    return explore(OffloadSystem(scope), **kwargs)
