"""The explorer over the OffloadingConnector path: every order of steps, per-worker job
completions, preemptions, aborts and connector resets, at a small scope.

It explores :class:`~kvref.models.offload.offloading_connector_world.OffloadingWorld` on the reference
backend — the reference GPU ``KVCacheManager`` + the reference OffloadingConnector scheduler
(chunk keys, load/store jobs, fences) — with the world's content model checked on every write
(a store job reading a block that was overwritten or belongs to another chunk, a load bringing
the wrong content: the world raises) and the connector's and manager's ``check_invariants()`` in
every state.

Job ids come from the connector's counter, which only grows; the state key renames the ids in
use by rank (and the reset threshold with them) and leaves the counter out (:class:`_JobRenaming`
says why that is sound), so the state space is finite: a scope with ``max_depth=None`` is
explored *completely*, with deadlock checks (``connector-complete``). The key is the same
structural freeze of the whole world as the SimpleCPU explorer's (block ref counts, hashes and
free-queue order included) minus its history logs.

The ``reset-swa`` scope re-finds, with the shortest trace, the vLLM 0.33.0 bug documented in
docs/offload.md: a connector reset while a sliding-window request runs makes a later store job
read a block that now holds another chunk's (or request's) K/V.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable

from kvref.spec.errors import InvalidFieldError, check_int

from kvref.models.explorer.simple_cpu import IdRenaming, WorldSystem, _freeze

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
    max_depth: int | None = 9  # None: explore every reachable state

    def __post_init__(self) -> None:
        check_int("num_workers", self.num_workers, minimum=1)
        check_int("max_depth", self.max_depth, minimum=1, allow_none=True)
        check_int("chunk", self.chunk, minimum=1)
        if not self.prompts or any(not p for p in self.prompts):
            raise InvalidFieldError("prompts", self.prompts, "at least one non-empty prompt")

    def config(self):
        from kvref.models.offload.offloading_connector_world import OffloadingConfig

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
    # every reachable state, with deadlock checks (job ids renamed by rank): shorter prompts and a
    # 5-block GPU pool, so r1 still evicts r0's blocks and r2 loads r0's chunk back from the CPU;
    # stores, loads and flushes are reached (one worker: 8,127 states)
    "connector-complete": ConnectorScope(name="connector-complete",
                                         prompts=((1, 2, 3, 4, 5, 6), (20, 21, 22, 23, 24, 25), (1, 2, 3, 4, 5, 6, 7)),
                                         num_gpu_blocks=5, num_workers=1, max_depth=None),
    # the same with two workers, each reporting every job on its own (23,635 states; nightly)
    "connector-complete-2w": ConnectorScope(name="connector-complete-2w",
                                            prompts=((1, 2, 3, 4, 5, 6), (20, 21, 22, 23, 24, 25),
                                                     (1, 2, 3, 4, 5, 6, 7)),
                                            num_gpu_blocks=5, num_workers=2, max_depth=None),
}


class _JobRenaming(IdRenaming):
    """The OffloadingConnector's job ids (and the world's copies of them), renamed by rank.

    Where job ids live: the connector's ``_jobs``, ``_reset_fence`` and ``_batch_load_jobs``
    (keys), each request's ``transfer_jobs`` and ``_batch_jobs_to_flush`` (sets), the per-block
    fences ``_block_id_to_pending_jobs`` (sets as values), ``_stale_job_threshold`` (a report for
    a job below it belongs to before the last reset: a threshold), the world's ``jobs`` (keys);
    ``_job_counter`` is left out. Every live job id is at least the threshold and every fenced
    one below it, and new ids come from the counter, so the renamed threshold (the number of ids
    in use below it) keeps every ``job < threshold`` test.

    Set iteration: the connector iterates a request's ``transfer_jobs`` (a set, so in an order
    the renaming need not keep) only to add each job to per-block fence sets, which changes the
    *insertion order* of ``_block_id_to_pending_jobs`` and nothing else: that dict is only looked
    up (and checked, and cleared). The key keeps insertion order, so such states are at worst
    kept apart, never merged wrongly. Flushes are sets handed over whole; the world reports jobs
    in sorted order (kept by the renaming) and the reset copies ``_jobs`` in dict order.
    """

    keyed = {"_jobs": "job", "_reset_fence": "job", "_batch_load_jobs": "job", "jobs": "job"}
    valued = {"transfer_jobs": "job", "_batch_jobs_to_flush": "job", "_block_id_to_pending_jobs": "job"}
    thresholds = {"_stale_job_threshold": "job"}
    skipped = frozenset({"_job_counter", "metas", "kv_events", "hit_sources", "stats", "push_work", "sync_loads"})  # histories, not state

    def __init__(self, world: Any) -> None:
        conn = world.b.conn
        ids: set[int] = set(world.jobs)
        for name in ("_jobs", "_reset_fence", "_batch_load_jobs"):
            ids.update(getattr(conn, name))
        ids.update(conn._batch_jobs_to_flush)
        for jobs in conn._block_id_to_pending_jobs.values():
            ids.update(jobs)
        for st in conn._req_status.values():
            ids.update(st.transfer_jobs)
        super().__init__({"job": ids})


class ConnectorSystem(WorldSystem):
    """A :class:`~kvref.models.explorer.engine.TransitionSystem` over ``OffloadingWorld`` (reference)."""

    def initial_states(self):
        from kvref.models.offload.offloading_connector_world import OffloadingWorld

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
        return (arrived, _freeze(w, {}, _JobRenaming(w)))

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
    """Explore ``scope`` (bounded by its ``max_depth``; None: completely, with deadlock checks;
    kwargs go to ``explore``)."""
    from kvref.models.explorer.scope_lookup import named_scope

    return ConnectorSystem(named_scope(scope, CONNECTOR_SCOPES, ConnectorScope)).explore(**kwargs)
