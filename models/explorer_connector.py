"""The explorer over the OffloadingConnector path: every order of steps, per-worker job
completions, preemptions, aborts and connector resets, at a small scope.

It explores :class:`~kvref.models.offloading_connector_world.OffloadingWorld` on the reference
backend — the reference GPU ``KVCacheManager`` + the reference OffloadingConnector scheduler
(chunk keys, load/store jobs, fences) — with the world's content model checked on every write
(a store job reading a block that was overwritten or belongs to another chunk, a load bringing
the wrong content: the world raises) and the connector's and manager's ``check_invariants()`` in
every state.

Job ids come from the connector's counter and are not renamed here (unlike the SimpleCPU path's
event ids, :mod:`kvref.models.explorer_offload`), so the exploration is bounded by ``max_depth``;
the key is the same structural freeze of the whole world (block ref counts, hashes and free-queue
order included) minus its history logs.

The ``reset-swa`` scope re-finds, with the shortest trace, the vLLM 0.33.0 bug documented in
docs/offload.md: a connector reset while a sliding-window request runs makes a later store job
read a block that now holds another chunk's (or request's) K/V.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable

from kvref.spec.errors import InvalidFieldError, check_int

from .explorer_offload import WorldSystem, _freeze

__all__ = ["ConnectorScope", "CONNECTOR_SCOPES", "ConnectorSystem", "explore_connector"]


@dataclass(frozen=True)
class ConnectorScope:
    name: str = "connector"
    # r1 evicts r0's blocks from the small GPU pool; r2 shares r0's prefix, so it hits r0's chunks
    # on the CPU and loads them back (arrivals come in this order)
    prompts: tuple[tuple[int, ...], ...] = ((1, 2, 3, 4, 5, 6, 7, 8), (20, 21, 22, 23, 24, 25, 26, 27),
                                            (1, 2, 3, 4, 5, 6, 7, 8, 9))
    max_out: int = 1
    block_size: int = 2
    blocks_per_chunk: int = 1
    num_gpu_blocks: int = 7
    num_cpu_chunks: int = 6
    sliding_window: int | None = None
    num_workers: int = 2
    offload_prompt_only: bool = True
    chunk: int = 4
    resets: bool = False
    aborts: bool = False
    max_depth: int = 9

    def __post_init__(self) -> None:
        check_int("num_workers", self.num_workers, minimum=1)
        check_int("max_depth", self.max_depth, minimum=1)
        check_int("chunk", self.chunk, minimum=1)
        if not self.prompts or any(not p for p in self.prompts):
            raise InvalidFieldError("prompts", self.prompts, "at least one non-empty prompt")

    def config(self):
        from .offloading_connector_world import OffloadingConfig

        return OffloadingConfig(block_size=self.block_size, blocks_per_chunk=self.blocks_per_chunk,
                                num_gpu_blocks=self.num_gpu_blocks, num_cpu_chunks=self.num_cpu_chunks,
                                sliding_window=self.sliding_window, num_workers=self.num_workers,
                                offload_prompt_only=self.offload_prompt_only, max_model_len=64)


CONNECTOR_SCOPES = {
    "connector": ConnectorScope(),
    # FA + SWA (window 4), resets and aborts at any point: the reset bug of docs/offload.md
    "reset-swa": ConnectorScope(name="reset-swa", prompts=((1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12),
                                                           (30, 31, 32, 33, 34, 35, 36, 37, 38, 39)),
                                max_out=2, block_size=2, blocks_per_chunk=1, num_gpu_blocks=24,
                                num_cpu_chunks=16, sliding_window=4, offload_prompt_only=False,
                                resets=True, aborts=True, max_depth=9),  # finds it at 9 actions
}


class ConnectorSystem(WorldSystem):
    """A :class:`~kvref.models.explorer.TransitionSystem` over ``OffloadingWorld`` (reference)."""

    def initial_states(self):
        from .offloading_connector_world import OffloadingWorld

        return [(OffloadingWorld(self.scope.config(), "reference"), 0)]

    def actions(self, s) -> list[Hashable]:
        w, arrived = s
        acts: list[Hashable] = []
        if arrived < len(self.scope.prompts):
            acts.append(("arrive", arrived))
        if w.live():
            acts.append(("step",))
        acts.extend(("complete", k) for k in range(len(w.jobs)))  # one worker reports job k
        acts.extend(("preempt", k) for k in range(len(w.live("running"))))
        if self.scope.aborts:
            acts.extend(("abort", k) for k in range(len(w.live())))
        if self.scope.resets and not w.reset_undelivered and w.live():
            acts.append(("reset",))
        return acts

    def _apply(self, w, a) -> None:
        if a[0] == "complete":
            w.complete(a[1], 1)
        elif a[0] == "abort":
            w.abort(a[1])
        elif a[0] == "reset":
            w.reset()
        else:
            super()._apply(w, a)

    def key(self, s) -> Hashable:
        w, arrived = s
        return (arrived, _freeze(w, {}))

    def check(self, s) -> None:
        s[0].b.check_invariants()

    def is_final(self, s) -> bool:
        w, arrived = s
        return arrived == len(self.scope.prompts) and not w.live() and not w.jobs

    def describe(self, s) -> dict[str, str]:
        w, arrived = s
        reqs = " ".join(f"{rid}:{r.phase} c{r.computed}" for rid, r in w.reqs.items())
        jobs = " ".join(f"{j}:{'S' if job['store'] else 'L'}{job['reported']}" for j, job in sorted(w.jobs.items()))
        return {"requests": reqs or "-", "jobs in flight": jobs or "-",
                "gpu free": " ".join(str(b.block_id) for b in w.b.gpu_pool.free_block_queue.get_all_free_blocks())}


def explore_connector(scope: ConnectorScope | str = "connector", **kwargs: Any):
    """Explore ``scope`` (bounded by its ``max_depth``; kwargs go to ``explore``)."""
    from .explorer import explore

    if isinstance(scope, str):
        if scope not in CONNECTOR_SCOPES:
            raise InvalidFieldError("scope", scope, "one of " + ", ".join(CONNECTOR_SCOPES))
        scope = CONNECTOR_SCOPES[scope]
    if not isinstance(scope, ConnectorScope):
        raise InvalidFieldError("scope", scope, "a scope name or a ConnectorScope")
    kwargs.setdefault("max_depth", scope.max_depth)
    kwargs.setdefault("check_deadlocks", False)  # bounded: states are cut off mid-work
    return explore(ConnectorSystem(scope), **kwargs)
