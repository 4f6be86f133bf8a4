"""The engine side both offload worlds share: vLLM's v1 ``Scheduler`` around a KV connector.

:class:`~kvref.models.offload.simple_cpu_world.SimpleOffloadWorld` (``SimpleCPUOffloadScheduler``) and
:class:`~kvref.models.offload.offloading_connector_world.OffloadingWorld` (``OffloadingConnector``'s
scheduler) drive two different connectors, but the engine around them is one: a GPU
``KVCacheManager`` and vLLM ``Request`` objects, scheduled the way vLLM's ``Scheduler`` does and
handed to the connector as a ``SchedulerOutput``. That part lives here once, so the two worlds
cannot drift apart in how they build requests, allocate, lay out a step or finish a load.

What stays in each world is what the connectors differ in: when ``update_state_after_alloc`` is
called, what the metadata holds, how completions are reported, how a finish is told to the
connector, and each content model.

Two engines answer the same calls: :class:`kvref.impl.offload_engine.ReferenceEngine` (kvref)
and :class:`kvref.impl.vllm.offload.VllmEngine` (the installed vLLM); each world's backends
(:mod:`kvref.impl.offload_backends`, :mod:`kvref.impl.vllm.offload`) add their connector on top.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvref.impl.offload_engine import ReferenceEngine, kvref_kv_cache_groups, kvref_kv_cache_manager  # noqa: F401


class OffloadInvariantError(AssertionError):
    """The content model caught the system breaking an offload invariant."""


# --------------------------------------------------------------------------------------------
# The scheduler's bookkeeping, as both worlds keep it


@dataclass
class WorldRequest:
    """A request as the world's scheduler sees it: the backend's ``Request`` plus its phase."""

    rid: str
    req: Any
    max_out: int
    phase: str = "waiting"  # waiting | loading (WAITING_FOR_REMOTE_KVS) | running | done
    full_table_next: bool = True  # next schedule sends the whole table (new / resumed)
    computed: int = 0


@dataclass
class ScheduledBatch:
    """One step's schedule while it is built: ``scheduled`` entries ``(rid, block ids, full table)``,
    ``num_scheduled_tokens`` in scheduling order, and the ``(request, start, end)`` token ranges the
    forward pass computes."""

    scheduled: list = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    advances: list[tuple[WorldRequest, int, int]] = field(default_factory=list)

    def add(self, r: WorldRequest, block_ids, full_table: bool, n: int) -> None:
        if not full_table and not any(block_ids):
            # vLLM's scheduler sends a running request's new blocks as ``get_block_ids(allow_none=True)``:
            # None when no group got a block this step (the connectors skip it)
            block_ids = None
        self.scheduled.append((r.rid, block_ids, full_table))
        r.full_table_next = False
        self.num_scheduled_tokens[r.rid] = n
        self.advances.append((r, r.computed, r.computed + n))


class OffloadWorldBase:
    """What both worlds do alike around their connector: request phases and the scheduler's steps
    that do not involve the connector. Each world sets ``b`` (a backend), ``reqs``, ``order``,
    ``finished_pending``, ``preempted_pending`` and ``_n``, drives its connector in its own
    ``step``, and defines ``finish`` and ``_write_computed`` (its content model)."""

    b: Any
    reqs: dict[str, WorldRequest]
    order: list[str]
    finished_pending: Any  # a set or a list: how each world collects them
    preempted_pending: set[str]
    _n: int

    def live(self, phase: str | None = None) -> list[str]:
        return [rid for rid in self.order if self.reqs[rid].phase != "done"
                and (phase is None or self.reqs[rid].phase == phase)]

    def add_request(self, prompt: list[int], max_out: int = 2, prompt_logprobs: bool = False) -> str:
        """``prompt_logprobs``: the request never reads the prefix cache (GPU or offloaded)."""
        rid = f"r{self._n}"
        self._n += 1
        self.reqs[rid] = WorldRequest(rid, self.b.make_request(rid, prompt, max_out + 1, prompt_logprobs), max_out)
        self.order.append(rid)
        return rid

    def _scheduler_output(self, step_cls: type, batch: ScheduledBatch) -> Any:
        """The connector's view of the step's ``SchedulerOutput`` (kvref's ``step_cls``); it carries
        the finished and preempted ids pending since the last step."""
        # vLLM's SchedulerOutput lists new requests before cached ones (``yield_req_data`` order).
        scheduled = [e for e in batch.scheduled if e[2]] + [e for e in batch.scheduled if not e[2]]
        step = step_cls(scheduled, batch.num_scheduled_tokens, set(self.finished_pending),
                        set(self.preempted_pending))
        self.finished_pending.clear()
        self.preempted_pending.clear()
        return step

    def _wait_for_remote_kvs(self, r: WorldRequest, n_hit: int, n_ext: int) -> None:
        """An async load was allocated (``delay_cache_blocks``): the connector learns the blocks, the
        hit and the external tokens count as computed, and the request waits for the load
        (``WAITING_FOR_REMOTE_KVS``) instead of running."""
        self.b.after_alloc(r.req, n_ext)
        r.phase, r.computed = "loading", n_hit + n_ext
        r.req.num_computed_tokens = r.computed
        self.b.set_status(r.req, "loading")

    def _schedule_waiting(self, batch: ScheduledBatch, r: WorldRequest, n_hit: int, n: int) -> None:
        """A waiting request runs ``n`` tokens after its ``n_hit`` prefix-cache hit tokens; being new
        (or resumed), it sends its whole block table."""
        r.computed += n_hit
        r.req.num_computed_tokens = r.computed
        r.phase = "running"
        self.b.set_status(r.req, "running")
        batch.add(r, self.b.table(r.rid), True, n)

    def _forward(self, batch: ScheduledBatch) -> None:
        """The forward pass: computed tokens advance and the blocks they fill get their content."""
        for r, start, end in batch.advances:
            r.computed = end
            r.req.num_computed_tokens = end
            self._write_computed(r, start, end)

    def _update_from_output(self, batch: ScheduledBatch) -> None:
        """As vLLM's ``update_from_output``: a request with every token computed stops after
        ``max_out`` output tokens, otherwise it gets its next (deterministic) output token."""
        for r, start, end in batch.advances:
            if end == r.req.num_tokens:
                if r.req.num_tokens - r.req.num_prompt_tokens >= r.max_out:
                    self._finish_stopped(r.rid)
                else:
                    self.b.append_token(r.req, 7 + r.req.num_tokens % 5)

    def _finish_stopped(self, rid: str) -> None:
        self.finish(rid)

    def _update_waiting_for_remote_kv(self, r: WorldRequest) -> None:
        """As vLLM's: a request whose load completed caches the loaded blocks and waits again; a
        full hit recomputes its last token (vLLM needs one token to schedule)."""
        if r.phase == "loading":
            self.b.cache_blocks(r.req, r.computed)
            if r.computed == r.req.num_tokens:
                r.computed -= 1
                r.req.num_computed_tokens = r.computed
            r.phase, r.full_table_next = "waiting", True
            self.b.set_status(r.req, "waiting")

    def abort(self, pick: int) -> bool:
        rids = self.live()
        if not rids:
            return False
        self.finish(rids[pick % len(rids)])
        return True

    def preempt(self, pick: int) -> bool:
        rids = self.live("running")
        if not rids:
            return False
        self._preempt_request(self.reqs[rids[pick % len(rids)]])
        return True

    def _preempt_request(self, r: WorldRequest) -> None:
        """As vLLM's: free the blocks, recompute from scratch; the connector hears of it next step."""
        self.b.free(r.req)
        r.computed = 0
        r.req.num_computed_tokens = 0
        r.phase, r.full_table_next = "waiting", True
        self.b.set_status(r.req, "preempted")
        self.preempted_pending.add(r.rid)

    # -- each world's own ----------------------------------------------------------------------

    def finish(self, rid: str) -> None:
        """Finish (abort) ``rid``: tell the connector, free its blocks."""
        raise NotImplementedError("abstract: each offload world finishes requests its own connector's way")

    def _write_computed(self, r: WorldRequest, start: int, end: int) -> None:
        """Tokens [start, end) of ``r`` were computed: the content model writes its blocks."""
        raise NotImplementedError("abstract: each offload world keeps its own content model")
