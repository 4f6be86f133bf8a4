"""KV-connector flows of vLLM 0.33.0's scheduler, for the reference :class:`Scheduler`.

A KV connector (P/D transfer, CPU/disk offload, LMCache, ...) answers, for each request admitted
from the waiting queue, how many tokens beyond the local prefix-cache hit it can load
(``get_num_new_matched_tokens``) and whether it loads them *between* steps (async: the request
waits in ``WAITING_FOR_REMOTE_KVS`` holding its blocks) or inside the step that computes the rest
(sync). The worker side later reports, in each step's ``KVConnectorOutput``, loads that finished
(``finished_recving``), failed (``failed_recving``, or ``invalid_block_ids`` of blocks that did not
load), and sends that finished (``finished_sending``: blocks a finished request kept because
``request_finished`` said the connector still reads them).

What the scheduler does with that, as vLLM 0.33.0's ``Scheduler`` does it (each function here
names its vLLM counterpart):

* waiting requests holding KV blocks (async loads, promoted loads) sit in ``kv_holding_waiting``,
  always drained before ``waiting``; a load still in flight, or a connector that cannot answer
  yet (``None``), skips the request for this step without blocking the queue;
* an async load allocates its blocks at once (``delay_cache_blocks``: nothing is published until
  the KV is there) and is admitted only if they fit beside what in-flight prefills still need
  (``_inflight_prefill_reserved_blocks``);
* a finished load is promoted: its blocks are cached up to the loaded tokens
  (``_update_waiting_for_remote_kv``), a whole-prompt load recomputes its last token;
* a failed load, with ``kv_load_failure_policy="recompute"``, truncates the request's computed
  tokens to the first invalid block (or to 0 for ``failed_recving``) and recomputes; with
  ``"fail"`` the request finishes with an error (vLLM #19330 / #26050 introduced the two policies);
* a request whose connector keeps its blocks (``request_finished`` -> delay) stays in
  ``requests`` until ``finished_sending``; an aborted load keeps its blocks until
  ``finished_recving``;
* ``reset_prefix_cache(reset_connector=True)`` also resets the connector's cache.

* with two batches in flight a consumer's freed blocks return to the pool only once the steps
  that may still write them were processed (``defer_block_free``, ``_drain_deferred_frees``), and
  a victim whose free would be deferred is not preempted;
* with a HiSparse host pool as well (``hisparse_host_num_blocks``: HiSparse keeps reading a
  released page until the pool reuses it) an async load admitted while a step is in flight is not
  handed to the connector at once: it waits in ``deferred_loads`` until that step was processed
  (``_drain_deferred_loads``), and an abort before then frees its blocks at once (no load started).

* on a pool with a DeepSeek-V4.1 bounded-replay window (:mod:`.scheduler_prefix_replay`) an
  external hit whose load does not carry the window (``get_loaded_kv_cache_group_ids``) is cut to
  whole blocks, a hit no longer than the window is dropped, a longer one is rewound by the window
  (at admission, or once an async load landed), and a load that carries it replays nothing.

Not modelled: partial-tail
offloads (Mamba align mode), the aux-output and encoder connectors,
connector stats. The connector itself is :class:`ScriptedConnector`: a deterministic stand-in
whose answers the trace chooses, run unchanged inside vLLM by
:mod:`kvref.impl.vllm.connector`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvref.impl.request import Request, RequestStatus
from kvref.spec.errors import InvalidFieldError, check_choice, check_int
from kvref.spec.kv_cache_interface import MambaSpec

from . import scheduler_prefix_replay as _replay
from .scheduler_mamba_split import split_scheduled_chunk, store_shared_prefix_boundary
from .scheduler_prefill_lookahead import reserve_prefill_lookahead
from .scheduler_connector_stats import (
    KV_FETCH_COMPLETED_WAITING,
    KV_FETCH_IN_PROGRESS,
    KV_FETCH_WAITING_TO_START,
    flag_connector_reset,
    new_connector_prefix_cache_stats,
    record_connector_prefix_cache_stats,
    set_kv_fetch_stage,
)
from .scheduler_connector_stats import check_invariants as _check_stats_invariants
from .scheduler_queue import WaitingQueue

if TYPE_CHECKING:
    from .scheduler import Scheduler

KV_CONSUMER = "kv_consumer"
KV_PRODUCER = "kv_producer"
RECOMPUTE = "recompute"
FAIL = "fail"
#: the status vLLM gives a request whose async load is in flight (``RequestStatus.WAITING_FOR_REMOTE_KVS``)
WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"


@dataclass(frozen=True)
class ConnectorConfig:
    """vLLM's ``KVTransferConfig`` fields the scheduler reads, plus the fake connector's knobs.

    Args:
        kv_role: ``"kv_consumer"`` or ``"kv_producer"`` (a producer's connector requires KV
            delivery by default: a preempted request's in-flight output is dropped).
        kv_load_failure_policy: ``"recompute"`` or ``"fail"``.
        requires_kv_delivery: the connector's ``requires_kv_delivery``; None: the role's default.
        pending_frees_stop_preemption: ``has_pending_block_frees()`` answers True while a send is
            pending, so the running loop waits for those blocks instead of preempting.
        divergent_local_hybrid_hits: ``supports_divergent_local_hybrid_hits`` (the scheduler then
            asks ``get_computed_blocks_for_connector`` for the local hit).
        reset_cache_result: what ``reset_cache()`` returns (True, False or None).
        supports_hma: the connector implements vLLM's ``SupportsHMA`` (``request_finished_all_groups``);
            one that does not is told a finished request's blocks of its single KV cache group
            (``request_finished(request, block_ids[0])``) and is refused with several groups.
        hisparse_host_pool: the KV cache config has a HiSparse host pool (vLLM
            ``KVCacheConfig.hisparse_host_num_blocks`` set): with deferred frees, async loads are
            deferred too (``defer_async_loads``). A KV-cache-config fact, carried here because the
            scheduler reads it only for its connector.
    """

    kv_role: str = KV_CONSUMER
    kv_load_failure_policy: str = RECOMPUTE
    requires_kv_delivery: bool | None = None
    pending_frees_stop_preemption: bool = False
    divergent_local_hybrid_hits: bool = False
    reset_cache_result: bool | None = True
    hisparse_host_pool: bool = False
    supports_hma: bool = True

    def __post_init__(self) -> None:
        check_choice("kv_role", self.kv_role, (KV_CONSUMER, KV_PRODUCER))
        check_choice("kv_load_failure_policy", self.kv_load_failure_policy, (RECOMPUTE, FAIL))
        for name in ("pending_frees_stop_preemption", "divergent_local_hybrid_hits", "hisparse_host_pool",
                     "supports_hma"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidFieldError(name, getattr(self, name), "True or False")
        for name in ("requires_kv_delivery", "reset_cache_result"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise InvalidFieldError(name, getattr(self, name), "True, False or None")

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role == KV_PRODUCER

    @property
    def delivery(self) -> bool:
        """``KVConnectorBase_V1.requires_kv_delivery``: the producer role unless overridden."""
        return self.is_kv_producer if self.requires_kv_delivery is None else self.requires_kv_delivery


@dataclass(frozen=True)
class ExternalHit:
    """What the external KV store holds for one request (chosen by the trace).

    Args:
        num_tokens: length of the prompt prefix the store can load (capped per query: an async
            load may cover the whole prompt, a sync one leaves the last token to compute).
        load_async: load between steps (WAITING_FOR_REMOTE_KVS) rather than inside the step.
        num_pending_lookups: the first this many ``get_num_new_matched_tokens`` answer None
            ("ask again later").
        delay_free: ``request_finished`` says the connector still sends the request's blocks.
        persistent: the store keeps its copy after a load (an offload tier, not a one-shot P/D
            transfer): a preempted request finds it again and reloads it; such a store matches
            at most up to the last prompt token.
        loads_all_groups: the load restores every KV-transfer group, as a P/D transfer of the
            request's own blocks does (vLLM's NIXL / Mooncake connectors answer
            ``get_loaded_kv_cache_group_ids`` with ``transfer_group_ids``); False: the
            prefix-cacheable groups only (``KVConnectorBase_V1``'s default: a hash-addressed store
            holds no sliding window). Only a bounded-replay pool's scheduler acts on it.
    """

    num_tokens: int = 0
    load_async: bool = False
    num_pending_lookups: int = 0
    delay_free: bool = False
    persistent: bool = False
    loads_all_groups: bool = False

    def __post_init__(self) -> None:
        check_int("num_tokens", self.num_tokens, minimum=0)
        check_int("num_pending_lookups", self.num_pending_lookups, minimum=0)
        for name in ("load_async", "delay_free", "persistent", "loads_all_groups"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidFieldError(name, getattr(self, name), "True or False")


@dataclass(frozen=True)
class KVConnectorOutput:
    """The worker side's report in one step's model output (vLLM ``KVConnectorOutput``)."""

    finished_sending: tuple[str, ...] = ()
    finished_recving: tuple[str, ...] = ()
    failed_recving: tuple[str, ...] = ()
    invalid_block_ids: tuple[int, ...] = ()
    #: the order in which the recorded engine iterated these ids and the errors it finished (a
    #: replay in another process: vLLM iterates sets of str ids, whose order follows the process's
    #: hash seed, and the frees follow it); empty: iterate as vLLM would here (a set)
    order: tuple[str, ...] = ()
    #: the order in which the recorded engine finished the requests whose load failed (vLLM's
    #: ``finish_requests(error_req_ids)``, a set of its own): it may disagree with ``order``'s
    #: ranking of ``finished_recving`` (two sets iterated one after the other), so one rank cannot
    #: serve both; empty: use ``order``
    error_order: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("finished_sending", "finished_recving", "failed_recving", "order", "error_order"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(isinstance(x, str) for x in value):
                raise InvalidFieldError(name, value, "a tuple of request ids")
        if not isinstance(self.invalid_block_ids, tuple):
            raise InvalidFieldError("invalid_block_ids", self.invalid_block_ids, "a tuple of block ids >= 0")
        for b in self.invalid_block_ids:
            check_int("invalid_block_ids[i]", b, minimum=0)


BlockIdsT = tuple[tuple[int, ...], ...]


class SchedulerConnector:
    """The scheduler side of a KV connector that the reference scheduler drives (vLLM
    ``KVConnectorBase_V1``'s scheduler-role methods): :class:`ScriptedConnector` and its composition
    :class:`~kvref.impl.reference.scheduler_connector_multi.MultiScriptedConnector`. A base of its
    own so the scheduler accepts either without importing the composition, which imports this
    module (no import cycle, #26)."""


class ScriptedConnector(SchedulerConnector):
    """The fake KV connector's scheduler side: answers chosen by the trace, every call logged.

    Both incarnations run this object: the reference scheduler calls it directly, and vLLM's
    ``Scheduler`` calls it through :class:`kvref.impl.vllm.connector.KvrefScriptedConnector`, which
    only converts vLLM's objects to ids. ``calls`` (name and plain arguments, in call order) is
    what a conformance check compares; ``pending_loads`` / ``sync_loads`` / ``pending_sends`` are
    what a fake worker may report next.

    Args:
        config: the connector's knobs (default: a consumer that recomputes failed loads).
    """

    def __init__(self, config: ConnectorConfig | None = None) -> None:
        if config is None:
            config = ConnectorConfig()
        if not isinstance(config, ConnectorConfig):
            raise InvalidFieldError("config", config, "a ConnectorConfig or None")
        self.config = config
        self.hits: dict[str, ExternalHit] = {}
        self.calls: list[tuple] = []
        #: request id -> (step, block ids, local tokens, external tokens) of async loads in flight
        self.pending_loads: dict[str, tuple[int, BlockIdsT, int, int]] = {}
        #: (step, request id, block ids, local tokens, external tokens) of recent sync loads
        self.sync_loads: list[tuple[int, str, BlockIdsT, int, int]] = []
        #: request ids whose blocks the connector holds after request_finished
        self.pending_sends: dict[str, None] = {}
        self.num_steps = 0
        self.num_lookups: dict[str, int] = {}
        #: request id -> (local tokens, load_async) of its last lookup
        self.last_query: dict[str, tuple[int, bool]] = {}
        self.store_reset = False
        #: requests whose load finished (their remote copy is gone)
        self.consumed: set[str] = set()
        #: the connectors of the same fake world (a MultiConnector's children see each other's
        #: loads in flight; alone, itself)
        self.siblings: list[ScriptedConnector] = [self]

    def set_hit(self, request_id: str, hit: ExternalHit) -> None:
        """What the external store holds for ``request_id`` (before the request is added)."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidFieldError("request_id", request_id, "a non-empty str")
        if not isinstance(hit, ExternalHit):
            raise InvalidFieldError("hit", hit, "an ExternalHit")
        self.hits[request_id] = hit

    # ---- the scheduler-side API of KVConnectorBase_V1 (ids instead of objects) ----------------
    def on_new_request(self, request_id: str) -> None:
        self.calls.append(("on_new_request", request_id))

    def get_num_new_matched_tokens(self, request_id: str, num_tokens: int,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        self.calls.append(("get_num_new_matched_tokens", request_id, num_computed_tokens))
        hit = self.hits.get(request_id, ExternalHit())
        self.last_query[request_id] = (num_computed_tokens, hit.load_async)
        n = self.num_lookups.get(request_id, 0)
        self.num_lookups[request_id] = n + 1
        if n < hit.num_pending_lookups:
            return None, False
        # a finished load (landed or failed) consumed the remote copy, as a P/D transfer's
        # do_remote_prefill is consumed: a later lookup of the same request finds nothing, and a
        # failed load is recomputed locally
        available = 0 if self.store_reset or request_id in self.consumed else hit.num_tokens
        # a sync load must leave a token to compute in the step; an async one may cover the
        # whole prompt (the scheduler recomputes the last token after it lands) -- unless the store
        # keeps its copy: an offload tier matches up to the last prompt token (vLLM's offloading
        # connector), else a one-token prompt would reload for ever after each landing
        whole = hit.load_async and not hit.persistent
        available = min(available, num_tokens if whole else num_tokens - 1)
        ext = max(0, available - num_computed_tokens)
        return ext, hit.load_async and ext > 0

    def get_loaded_kv_cache_group_ids(self, request_id: str, transfer_group_ids: tuple[int, ...],
                                      prefix_cacheable_group_ids: tuple[int, ...]) -> tuple[int, ...]:
        """The KV cache groups this connector's load for ``request_id`` restores (vLLM asks it after
        a positive ``get_num_new_matched_tokens``): the transfer groups for a hit that
        ``loads_all_groups``, else the prefix-cacheable ones. A query without effect, not logged in
        :attr:`calls` (vLLM also asks it for every async load's zeroing, which kvref's connector
        runs do not compare); its answer shows in the replay it decides (computed tokens,
        ``replay_start``, block tables)."""
        for name, ids in (("transfer_group_ids", transfer_group_ids),
                          ("prefix_cacheable_group_ids", prefix_cacheable_group_ids)):
            if not isinstance(ids, tuple) or not all(isinstance(i, int) and i >= 0 for i in ids):
                raise InvalidFieldError(name, ids, "a tuple of KV cache group indices")
        hit = self.hits.get(request_id, ExternalHit())
        return transfer_group_ids if hit.loads_all_groups else prefix_cacheable_group_ids

    def update_state_after_alloc(self, request_id: str, block_ids: BlockIdsT, num_external_tokens: int) -> None:
        self.calls.append(("update_state_after_alloc", request_id, block_ids, num_external_tokens))
        if num_external_tokens > 0:
            local, load_async = self.last_query[request_id]
            if load_async:
                self.pending_loads[request_id] = (self.num_steps, block_ids, local, num_external_tokens)
            else:
                self.sync_loads.append((self.num_steps, request_id, block_ids, local, num_external_tokens))

    def build_connector_meta(self, scheduled_ids: tuple[str, ...], finished_ids: tuple[str, ...]) -> None:
        self.calls.append(("build_connector_meta", scheduled_ids, finished_ids))
        self.num_steps += 1
        self.sync_loads = [s for s in self.sync_loads if s[0] >= self.num_steps - 2]

    def request_finished(self, request_id: str, block_ids: BlockIdsT) -> bool:
        self.calls.append(("request_finished", request_id, block_ids))
        hit = self.hits.get(request_id, ExternalHit())
        # a request whose load (by any sibling) is still in flight frees on finished_recving,
        # never on a send
        loading = any(request_id in c.pending_loads for c in self.siblings)
        delay = hit.delay_free and not loading and any(block_ids)
        if delay:
            self.pending_sends[request_id] = None
        return delay

    def update_connector_output(self, out: KVConnectorOutput) -> None:
        self.calls.append(("update_connector_output", tuple(sorted(out.finished_sending)),
                           tuple(sorted(out.finished_recving)), tuple(sorted(out.failed_recving)),
                           tuple(sorted(out.invalid_block_ids))))
        for rid in out.finished_recving:
            if self.pending_loads.pop(rid, None) is not None and not self.hits.get(rid, ExternalHit()).persistent:
                self.consumed.add(rid)
        for rid in out.finished_sending:
            self.pending_sends.pop(rid, None)

    def has_pending_block_frees(self) -> bool:
        self.calls.append(("has_pending_block_frees",))
        return self.config.pending_frees_stop_preemption and bool(self.pending_sends)

    def reset_cache(self) -> bool | None:
        self.calls.append(("reset_cache",))
        if self.config.reset_cache_result:
            self.store_reset = True
        return self.config.reset_cache_result

    def shutdown(self) -> None:
        """vLLM ``KVConnectorBase_V1.shutdown`` (the scheduler's ``shutdown`` at engine exit): logged."""
        self.calls.append(("shutdown",))


# ---- the scheduler's connector state and rules ----------------------------------------------------
class ConnectorState:
    """The connector bookkeeping of vLLM's ``Scheduler`` (its attributes of the same names)."""

    def __init__(self, connector, policy: str) -> None:
        self.connector = connector
        self.config = connector.config
        self.kv_holding_waiting = WaitingQueue(policy)
        self.loading: set[str] = set()  # WAITING_FOR_REMOTE_KVS
        self.finished_recving_kv_req_ids: set[str] = set()
        self.failed_recving_kv_req_ids: set[str] = set()
        self.inflight_prefills: dict[str, Request] = {}
        # deferred block frees (vLLM ``defer_block_free``): non-empty steps scheduled / processed,
        # (fence, blocks) not yet returned to the pool, each request's last scheduled step
        self.defer_block_free = False
        self.sched_step_seq = 0
        self.processed_step_seq = 0
        self.deferred_frees: deque = deque()
        self.last_sched_seq: dict[str, int] = {}
        # deferred async loads (vLLM ``defer_async_loads``, HiSparse): request id -> (fence,
        # external tokens, connector queries, connector hits), in admission order
        self.defer_async_loads = False
        self.deferred_loads: dict[str, tuple[int, int, int, int]] = {}
        # what make_stats reports (scheduler_connector_stats): the waiting requests the loop
        # skipped since they last ran (vLLM ``deferred_waiting``), async loads by stage
        # (``_kv_fetch_stages``) and the connector's prefix-cache counters since the last call
        self.deferred_waiting: set[str] = set()
        self.kv_fetch_stages: dict[str, str] = {}
        self.connector_prefix_cache_stats = new_connector_prefix_cache_stats()
        #: the connector stats the last update_from_output reported (log_stats; vLLM's
        #: ``SchedulerStats.connector_prefix_cache_stats`` in its return value)
        self.output_connector_prefix_cache_stats: dict | None = None

    @property
    def recompute_kv_load_failures(self) -> bool:
        return self.config.kv_load_failure_policy == RECOMPUTE


def make_state(connector: ScriptedConnector, config, pool=None) -> ConnectorState:
    """The scheduler's connector state; refuses what kvref does not model with a connector (and,
    given the ``pool``, a connector without ``SupportsHMA`` on several KV cache groups)."""
    if not isinstance(connector, SchedulerConnector):
        raise InvalidFieldError("connector", connector, "a ScriptedConnector or MultiScriptedConnector")
    children = getattr(connector, "children", [connector])
    if pool is not None and len(pool.groups) > 1 and not all(c.config.supports_hma for c in children):
        # vLLM turns the hybrid allocator off for such a connector; kvref's pools fix their groups
        raise InvalidFieldError("connector.config.supports_hma", False,
                                f"True with {len(pool.groups)} KV cache groups (a connector without SupportsHMA "
                                "sees one group only)")
    st = ConnectorState(connector, config.policy)
    # With overlapping batches a step may still write a freed request's blocks, and a consumer's
    # load into them would not be ordered after that write: vLLM defers the frees to step fences.
    st.defer_block_free = config.max_concurrent_batches > 1 and not connector.config.is_kv_producer
    # HiSparse reads a released page until the pool reuses it: a load into a reused page must wait
    # for the steps in flight as well
    st.defer_async_loads = st.defer_block_free and connector.config.hisparse_host_pool
    return st


def check_kv_connector_output(sched: "Scheduler", out) -> None:
    if out is None:
        return
    if sched.connector_state is None:
        raise InvalidFieldError("kv_connector_output", out, "None (this scheduler has no KV connector)")
    if not isinstance(out, KVConnectorOutput):
        raise InvalidFieldError("kv_connector_output", out, "a KVConnectorOutput or None")
    for name in ("finished_recving", "finished_sending"):
        for rid in getattr(out, name):
            if rid not in sched.requests:
                raise InvalidFieldError(f"kv_connector_output.{name}", rid,
                                        "ids of requests the scheduler still holds (vLLM asserts it)")
    if out.invalid_block_ids and len(sched.pool.groups) > 1:
        raise InvalidFieldError("kv_connector_output.invalid_block_ids", out.invalid_block_ids,
                                "empty with more than one KV cache group (vLLM refuses; use failed_recving)")


def snapshot(sched: "Scheduler", snap):
    """The snapshot with ``kv_holding_waiting`` and WAITING_FOR_REMOTE_KVS statuses."""
    from dataclasses import replace

    st = sched.connector_state
    states = {rid: (replace(s, status=WAITING_FOR_REMOTE_KVS) if rid in st.loading else s)
              for rid, s in snap.requests.items()}
    return replace(snap, requests=states, kv_holding_waiting=kv_holding_waiting_ids(sched))


def _holds_kv_blocks(st: ConnectorState, request: Request) -> bool:
    """vLLM ``_holds_kv_blocks``: computed tokens, or an async load in flight."""
    return request.num_computed_tokens > 0 or request.request_id in st.loading


def _manager(sched: "Scheduler"):
    manager = getattr(sched.kv_cache_manager, "manager", None)
    if manager is None:
        raise InvalidFieldError("kv_cache_manager", type(sched.kv_cache_manager).__name__,
                                "the reference KV cache manager (connector flows need its coordinator)")
    return manager


def _block_ids(sched: "Scheduler", request_id: str) -> BlockIdsT:
    return tuple(tuple(g) for g in sched.kv_cache_manager.get_block_ids(request_id))


def _spec_decode_span(sched: "Scheduler") -> int:
    """The tokens one speculative-decoding step adds past a sequence: the sampled token, the ``k``
    drafts and the drafter's lookahead slots (vLLM ``1 + num_spec_tokens + num_lookahead_tokens``;
    0 without drafting)."""
    cfg = sched.config
    k = cfg.num_speculative_tokens
    return 1 + k + cfg.num_lookahead_tokens if k else 0


def spec_decode_step_blocks(sched: "Scheduler") -> int:
    """vLLM ``Scheduler._spec_decode_step_blocks``: the blocks one speculative-decoding step may add,
    summed over the non-Mamba groups (Mamba managers count their speculative state blocks
    themselves). An async load is admitted only beside them: it holds its blocks with no forward
    progress, and its first decode step needs them."""
    span = _spec_decode_span(sched)
    return sum(-(-span // g.kv_cache_spec.block_size) for g in sched.pool.groups
               if not isinstance(g.kv_cache_spec, MambaSpec)) if span else 0


def request_remaining_blocks(sched: "Scheduler", request: Request, with_spec_step: bool = True) -> int:
    """vLLM ``_request_remaining_blocks``: blocks ``request`` still needs for its full sequence and
    to be promoted (with drafting, one speculative step past it; ``with_spec_step=False``: the
    sequence alone)."""
    m = _manager(sched)
    full = min(request.num_tokens, sched.max_model_len)
    return m.coordinator.get_num_blocks_to_allocate(
        request.request_id, full + (_spec_decode_span(sched) if with_spec_step else 0),
        m.empty_kv_cache_blocks.blocks, 0,
        request.num_computed_tokens, request.num_computed_tokens, full, apply_admission_cap=True,
        prefill_end=max(request.num_prompt_tokens, request.num_tokens - 1))


def inflight_prefill_reserved_blocks(sched: "Scheduler") -> int:
    """vLLM ``_inflight_prefill_reserved_blocks``: what in-flight prefills still need; an async
    load is admitted only beside it (it holds its blocks with no progress and is not preemptible)."""
    return sum(request_remaining_blocks(sched, r) for r in sched.connector_state.inflight_prefills.values())


def _truncate(hit_ids, num_tokens: int, sched: "Scheduler"):
    """vLLM ``truncate_computed_blocks``: the local hit cut at a block-aligned token count."""
    out = []
    for ids, g in zip(hit_ids, sched.pool.groups):
        out.append(tuple(ids[:num_tokens // g.kv_cache_spec.block_size]))
    return tuple(out)


def _local_prefix_cache_hit(sched: "Scheduler", request: Request, max_cache_hit_length: int | None = None) -> tuple:
    """vLLM ``_get_local_prefix_cache_hit``: ``(hit block ids, local hit tokens, hit_diverged)``.

    A connector that supports divergent local hybrid hits is asked with the full-attention hit
    (``get_computed_blocks_for_connector``: on a Mamba + full-attention pool each group is looked
    up on its own, the Mamba group may lag); any other connector with ``get_computed_blocks``'s.
    Either way the look-up's shared-prefix junction is kept (Mamba "align")."""
    kv = sched.kv_cache_manager
    lookup = getattr(kv, "get_computed_blocks_for_connector", None)
    if sched.connector_state.config.divergent_local_hybrid_hits and lookup is not None:
        hit_ids, num_local, boundary, diverged = lookup(request) if max_cache_hit_length is None else \
            lookup(request, max_cache_hit_length)  # the aux-output connector's max_cache_hit
        request.shared_prefix_boundary = boundary
        return hit_ids, num_local, diverged
    hit_ids, num_local = kv.get_computed_blocks(request) if max_cache_hit_length is None else \
        kv.get_computed_blocks(request, max_cache_hit_length)
    store_shared_prefix_boundary(sched, request)  # vLLM keeps the look-up's junction (Mamba "align")
    return hit_ids, num_local, False


def load_restores_replay_window(sched: "Scheduler", request_id: str) -> bool:
    """vLLM ``_load_restores_replay_window``: the connector's load for ``request_id`` restores every
    bounded-replay group. The connector is asked only on a pool with such a group; kvref's pools
    transfer every group (vLLM's ``KVCacheGroupSpec.enable_kv_transfer`` defaults to True), so the
    transfer groups are all of them and the prefix-cacheable ones those whose spec caches."""
    groups = sched.pool.groups
    replay_ids = tuple(i for i, g in enumerate(groups) if g.kv_cache_spec.prefix_replay_tokens > 0)
    if not replay_ids:
        return False
    loaded = sched.connector_state.connector.get_loaded_kv_cache_group_ids(
        request_id, tuple(range(len(groups))),
        tuple(i for i, g in enumerate(groups) if g.kv_cache_spec.prefix_cacheable))
    return _replay.load_restores_window(replay_ids, tuple(loaded))


def schedule_waiting(sched: "Scheduler", token_budget: int, long_prefill: int, scheduled: dict,
                     prefill_scheduled: bool = False) -> int:
    """vLLM ``schedule()``'s waiting loop with a KV connector (see the module docstring).

    ``prefill_scheduled``: a running prefill chunk is in the batch (no speculative-decoding padding
    of an admission, as without a connector)."""
    cfg = sched.config
    kv = sched.kv_cache_manager
    st = sched.connector_state
    conn = st.connector
    skipped_waiting: list[Request] = []
    skipped_holding: list[Request] = []

    def skip(queue: WaitingQueue) -> None:
        r = queue.pop_request()
        st.deferred_waiting.add(r.request_id)
        (skipped_holding if _holds_kv_blocks(st, r) else skipped_waiting).append(r)

    while token_budget > 0:
        # requests holding KV blocks drain first, and are the only ones PAUSED_NEW admits
        queue = st.kv_holding_waiting if st.kv_holding_waiting else (
            sched.waiting if sched.pause_state == 0 else None)  # 0: PauseState.UNPAUSED
        if not queue or len(sched.running) >= cfg.max_num_active_reqs:
            break
        request = queue.peek_request()
        rid = request.request_id
        if rid in st.loading:
            if rid not in st.finished_recving_kv_req_ids:
                skip(queue)  # still loading: does not block the queue
                continue
            update_waiting_for_remote_kv(sched, request)
        if request.num_stale_output_tokens and not request.drop_stale_output:
            skip(queue)
            continue

        num_external = 0
        load_async = False
        hit_ids = None
        num_local = 0
        window = sched.prefix_replay_tokens
        window_loaded = False
        looked_up = request.num_computed_tokens == 0
        queries = 0
        if looked_up:
            aux = sched.aux_output  # vLLM: the aux-output connector caps the local look-up
            max_hit = aux.max_cache_hit(request) if aux is not None else None
            hit_ids, num_local, hit_diverged = _local_prefix_cache_hit(sched, request, max_hit)
            block_size = sched.pool.scheduler_block_size
            partial_tail = num_local % block_size
            aligned = num_local - partial_tail
            ext, load_async = conn.get_num_new_matched_tokens(rid, request.num_tokens, aligned)
            if request.skip_reading_prefix_cache:  # vLLM: asked, then ignored ("ask again" too)
                ext, load_async = 0, False
            if ext is None:
                skip(queue)  # the connector cannot answer yet
                continue
            if window:
                # SWA bounded replay: a load without the window is cut to whole blocks
                ext, load_async = _replay.trim_external_hit(
                    block_size, ext, load_async, bool(ext) and load_restores_replay_window(sched, rid))
            if partial_tail and ext > partial_tail:
                # a strictly longer remote hit supersedes the local sub-block tail
                hit_ids = _truncate(hit_ids, aligned, sched)
                num_local = aligned
                num_external = ext
            elif partial_tail:
                load_async = False
            else:
                num_external = ext
            if aux is not None:  # vLLM cap_external_hit: block-aligned and within max_cache_hit, or none
                num_external = aux.cap_external_hit(request, num_local, num_external)
                load_async = load_async and num_external > 0
            if hit_diverged and num_external == 0:
                # no external tokens back the deeper full-attention hit: its Mamba state is missing,
                # so vLLM reconciles to the hit every group agrees on
                hit_ids, num_local = kv.get_computed_blocks(request) if max_hit is None else \
                    kv.get_computed_blocks(request, max_hit)
                store_shared_prefix_boundary(sched, request)
            num_computed = num_local + num_external
            assert num_computed <= request.num_tokens
            queries = request.num_tokens - num_local  # vLLM: connector queries, counted before a drop
            # SWA bounded replay: a load that carries the window is taken as is; any other hit no
            # longer than the window would be recomputed in full, so it is dropped (load included)
            window_loaded = bool(num_external) and load_restores_replay_window(sched, rid)
            if not window_loaded and _replay.drop_short_hit(window, num_computed):
                hit_ids, num_local, num_external, num_computed, load_async = None, 0, 0, 0, False
            set_kv_fetch_stage(st, rid, KV_FETCH_WAITING_TO_START if load_async else None)
        else:
            num_computed = request.num_computed_tokens  # a promoted load

        is_padded = False
        num_replay = 0  # an async load replays once it landed (update_waiting_for_remote_kv)
        if load_async:
            num_new = 0
        else:
            if looked_up and window:
                num_replay, request.replay_start = _replay.mark_prefix_replay(window, num_computed, window_loaded)
                num_computed -= num_replay
            num_new = request.num_tokens - num_computed
            # speculative decoding: an admission with one token left is padded to 1 + k, as
            # without a connector (num_computed counts the external hit too)
            padded = sched.spec_decode.pad_new_decode(
                num_new, num_computed, prefill_scheduled, any(v[1] == "running" for v in scheduled.values()),
                token_budget, sched.max_model_len)
            if padded is None:
                break  # vLLM: "prefer to not schedule than schedule un-padded"
            is_padded, num_new = padded != num_new, padded
            if 0 < long_prefill < num_new:
                num_new = long_prefill
            if not cfg.enable_chunked_prefill and num_new > token_budget:
                break
            num_new = min(num_new, token_budget)
            assert num_new > 0
            # Mamba "align": vLLM's _mamba_block_aligned_split also on the connector path, the
            # chunk starting after the local and the external hit
            num_new = split_scheduled_chunk(sched, request, num_new, num_local,
                                            num_external_computed_tokens=num_external)
            if num_new == 0:
                break
            if is_padded and num_new != padded:
                num_new, is_padded = 1, False  # vLLM drops spec-decode padding the alignment clipped
            if sched.pool.num_prefill_lookahead > 1:  # multi-module MTP: requeued when cut to nothing
                num_new = reserve_prefill_lookahead(sched.pool.num_prefill_lookahead, request, num_computed, num_new)
                if num_new == 0:
                    skip(queue)
                    continue

        # an async load is admitted beside what in-flight prefills still need and one speculative
        # step of its own; its lookahead slots are allocated once it runs (vLLM
        # limit_lookahead_tokens: local and remote block counts must match during the load)
        reserved = inflight_prefill_reserved_blocks(sched) + spec_decode_step_blocks(sched) if load_async else 0
        blocks = kv.allocate_slots(
            request, _replay.slots_past_hit(num_new, num_replay), num_new_computed_tokens=num_local,
            new_computed_block_ids=hit_ids,
            num_lookahead_tokens=0 if load_async else cfg.num_lookahead_tokens,
            num_external_computed_tokens=num_external, delay_cache_blocks=load_async,
            full_sequence_must_fit=cfg.scheduler_reserve_full_isl, reserved_blocks=reserved,
            has_scheduled_reqs=bool(sched.running))
        if blocks is None:
            break  # head-of-line, as without a connector
        # HiSparse: a step in flight may still read the pages this load would write; the connector
        # hears of the load (and the stats record it) once that step was processed
        defer_load = load_async and st.defer_async_loads and st.sched_step_seq > st.processed_step_seq
        if defer_load:
            st.last_sched_seq[rid] = st.sched_step_seq
            st.deferred_loads[rid] = (st.sched_step_seq, num_external, queries, num_external)
        else:
            conn.update_state_after_alloc(rid, _block_ids(sched, rid), num_external)
        record = getattr(kv, "record_prefix_cache_stats", None) if sched.records_prefix_cache_stats else None
        if looked_up and record is not None:  # a fresh local lookup, recorded at admission as vLLM does
            record(request, num_local)
        if queries and not defer_load:
            record_connector_prefix_cache_stats(st, request, queries, num_external)

        if load_async:
            st.loading.add(rid)
            if sched.aux_output is not None:
                sched.aux_output.request_loading(request, num_computed)  # held against release
            request.num_computed_tokens = num_computed
            st.inflight_prefills[rid] = request
            set_kv_fetch_stage(st, rid, KV_FETCH_IN_PROGRESS)
            skip(queue)
            continue

        queue.pop_request()
        st.deferred_waiting.discard(rid)
        sched.running.append(request)
        kind = "new" if request.status == RequestStatus.WAITING else "resumed"
        scheduled[rid] = (request, kind, num_new, kv.get_block_ids(rid))
        token_budget -= num_new
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed
        sched.spec_decode.note_scheduled(request, num_computed, num_new)
        if is_padded:
            sched.spec_decode.mark_padded(rid)
        set_kv_fetch_stage(st, rid, None)
        if num_computed + num_new < request.num_tokens:
            st.inflight_prefills[rid] = request
    if skipped_holding:
        st.kv_holding_waiting.prepend_requests(skipped_holding)
    if skipped_waiting:
        sched.waiting.prepend_requests(skipped_waiting)
    return token_budget


def update_waiting_for_remote_kv(sched: "Scheduler", request: Request) -> None:
    """vLLM ``_update_waiting_for_remote_kv``: a finished (or failed) load is promoted."""
    st = sched.connector_state
    kv = sched.kv_cache_manager
    rid = request.request_id
    load_failed = rid in st.failed_recving_kv_req_ids
    if load_failed:
        if request.num_computed_tokens:
            kv.cache_blocks(request, request.num_computed_tokens)  # the valid prefix
        else:
            kv.free(request)  # nothing valid: a retry may hit the local cache
        st.failed_recving_kv_req_ids.remove(rid)
    else:
        kv.cache_blocks(request, request.num_computed_tokens)
    # SWA bounded replay: the tail of a load without the window (or of a failed one, which may have
    # lost it) is recomputed, the last token included; else a whole-prompt load recomputes that one
    num_replay = 0
    if sched.prefix_replay_tokens:
        num_replay, request.replay_start = _replay.mark_prefix_replay(
            sched.prefix_replay_tokens, request.num_computed_tokens,
            not load_failed and load_restores_replay_window(sched, rid))
    if num_replay > 0:
        request.num_computed_tokens -= num_replay
    elif request.num_computed_tokens == request.num_tokens:
        request.num_computed_tokens = request.num_tokens - 1  # recompute the last token to sample
    st.finished_recving_kv_req_ids.remove(rid)
    st.loading.discard(rid)


def after_schedule(sched: "Scheduler", out) -> None:
    """vLLM ``build_connector_meta`` (before ``_update_after_schedule``); with deferred frees, a
    non-empty step advances the scheduled-step fence."""
    st = sched.connector_state
    st.connector.build_connector_meta(tuple(s.request_id for s in out.scheduled),
                                      tuple(sorted(out.finished_req_ids)))
    if st.defer_block_free and out.total_num_scheduled_tokens > 0:
        st.sched_step_seq += 1


def after_update_after_schedule(sched: "Scheduler", out) -> None:
    """The in-flight prefill set's update, and each scheduled request's fence step."""
    st = sched.connector_state
    for s in out.scheduled:
        r = sched.requests[s.request_id]
        if st.defer_block_free:
            st.last_sched_seq[s.request_id] = st.sched_step_seq
        if not r.is_prefill_chunk:
            st.inflight_prefills.pop(s.request_id, None)


def _blocks_can_be_freed(st: ConnectorState, request: Request) -> bool:
    """vLLM ``_request_blocks_can_be_freed``: no step that may still write them is in flight."""
    return not st.defer_block_free or st.last_sched_seq.get(request.request_id, 0) <= st.processed_step_seq


def victim_blocks_can_be_freed(sched: "Scheduler") -> bool:
    """Before preempting: would freeing the victim's blocks help now? (vLLM picks the victim,
    ``running[-1]`` or the lowest priority, and stops preempting when its free is deferred.)"""
    st = sched.connector_state
    if st is None or not st.defer_block_free:
        return True
    from kvref.impl.scheduler_types import PRIORITY

    victim = (max(sched.running, key=lambda r: (r.priority, r.arrival_time))
              if sched.config.policy == PRIORITY else sched.running[-1])
    return _blocks_can_be_freed(st, victim)


def free_request_blocks(sched: "Scheduler", request: Request) -> None:
    """vLLM ``_free_request_blocks``: free now, or pop the tables and return the blocks to the
    pool once the steps that may write them were processed."""
    st = sched.connector_state
    if _blocks_can_be_freed(st, request):
        sched.kv_cache_manager.free(request)
        return
    blocks = _manager(sched).pop_blocks_for_free(request)
    if blocks:
        st.deferred_frees.append((st.sched_step_seq, blocks))


def _drain_deferred_frees(sched: "Scheduler") -> None:
    """vLLM ``_drain_deferred_frees``: return, in fence order, the blocks whose fence step was
    processed (each list tail first, so tail blocks are evicted first)."""
    st = sched.connector_state
    pool = _manager(sched).block_pool
    while st.deferred_frees and st.deferred_frees[0][0] <= st.processed_step_seq:
        _, blocks = st.deferred_frees.popleft()
        pool.free_blocks(reversed(blocks))


def release_cow_copies(sched: "Scheduler") -> None:
    """vLLM ``schedule()``'s ``take_kv_cache_block_copies`` + ``_free_cow_retained_blocks`` on a
    connector run: both endpoints of each copy-on-write pair (Mamba "align" mode) were retained for
    this step's copies; they return to the pool now, or -- with deferred frees -- once the step
    that runs the copies was processed (fence ``sched_step_seq + 1``: the seq this step gets if it
    schedules anything). Without it a connector run on an align pool kept every retained endpoint
    for good: vLLM's free count ran ahead of the reference's after a delayed-free finish (#28)."""
    st = sched.connector_state
    retained: list = []
    for manager in _manager(sched).coordinator.single_type_managers:
        for source, cow in manager.take_pending_cow_copies():
            retained += (source, cow)
    if not retained:
        return
    fence = st.sched_step_seq + 1
    if not st.defer_block_free or fence <= st.processed_step_seq:
        _manager(sched).block_pool.free_blocks(retained)
        return
    # vLLM stores them reversed and _drain_deferred_frees frees reversed(blocks): the given order
    st.deferred_frees.append((fence, retained[::-1]))


def step_processed(sched: "Scheduler", num_scheduled_tokens: dict[str, int]) -> None:
    """vLLM ``update_from_output``'s first act with deferred frees: a processed non-empty step
    advances the fence and drains what it releases."""
    st = sched.connector_state
    if st.defer_block_free and sum(num_scheduled_tokens.values()) > 0:
        st.processed_step_seq += 1
        _drain_deferred_frees(sched)
        _drain_deferred_loads(sched)


def _drain_deferred_loads(sched: "Scheduler") -> None:
    """vLLM ``_drain_deferred_loads``: hand the connector, in admission order, the deferred async
    loads whose fence step was processed (stopping at the first still fenced), with the blocks
    the request holds now, and record their connector stats then."""
    st = sched.connector_state
    for rid, (fence, num_tokens, queries, hits) in list(st.deferred_loads.items()):
        if fence > st.processed_step_seq:
            break
        del st.deferred_loads[rid]
        st.connector.update_state_after_alloc(rid, _block_ids(sched, rid), num_tokens)
        if queries:
            record_connector_prefix_cache_stats(st, sched.requests[rid], queries, hits)


def requires_kv_delivery(sched: "Scheduler") -> bool:
    st = sched.connector_state
    return st is not None and st.config.delivery


def has_pending_block_frees(sched: "Scheduler") -> bool:
    st = sched.connector_state
    return st is not None and st.connector.has_pending_block_frees()


# ---- outputs --------------------------------------------------------------------------------------
def handle_failures(sched: "Scheduler", kv_output: KVConnectorOutput | None,
                    num_scheduled_tokens: dict[str, int]) -> set[str]:
    """vLLM ``update_from_output``'s first part: failed receives and invalid blocks. Returns the
    request ids whose output this step is skipped (and, under ``"fail"``, finished as errors)."""
    step_processed(sched, num_scheduled_tokens)
    failed: set[str] = set()
    if kv_output is None:
        return failed
    if kv_output.failed_recving:
        failed.update(_handle_failed_recving(sched, set(kv_output.failed_recving)))
    if kv_output.invalid_block_ids:
        failed.update(_handle_invalid_blocks(sched, set(kv_output.invalid_block_ids), num_scheduled_tokens))
    return failed


def _handle_failed_recving(sched: "Scheduler", failed_req_ids: set[str]) -> set[str]:
    """vLLM ``_handle_failed_recving``: a receive failed as a whole (any layout)."""
    st = sched.connector_state
    affected: set[str] = set()
    for rid in failed_req_ids:
        request = sched.requests.get(rid)
        if request is not None and rid in st.loading:
            affected.add(rid)
            if st.recompute_kv_load_failures:
                request.num_computed_tokens = 0
                st.failed_recving_kv_req_ids.add(rid)
    return set() if st.recompute_kv_load_failures else affected


def _update_requests_with_invalid_blocks(sched: "Scheduler", requests, invalid: set[int],
                                         num_scheduled_tokens: dict[str, int], evict_blocks: bool):
    """vLLM ``_update_requests_with_invalid_blocks``: truncate each affected request's computed
    tokens at its first invalid block; a block shared with an earlier affected request is
    recomputed by that one only."""
    affected: set[str] = set()
    total = 0
    to_evict: set[int] = set()
    marked: set[int] = set()
    block_size = sched.pool.scheduler_block_size
    for request in requests:
        is_affected = False
        marked_invalid_block = False
        rid = request.request_id
        (req_block_ids,) = sched.kv_cache_manager.get_block_ids(rid)
        req_num_computed = request.num_computed_tokens - num_scheduled_tokens.get(rid, 0)
        req_num_blocks = (req_num_computed + block_size - 1) // block_size
        for idx, block_id in zip(range(req_num_blocks), req_block_ids):
            if block_id not in invalid:
                continue
            is_affected = True
            if block_id in marked:
                continue
            marked.add(block_id)
            if marked_invalid_block:
                continue
            marked_invalid_block = True
            request.num_computed_tokens = idx * block_size
            total += req_num_computed - request.num_computed_tokens
            if evict_blocks:
                to_evict.update(req_block_ids[idx:])
        if is_affected:
            if not marked_invalid_block:
                total += request.num_computed_tokens - req_num_computed
                request.num_computed_tokens = req_num_computed
            affected.add(rid)
    return affected, total, to_evict


def _handle_invalid_blocks(sched: "Scheduler", invalid: set[int], num_scheduled_tokens: dict[str, int]) -> set[str]:
    """vLLM ``_handle_invalid_blocks``: async loads (not cached yet) and running requests (sync
    loads, possibly cached: evicted under ``"fail"``)."""
    st = sched.connector_state
    if len(sched.pool.groups) > 1:
        raise RuntimeError("A KV connector reported block-level load failures (invalid_block_ids) "
                           "which is not supported for models with multiple KV cache groups.")
    async_reqs = [r for r in st.kv_holding_waiting if r.request_id in st.loading]
    async_failed, _, _ = _update_requests_with_invalid_blocks(sched, async_reqs, invalid, num_scheduled_tokens,
                                                              evict_blocks=False)
    sync_failed, _, to_evict = _update_requests_with_invalid_blocks(sched, list(sched.running), invalid,
                                                                    num_scheduled_tokens, evict_blocks=True)
    if not (async_failed or sync_failed):
        return set()
    if to_evict and not st.recompute_kv_load_failures:
        sched.kv_cache_manager.evict_blocks(to_evict)
    if not st.recompute_kv_load_failures:
        return async_failed | sync_failed
    st.failed_recving_kv_req_ids |= async_failed
    return sync_failed


def _in_order(ids, kv_output: KVConnectorOutput | None, errors: bool = False):
    """``set(ids)`` (vLLM's iteration), or in the recorded engine's order (``kv_output.order``;
    ``errors``: its ``error_order`` where recorded)."""
    order = kv_output and ((errors and kv_output.error_order) or kv_output.order)
    if not order:
        return set(ids)
    rank = {rid: i for i, rid in enumerate(order)}
    return sorted(set(ids), key=lambda rid: rank.get(rid, len(rank)))


def after_output(sched: "Scheduler", kv_output: KVConnectorOutput | None, failed: set[str]) -> None:
    """vLLM ``update_from_output``'s end: fail-policy errors, then finished transfers."""
    st = sched.connector_state
    error_ids: set[str] = set()
    if failed and not st.recompute_kv_load_failures:
        error_ids.update(failed)
    if error_ids:
        finish_requests(sched, _in_order(error_ids, kv_output, errors=True), "error")
    if kv_output is not None:
        _finished_transfers(sched, kv_output)
    if sched.pool.log_stats:
        # vLLM's update_from_output ends with make_stats() (the step's SchedulerStats), which starts
        # fresh connector stats: what this update recorded (deferred loads it handed the connector)
        # goes out with this step, not to a later make_stats
        st.output_connector_prefix_cache_stats = st.connector_prefix_cache_stats
        st.connector_prefix_cache_stats = new_connector_prefix_cache_stats()


def _finished_transfers(sched: "Scheduler", kv_output: KVConnectorOutput) -> None:
    """The connector's report: finished loads are promoted at the next schedule, finished sends
    (and loads of requests that finished meanwhile) free the blocks."""
    st = sched.connector_state
    st.connector.update_connector_output(kv_output)
    for rid in _in_order(kv_output.finished_recving, kv_output):
        request = sched.requests[rid]
        if rid in st.loading:
            st.finished_recving_kv_req_ids.add(rid)
            set_kv_fetch_stage(st, rid, KV_FETCH_COMPLETED_WAITING)
        else:
            assert request.status == RequestStatus.FINISHED, rid
            _free_blocks(sched, request)
    for rid in _in_order(kv_output.finished_sending, kv_output):
        _free_blocks(sched, sched.requests[rid])


def _free_blocks(sched: "Scheduler", request: Request) -> None:
    assert request.status == RequestStatus.FINISHED
    free_request_blocks(sched, request)
    del sched.requests[request.request_id]
    sched.connector_state.last_sched_seq.pop(request.request_id, None)


def finish_requests(sched: "Scheduler", ids, reason: str) -> list[Request]:
    """vLLM ``finish_requests`` with a connector: a request whose load is in flight keeps its
    blocks until ``finished_recving`` (the connector still writes them)."""
    st = sched.connector_state
    valid = []
    for rid in ids:
        request = sched.requests.get(rid)
        if request is None or request.status == RequestStatus.FINISHED:
            continue
        valid.append(request)
    gone = {id(r) for r in valid}
    sched.running = [r for r in sched.running if id(r) not in gone]
    sched.waiting.remove_requests(valid)
    st.kv_holding_waiting.remove_requests(valid)
    st.deferred_waiting.difference_update(r.request_id for r in valid)
    for request in valid:
        rid = request.request_id
        delay = False
        if rid in st.loading:
            # a deferred load never started, so it will not report done: free now
            delay = st.deferred_loads.pop(rid, None) is None and rid not in st.finished_recving_kv_req_ids
            st.finished_recving_kv_req_ids.discard(rid)
            st.failed_recving_kv_req_ids.discard(rid)
            st.loading.discard(rid)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        free_request(sched, request, delay)
    return valid


def free_request(sched: "Scheduler", request: Request, delay_free_blocks: bool = False) -> None:
    """vLLM ``_free_request`` with ``_connector_finished``: the connector sees the block table
    clipped to the computed tokens (after out-of-window blocks were dropped) and may keep the
    blocks (``delay_free``); they are freed on ``finished_sending``."""
    if sched.aux_output is not None:
        sched.aux_output.request_finished(request)  # vLLM: first thing _free_request does
    st = sched.connector_state
    st.inflight_prefills.pop(request.request_id, None)
    set_kv_fetch_stage(st, request.request_id, None)
    # a finished request has no drafts, also while the connector keeps its blocks (speculative
    # decoding beside a connector, session 19: its placeholder drafts outlived it)
    sched.spec_decode.forget(request.request_id)
    m = _manager(sched)
    rid = request.request_id
    m.remove_skipped_blocks(rid, max(0, request.num_computed_tokens - request.num_in_flight_tokens),
                            request.num_prompt_tokens)
    block_ids = block_ids_for_computed_tokens(sched, rid, request.num_computed_tokens)
    delay = st.connector.request_finished(rid, block_ids)
    sched.finished_req_ids.add(rid)
    if not (delay_free_blocks or delay):
        _free_blocks(sched, request)


def block_ids_for_computed_tokens(sched: "Scheduler", request_id: str, num_computed_tokens: int) -> BlockIdsT:
    """vLLM ``KVCacheManager.get_block_ids_for_computed_tokens``: attention groups clipped to the
    blocks covering the computed tokens; Mamba groups whole."""
    out = []
    for ids, g in zip(_block_ids(sched, request_id), sched.pool.groups):
        spec = g.kv_cache_spec
        if isinstance(spec, MambaSpec):
            out.append(ids)
        else:
            out.append(ids[:-(-num_computed_tokens // spec.block_size)])
    return tuple(out)


# ---- reset ----------------------------------------------------------------------------------------
def reset_prefix_cache(sched: "Scheduler", reset_running_requests: bool = False,
                       reset_connector: bool = False) -> bool:
    """vLLM ``Scheduler.reset_prefix_cache``: optionally preempt every running request (their
    in-flight output is dropped), reset the prefix cache, optionally reset the connector's cache.

    Raises RuntimeError where vLLM does: running requests were preempted and the reset still
    failed (an async load holds blocks)."""
    for name, value in (("reset_running_requests", reset_running_requests), ("reset_connector", reset_connector)):
        if not isinstance(value, bool):
            raise InvalidFieldError(name, value, "True or False")
    if reset_running_requests:
        while sched.running:
            sched._preempt_request(sched.running.pop(), drop_stale_output=True)
    reset = getattr(sched.kv_cache_manager, "reset_prefix_cache", None)
    if reset is None:
        raise InvalidFieldError("kv_cache_manager", type(sched.kv_cache_manager).__name__,
                                "a manager with reset_prefix_cache()")
    ok = reset()
    if reset_running_requests and not ok:
        raise RuntimeError("Failed to reset KV cache even when all the running requests are preempted "
                           "and moved to the waiting queue.")
    if reset_connector:
        ok = reset_connector_cache(sched) and ok
    return ok


def reset_connector_cache(sched: "Scheduler") -> bool:
    """vLLM ``reset_connector_cache``: no connector is a success; ``reset_cache() is False`` a failure."""
    st = sched.connector_state
    if st is None:
        return True
    if st.connector.reset_cache() is False:
        return False
    flag_connector_reset(st)  # vLLM (log_stats): connector_prefix_cache_stats.reset = True
    return True


# ---- observation ----------------------------------------------------------------------------------
def check_invariants(sched: "Scheduler") -> None:
    """The scheduler's queue invariants with a connector: every live request in exactly one of
    running / waiting / kv_holding_waiting; finished requests still in ``requests`` only while
    the connector holds their blocks; plain waiting requests hold no KV."""
    st = sched.connector_state
    st.kv_holding_waiting.check_invariants()
    sched.waiting.check_invariants()
    waiting = list(sched.waiting)
    holding = list(st.kv_holding_waiting)
    ids = [r.request_id for r in sched.running] + [r.request_id for r in waiting] + [r.request_id for r in holding]
    assert len(ids) == len(set(ids)), "Q1: request in two queues"
    live = {rid for rid, r in sched.requests.items() if r.status != RequestStatus.FINISHED}
    assert set(ids) == live, "Q1: live request in no queue (or a queued dead one)"
    _check_stats_invariants(st, sched.requests)
    assert len(sched.running) <= sched.config.max_num_seqs, \
        f"Q1: {len(sched.running)} running, max_num_seqs={sched.config.max_num_seqs}"
    assert st.loading <= {r.request_id for r in holding} | set(), "Q7: a loading request outside kv_holding_waiting"
    for r in sched.running:
        assert r.status == RequestStatus.RUNNING and r.request_id not in st.loading, \
            f"Q2: running request {r.request_id} is {r.status.value} (loading: {r.request_id in st.loading})"
        assert r.num_computed_tokens < sched.max_model_len, \
            f"Q6: request {r.request_id} computed {r.num_computed_tokens}, max_model_len={sched.max_model_len}"
    for r in waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), \
            f"Q2: waiting request {r.request_id} is {r.status.value}"
        assert r.num_computed_tokens == 0 and r.num_output_placeholders == 0, \
            f"Q3: waiting request {r.request_id} keeps {r.num_computed_tokens} computed tokens, " \
            f"{r.num_output_placeholders} placeholders"
        assert not any(sched.kv_cache_manager.get_block_ids(r.request_id)), \
            f"Q3: waiting request {r.request_id} holds blocks"
    for r in holding:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), \
            f"Q2: KV-holding waiting request {r.request_id} is {r.status.value}"
    assert st.finished_recving_kv_req_ids <= st.loading and st.failed_recving_kv_req_ids <= st.loading, \
        "Q7: a finished or failed KV load of a request that is not loading"
    assert set(st.deferred_loads) <= st.loading and (st.defer_async_loads or not st.deferred_loads), \
        "Q7: a deferred KV load of a request that is not loading (or without defer_async_loads)"
    assert all(f <= st.sched_step_seq for f, *_ in st.deferred_loads.values()), "Q7: a deferred load fenced ahead"
    assert set(st.inflight_prefills) <= set(sched.requests), "Q7: an in-flight prefill of an unknown request"
    m = _manager(sched)
    # blocks waiting in deferred_frees hold a reference no table slot accounts for
    m.check_invariants(strict_ref_counts=not st.deferred_frees)
    held = [b.block_id for _, blocks in st.deferred_frees for b in blocks if not b.is_null]
    assert all(m.block_pool.blocks[b].ref_cnt >= 1 for b in held), "Q8: a deferred block was freed early"
    # near-monotonic, as vLLM's: a copy-on-write retention's fence (sched_step_seq + 1) may lead a
    # request free's fence by one step
    assert all(f <= st.sched_step_seq + 1 for f, _ in st.deferred_frees), \
        "Q8: a deferred free fenced past the next step"
    assert not st.deferred_frees or st.deferred_frees[0][0] > st.processed_step_seq, \
        f"Q8: a deferred free due at step {st.deferred_frees[0][0]}, already processed {st.processed_step_seq}"


def num_kv_holding_waiting(sched: "Scheduler") -> int:
    st = sched.connector_state
    return 0 if st is None else len(st.kv_holding_waiting)


def kv_holding_waiting_ids(sched: "Scheduler") -> tuple[str, ...]:
    st = sched.connector_state
    return () if st is None else tuple(r.request_id for r in st.kv_holding_waiting)


__all__ = [
    "ConnectorConfig", "ExternalHit", "KVConnectorOutput", "ScriptedConnector",
    "KV_CONSUMER", "KV_PRODUCER", "RECOMPUTE", "FAIL", "WAITING_FOR_REMOTE_KVS",
]
