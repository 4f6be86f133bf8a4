"""The engine side both offload worlds share: vLLM's v1 ``Scheduler`` around a KV connector.

:class:`~kvref.models.offload_machine.SimpleOffloadWorld` (``SimpleCPUOffloadScheduler``) and
:class:`~kvref.models.offloading_connector_world.OffloadingWorld` (``OffloadingConnector``'s
scheduler) drive two different connectors, but the engine around them is one: a GPU
``KVCacheManager`` and vLLM ``Request`` objects, scheduled the way vLLM's ``Scheduler`` does and
handed to the connector as a ``SchedulerOutput``. That part lives here once, so the two worlds
cannot drift apart in how they build requests, allocate, lay out a step or finish a load.

What stays in each world is what the connectors differ in: when ``update_state_after_alloc`` is
called, what the metadata holds, how completions are reported, how a finish is told to the
connector, and each content model.

Two engines answer the same calls: :class:`ReferenceEngine` (kvref) and :class:`VllmEngine`
(vLLM 0.33.0); each world's backends add their connector on top.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

from kvref.impl.interface import PoolConfig
from kvref.impl.reference.kv_cache_manager import KVCacheManager
from kvref.impl.request import Request, RequestStatus
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec


class OffloadInvariantError(AssertionError):
    """The content model caught the system breaking an offload invariant."""


# --------------------------------------------------------------------------------------------
# The GPU KV cache both worlds offload from


def kvref_kv_cache_groups(block_size: int, sliding_window: int | None) -> tuple[KVCacheGroupSpec, ...]:
    """One full-attention group, plus a sliding-window group when ``sliding_window`` is set."""
    kw = dict(block_size=block_size, num_kv_heads=1, head_size=1, dtype="float32")
    groups = [KVCacheGroupSpec(("full",), FullAttentionSpec(**kw))]
    if sliding_window is not None:
        groups.append(KVCacheGroupSpec(("swa",), SlidingWindowSpec(sliding_window=sliding_window, **kw)))
    return tuple(groups)


def kvref_kv_cache_manager(cfg: Any, groups: tuple[KVCacheGroupSpec, ...]) -> KVCacheManager:
    """kvref's GPU ``KVCacheManager`` with prefix caching, one block size for scheduling and hashing."""
    return KVCacheManager(PoolConfig(cfg.num_gpu_blocks, groups, cfg.max_model_len, cfg.block_size,
                                     cfg.block_size, enable_caching=True))


def vllm_kv_cache_manager(cfg: Any) -> tuple[Callable, Any, Any]:
    """vLLM 0.33.0's GPU ``KVCacheManager`` for ``cfg``'s groups (as :func:`kvref_kv_cache_groups`).

    Returns ``(block_hasher, kv_cache_config, kv_cache_manager)``: requests must be built with
    that hasher, and the connector is configured from that ``KVCacheConfig``.
    """
    import torch
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VKVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec as VFull
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheTensor
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec as VGroup
    from vllm.v1.kv_cache_interface import SlidingWindowSpec as VSWA

    init_none_hash(sha256)
    hasher = get_request_block_hasher(cfg.block_size, sha256)
    kw = dict(block_size=cfg.block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
    groups = [VGroup(["full"], VFull(**kw))]
    if cfg.sliding_window is not None:
        groups.append(VGroup(["swa"], VSWA(sliding_window=cfg.sliding_window, **kw)))
    page = groups[0].kv_cache_spec.page_size_bytes
    kcfg = KVCacheConfig(num_blocks=cfg.num_gpu_blocks,
                         kv_cache_tensors=[KVCacheTensor(size=page * cfg.num_gpu_blocks,
                                                         layers=[g.layer_names[0] for g in groups],
                                                         layer_stride=page, block_stride=page)],
                         kv_cache_groups=groups)
    mgr = VKVCacheManager(kcfg, max_model_len=cfg.max_model_len, scheduler_block_size=cfg.block_size,
                          hash_block_size=cfg.block_size, enable_caching=True)
    return hasher, kcfg, mgr


# --------------------------------------------------------------------------------------------
# Engines: the calls vLLM's Scheduler makes on the KVCacheManager, the Request and the connector
# interface they share (``get_num_new_matched_tokens``). A backend sets ``mgr`` and ``conn``.


class ReferenceEngine:
    """kvref's ``KVCacheManager`` and ``Request``."""

    mgr: Any
    conn: Any

    def make_request(self, rid: str, prompt: list[int], max_tokens: int) -> Any:
        return Request(rid, prompt, max_tokens=max_tokens)

    def append_token(self, req, tok: int) -> None:
        req.output_token_ids.append(tok)

    def block_hashes(self, req) -> list[bytes]:
        return self.mgr.block_hashes(req)

    def set_status(self, req, status: str) -> None:
        # kvref has one FINISHED status; vLLM's tell a stop from an abort (VllmEngine).
        req.status = {"waiting": RequestStatus.WAITING, "loading": RequestStatus.WAITING,
                      "running": RequestStatus.RUNNING, "preempted": RequestStatus.PREEMPTED,
                      "finished": RequestStatus.FINISHED, "aborted": RequestStatus.FINISHED}[status]

    def get_computed_blocks(self, req):
        blocks, n, _ = self.mgr.get_computed_blocks(req)
        return blocks, n

    def allocate(self, req, n_new, n_hit=0, hits=None, n_ext=0, delay=False):
        out = self.mgr.allocate_slots(req, n_new, n_hit, hits, num_external_computed_tokens=n_ext,
                                      delay_cache_blocks=delay)
        return None if out is None else out.get_block_ids()

    def table(self, rid: str) -> tuple[list[int], ...]:
        return tuple(list(x) for x in self.mgr.get_block_ids(rid))

    def cache_blocks(self, req, n: int) -> None:
        self.mgr.coordinator.cache_blocks(req, self.mgr.block_hashes(req), n)

    def free(self, req) -> None:
        self.mgr.free(req)

    def match(self, req, n_computed):
        return self.conn.get_num_new_matched_tokens(req, n_computed)


class VllmEngine(ReferenceEngine):
    """vLLM 0.33.0's ``KVCacheManager`` and ``Request`` (built by :func:`vllm_kv_cache_manager`).

    Both vLLM connectors take ``update_state_after_alloc`` with the request's ``KVCacheBlocks``,
    as vLLM's ``Scheduler`` passes them, and a ``SchedulerOutput`` (:func:`vllm_scheduler_output`).
    """

    _hasher: Callable

    def make_request(self, rid, prompt, max_tokens):
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request as VRequest

        return VRequest(request_id=rid, prompt_token_ids=list(prompt),
                        sampling_params=SamplingParams(max_tokens=max_tokens), pooling_params=None,
                        block_hasher=self._hasher)

    def append_token(self, req, tok):
        req.append_output_token_ids(tok)

    def block_hashes(self, req):
        return list(req.block_hashes)

    def set_status(self, req, status):
        from vllm.v1.request import RequestStatus as VS

        req.status = {"waiting": VS.WAITING, "running": VS.RUNNING, "preempted": VS.PREEMPTED,
                      "finished": VS.FINISHED_STOPPED, "aborted": VS.FINISHED_ABORTED,
                      "loading": VS.WAITING_FOR_REMOTE_KVS}[status]

    def get_computed_blocks(self, req):
        out = self.mgr.get_computed_blocks(req)
        return out[0], out[1]

    def cache_blocks(self, req, n):
        self.mgr.cache_blocks(req, n)

    def after_alloc(self, req, n_ext):
        self.conn.update_state_after_alloc(req, self.mgr.get_blocks(req.request_id), n_ext)

    def check_invariants(self):
        pass  # vLLM's objects carry no kvref invariants; the worlds compare what they observe instead


def vllm_scheduler_output(step: Any) -> SimpleNamespace:
    """The fields of vLLM's ``SchedulerOutput`` a connector's ``build_connector_meta`` reads, from a
    kvref step (``SimpleOffloadStep`` / ``OffloadingStep``: same fields)."""
    new = [SimpleNamespace(req_id=rid, block_ids=ids) for rid, ids, full in step.scheduled if full]
    cached = [(rid, ids) for rid, ids, full in step.scheduled if not full]
    return SimpleNamespace(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _ in cached], new_block_ids=[i for _, i in cached],
                                              resumed_req_ids=set()),
        num_scheduled_tokens=dict(step.num_scheduled_tokens), finished_req_ids=step.finished_req_ids,
        preempted_req_ids=set(step.preempted_req_ids), kv_connector_block_state=None,
        kv_cache_block_copies=None)


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

    def add_request(self, prompt: list[int], max_out: int = 2) -> str:
        rid = f"r{self._n}"
        self._n += 1
        self.reqs[rid] = WorldRequest(rid, self.b.make_request(rid, prompt, max_out + 1), max_out)
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
