"""Scheduler traces with a KV connector: the reference scheduler and vLLM 0.33.0's ``Scheduler`` /
``AsyncScheduler`` driven in lock step with the same scripted connector answers.

Each target gets its own :class:`~kvref.impl.reference.scheduler_connector.ScriptedConnector` (vLLM's
through its ``kv_transfer_config``: :mod:`kvref.impl.vllm.connector`). The trace draws, per
request, what the external store holds (nothing, a prefix, the whole prompt), whether it loads
synchronously or asynchronously, how many lookups answer "not yet" and whether the connector keeps
the blocks after the request finishes (an async send); per setup the connector's role, the
``kv_load_failure_policy`` (recompute or fail), ``requires_kv_delivery``, whether pending sends
stop preemption, and what a connector cache reset answers. The fake worker then reports, in each
settled step's ``KVConnectorOutput``, async loads finishing (now, later, out of order), failing as
a whole (``failed_recving``) or in some blocks (``invalid_block_ids``, single-group pools, as vLLM
requires), sync loads with invalid blocks, and sends finishing. ``reset_prefix_cache`` with and
without the connector reset (and preempting the running requests) is a rule of its own.

After every operation every target's scheduler output, snapshot (queues including
``kv_holding_waiting``, request states including ``waiting_for_remote_kvs``, computed tokens,
block tables per group, free blocks and free-queue order), published KV events and the
connector's call log (every call with its arguments: lookups with the local hit, allocations with
block ids and external tokens, ``build_connector_meta`` with the batch, ``request_finished`` with the
clipped block table, ``update_connector_output``, ``has_pending_block_frees``, ``reset_cache``)
must be equal.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, replace
from typing import Any, Callable

from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from kvref.impl.interface import PoolConfig
from kvref.impl.reference.scheduler_connector import (
    FAIL,
    KV_CONSUMER,
    KV_PRODUCER,
    RECOMPUTE,
    ConnectorConfig,
    ExternalHit,
    KVConnectorOutput,
    ScriptedConnector,
)
from kvref.impl.reference.scheduler_connector_multi import MultiScriptedConnector
from kvref.impl.scheduler_types import SchedulerConfig

from .scheduler import (
    COVERAGE,
    Divergence,
    Lockstep,
    SchedulerMachine,
    SchedulerRun,
    _AcceptedDuringTeardown,
    _diverge,
    request_specs,
    scheduler_setups,
)

CONNECTOR_COVERAGE: Counter = Counter()
"""Tallies of the connector paths the traces reached (tests assert the rare ones occur)."""

OUTCOMES = ("wait", "wait", "ok", "ok", "failed", "invalid")


@st.composite
def connector_setups(draw, kinds=("full", "full", "full", "full+swa", "full+chunked", "full+mamba"),
                     large: bool = False, async_scheduling: bool | None = None,
                     roles: tuple[str, ...] = (KV_CONSUMER, KV_PRODUCER), tight: bool | None = None,
                     spec: bool = False):
    """``(PoolConfig, SchedulerConfig, ConnectorConfig)``: startup-consistent pools (mostly tight),
    sync or async scheduling (a consumer's block frees are then deferred to step fences);
    ``async_scheduling`` / ``roles`` / ``tight`` narrow the draw (scheduler_lifecycle.py; ``tight``
    None: drawn); ``spec``: speculative decoding on (n-gram or EAGLE-like drafting beside the
    connector: padded admissions, lookahead slots, a speculative step reserved beside async loads)."""
    tight = draw(st.booleans()) if tight is None else tight
    pool, cfg = draw(scheduler_setups(consistent=True, kinds=kinds, tight=tight, large=large,
                                      async_scheduling=async_scheduling, spec=True if spec else False))
    if spec and pool.num_hash_lookahead_tokens:
        # vLLM: "KV connectors, including HiSparse's, keep the legacy hashes"
        # (VllmConfig.num_hash_lookahead_tokens is 0 with a kv_transfer_config), so an EAGLE
        # drafter drops the trailing hit block instead
        pool = replace(pool, num_hash_lookahead_tokens=0, use_eagle=cfg.use_eagle)
    role = draw(st.sampled_from(roles))
    policy = draw(st.sampled_from((RECOMPUTE, RECOMPUTE, FAIL)))

    def one() -> ConnectorConfig:
        return ConnectorConfig(
            kv_role=role, kv_load_failure_policy=policy,
            requires_kv_delivery=draw(st.sampled_from((None, None, False, True))),
            pending_frees_stop_preemption=draw(st.sampled_from((False, False, True))),
            divergent_local_hybrid_hits=draw(st.booleans()),
            reset_cache_result=draw(st.sampled_from((True, True, False, None))))

    # one setup in three composes two connectors through vLLM's MultiConnector
    conn = one() if draw(st.integers(0, 2)) else (one(), one())
    return pool, cfg, conn


def _call_lists(c) -> list[list[tuple]]:
    return c.calls if isinstance(c, MultiScriptedConnector) else [c.calls]


def _children(c) -> list[ScriptedConnector]:
    return c.children if isinstance(c, MultiScriptedConnector) else [c]


@st.composite
def external_hits(draw, prompt_len: int, all_groups: bool = False) -> ExternalHit:
    """What the store holds for a prompt of ``prompt_len`` tokens; ``all_groups``: also draw whether
    its load restores every group (``ExternalHit.loads_all_groups``, a P/D transfer: only a
    bounded-replay pool's scheduler acts on it; not drawn otherwise, so other runs keep their draws)."""
    kind = draw(st.sampled_from(("none", "prefix", "prefix", "whole", "whole")))
    n = {"none": 0, "whole": prompt_len}.get(kind) or draw(st.integers(1, prompt_len))
    return ExternalHit(num_tokens=n, load_async=draw(st.booleans()),
                       num_pending_lookups=draw(st.sampled_from((0, 0, 0, 1, 2))),
                       delay_free=draw(st.sampled_from((False, False, True))),
                       loads_all_groups=draw(st.booleans()) if all_groups else False)


class ConnectorLockstep(Lockstep):
    """:class:`Lockstep` with a scripted connector per target and a fake worker's reports.

    Args:
        factories: ``name -> (pool, config, connector) -> target``.
        connector_config: the setup's connector knobs (one :class:`ScriptedConnector` per target).
    """

    def __init__(self, pool: PoolConfig, config: SchedulerConfig,
                 factories: dict[str, Callable[[PoolConfig, SchedulerConfig, ScriptedConnector], Any]],
                 connector_config: ConnectorConfig | tuple[ConnectorConfig, ...], kv_events: bool = True) -> None:
        self.connectors: dict[str, Any] = {}

        def make():
            if isinstance(connector_config, tuple):  # vLLM's MultiConnector over several
                return MultiScriptedConnector([ScriptedConnector(c) for c in connector_config])
            return ScriptedConnector(connector_config)

        def bind(name, f):
            def build(p, c):
                conn = self.connectors[name] = make()
                return f(p, c, conn)
            return build

        super().__init__(pool, config, {name: bind(name, f) for name, f in factories.items()}, kv_events)
        self.connector_config = connector_config
        self.step_indices: deque[int] = deque()
        self.num_scheduled_steps = 0
        self._promoted: set[str] = set()  # loads reported finished, not yet scheduled
        self.known_hang = False  # the drain met a hang vLLM 0.33.0 has too (see drain)

    #: what the fake worker draws for each async load it settles (a subclass may weigh them)
    outcomes: tuple[str, ...] = OUTCOMES

    @property
    def script(self) -> ScriptedConnector:
        return next(iter(self.connectors.values()))

    def _compare_calls(self, what: str) -> None:
        (n0, c0), *rest = self.connectors.items()
        for name, c in rest:
            for child, (x0, x) in enumerate(zip(_call_lists(c0), _call_lists(c))):
                if x != x0:
                    i = next((i for i, (a, b) in enumerate(zip(x0, x)) if a != b), min(len(x0), len(x)))
                    _diverge(f"after {what} (step {self.num_steps}): connector {child}'s calls differ at call {i}\n"
                             f"  {n0}: {x0[i:i + 3]}\n  {name}: {x[i:i + 3]}",
                             f"after {what}: connector calls differ")

    def add_with_hit(self, spec, hit: ExternalHit | tuple[ExternalHit, ...]) -> None:
        """Add ``spec`` with what the store holds for it (one hit per child of a MultiConnector)."""
        hits = hit if isinstance(hit, tuple) else (hit,)
        for c in self.connectors.values():
            for child, h in zip(_children(c), hits):
                child.set_hit(spec.request_id, h)
        self.add(spec)
        self._compare_calls("add " + spec.request_id)

    def schedule(self):
        before = {rid for rid in self.script.pending_loads}
        num_calls = [len(x) for x in _call_lists(self.script)]
        prior = self.last_snapshot.requests if self.last_snapshot is not None else {}
        try:
            out = super().schedule()
        except (AssertionError, ValueError, RuntimeError, KeyError, IndexError) as e:
            if isinstance(e, Divergence):
                raise
            # a target crashed inside schedule() (the others may have scheduled): a finding
            _diverge(f"schedule #{self.num_schedules + 1}: a target raised {type(e).__name__}: {e}",
                     f"schedule: a target raised {type(e).__name__}")
        new_calls = [call for n, x in zip(num_calls, _call_lists(self.script)) for call in x[n:]]
        if isinstance(self.script, MultiScriptedConnector) and any(
                call[0] == "update_state_after_alloc" and call[3] > 0 for call in new_calls):
            CONNECTOR_COVERAGE["multi_connector_loads"] += 1
        for call in new_calls:
            if call[0] == "update_state_after_alloc" and call[3] > 0:
                CONNECTOR_COVERAGE["external_tokens_allocated"] += 1
                if prior.get(call[1]) is not None and prior[call[1]].num_preemptions:
                    CONNECTOR_COVERAGE["external_tokens_after_preemption"] += 1
            elif call[0] == "get_num_new_matched_tokens" and call[2] > 0:
                CONNECTOR_COVERAGE["lookup_after_local_hit"] += 1
            elif call[0] == "has_pending_block_frees":
                CONNECTOR_COVERAGE["asked_pending_block_frees"] += 1
        self._compare_calls("schedule")
        self.step_indices.append(self.num_scheduled_steps)
        self.num_scheduled_steps += 1
        snap = self.last_snapshot
        CONNECTOR_COVERAGE["loads_started_async"] += len(set(self.script.pending_loads) - before)
        CONNECTOR_COVERAGE["waiting_for_remote_kvs"] += sum(
            s.status == "waiting_for_remote_kvs" for s in snap.requests.values())
        CONNECTOR_COVERAGE["kv_holding_waiting"] += bool(snap.kv_holding_waiting)
        for s in out.scheduled:
            if s.kind != "running" and s.num_computed_tokens and s.request_id in self._promoted:
                CONNECTOR_COVERAGE["promoted_load_scheduled"] += 1
                self._promoted.discard(s.request_id)
        return out

    def worker_report(self, step: int, draw: Callable[[Any], Any] | None) -> KVConnectorOutput:
        """The fake worker's ``KVConnectorOutput`` for the settled step ``step``: ``draw`` picks
        each outcome (None: every pending transfer finishes cleanly, as when draining)."""
        c = self.script
        single_group = len(self.pool.groups) == 1
        bs = self.pool.scheduler_block_size
        recving, failed, sending, invalid = [], [], [], []

        def ext_blocks(block_ids, local, ext):
            first, last = local // bs, -(-(local + ext) // bs)
            return list(block_ids[0][first:last])

        for rid, (at, block_ids, local, ext) in sorted(c.pending_loads.items()):
            if at > step:
                continue
            outcome = "ok" if draw is None else draw(st.sampled_from(self.outcomes))
            if outcome == "invalid" and not single_group:
                outcome = "failed"
            if outcome == "wait":
                continue
            recving.append(rid)
            CONNECTOR_COVERAGE[f"load_{outcome}"] += 1
            if outcome == "failed":
                failed.append(rid)
            elif outcome == "invalid":
                blocks = ext_blocks(block_ids, local, ext)
                if blocks:
                    invalid += draw(st.lists(st.sampled_from(blocks), min_size=1, max_size=2, unique=True))
        if draw is not None and single_group:
            for at, rid, block_ids, local, ext in c.sync_loads:
                if at == step and draw(st.booleans()):
                    blocks = ext_blocks(block_ids, local, ext)
                    if blocks:
                        invalid += draw(st.lists(st.sampled_from(blocks), min_size=1, max_size=2, unique=True))
                        CONNECTOR_COVERAGE["sync_load_invalid"] += 1
        for rid in list(c.pending_sends):
            if draw is None or draw(st.booleans()):
                sending.append(rid)
                CONNECTOR_COVERAGE["sends_finished"] += 1
        return KVConnectorOutput(finished_sending=tuple(sending), finished_recving=tuple(recving),
                                 failed_recving=tuple(failed), invalid_block_ids=tuple(dict.fromkeys(invalid)))

    def complete(self, draw: Callable[[Any], Any] | None = None, report: KVConnectorOutput | None = None) -> None:
        """Settle the oldest step with the worker's report: ``report`` as given, else drawn by
        ``draw`` (None: every pending transfer finishes cleanly)."""
        outs = {name: q.popleft() for name, q in self.in_flight.items()}
        step = self.step_indices.popleft()
        kv_out = report if report is not None else self.worker_report(step, draw)
        model_output = self.model.output(next(iter(outs.values())))
        before = self.last_snapshot.requests if self.last_snapshot is not None else {}
        raised = {}
        for name, t in self.targets.items():
            try:
                t.update_from_output(outs[name], model_output, kv_out)
            except Exception as e:  # noqa: BLE001 - a target crashing is a finding, named as such
                raised[name] = e
        if raised:
            name, e = next(iter(raised.items()))
            _diverge(f"update_from_output (step {self.num_steps}) with {kv_out}: {name} raised "
                     f"{type(e).__name__}: {e}" + ("" if len(raised) == len(self.targets) else
                                                    f" ({', '.join(n for n in self.targets if n not in raised)} did not)"),
                     f"update_from_output: {name} raised {type(e).__name__}")
        self.num_steps += 1
        self.compare("update_from_output")
        self._compare_calls("update_from_output")
        self._compare_published_events()
        after = self.last_snapshot.requests
        for t in self.targets.values():
            st = getattr(t, "connector_state", None)
            if st is not None and st.defer_block_free:
                CONNECTOR_COVERAGE["steps_with_deferred_frees"] += bool(st.deferred_frees)
                break
        for rid in kv_out.finished_recving:
            if rid in after and after[rid].status == "waiting_for_remote_kvs":
                self._promoted.add(rid)
        for rid, s in after.items():
            b = before.get(rid)
            if b is not None and b.finish_reason is None and s.finish_reason:
                CONNECTOR_COVERAGE[f"finished_{s.finish_reason}"] += 1
            if b is not None and b.status == "waiting_for_remote_kvs" and s.finish_reason == "abort":
                CONNECTOR_COVERAGE["aborted_mid_load"] += 1
        if any(rid not in self.last_snapshot.running and rid not in self.last_snapshot.waiting
               and rid not in self.last_snapshot.kv_holding_waiting and rid in self.last_snapshot.block_ids
               for rid in after):
            CONNECTOR_COVERAGE["finished_holding_blocks"] += 1

    def abort(self, request_id: str) -> None:
        status = self.last_snapshot.requests.get(request_id) if self.last_snapshot else None
        super().abort(request_id)
        if status is not None and status.status == "waiting_for_remote_kvs":
            CONNECTOR_COVERAGE["aborted_mid_load"] += 1
            if request_id in self.last_snapshot.block_ids:
                CONNECTOR_COVERAGE["aborted_load_keeps_blocks"] += 1
        self._compare_calls("abort " + request_id)

    def reset_prefix_cache(self, reset_running_requests: bool, reset_connector: bool) -> None:
        results = {}
        for name, t in self.targets.items():
            try:
                results[name] = ("ok", t.reset_prefix_cache(reset_running_requests, reset_connector))
            except RuntimeError as e:
                results[name] = ("RuntimeError", "")
        (n0, r0), *rest = results.items()
        for name, r in rest:
            if r != r0:
                _diverge(f"reset_prefix_cache({reset_running_requests}, {reset_connector}): {n0} -> {r0}, "
                         f"{name} -> {r}", "reset_prefix_cache: results differ")
        CONNECTOR_COVERAGE[f"reset_{'running_' if reset_running_requests else ''}"
                           f"{'connector_' if reset_connector else ''}{r0[0]}_{r0[1]}"] += 1
        self.num_steps += 1
        self.compare("reset_prefix_cache")
        self._compare_calls("reset_prefix_cache")

    def _self_reservation_hang(self, snap) -> bool:
        if snap.running or not snap.kv_holding_waiting:
            return False
        head = snap.kv_holding_waiting[0]
        state = snap.requests[head]
        ref = next((t for t in self.targets.values() if getattr(t, "connector_state", None) is not None), None)
        return (state.status in ("waiting", "preempted") and state.num_computed_tokens == 0
                and head not in snap.block_ids
                and (ref is None or head in ref.connector_state.inflight_prefills))

    def _spec_step_reservation_hang(self, snap) -> bool:
        """Nothing runs or is being transferred (under async scheduling an empty step stays in
        flight); the head of the waiting queue was
        last answered with an asynchronous load, and the free blocks hold its whole sequence but
        not the speculative-decoding step vLLM reserves beside an async load
        (``_spec_decode_step_blocks``): its admission is refused at every schedule(), for ever."""
        if snap.running or self.pending_transfers() or not self.config.num_speculative_tokens:
            return False
        ref = next((t for t in self.targets.values() if getattr(t, "connector_state", None) is not None), None)
        if ref is None or ref.connector_state.inflight_prefills or not len(ref.waiting):
            return False
        from kvref.impl.reference.scheduler_connector import request_remaining_blocks, spec_decode_step_blocks

        head = ref.waiting.peek_request()
        if not any((c.last_query.get(head.request_id) or (0, False))[1] for c in _children(ref.connector_state.connector)):
            return False
        free = snap.num_free_blocks
        needed = request_remaining_blocks(ref, head, with_spec_step=False)
        return needed <= free < needed + spec_decode_step_blocks(ref)

    def _holding_deadlock(self, snap) -> bool:
        """Nothing runs, is in flight or is being transferred, and every kv_holding_waiting request
        holds the blocks of a completed load: a schedule() with no arrivals changes nothing, for
        ever (the drain only asks after ``bound`` schedule calls made no progress)."""
        if snap.running or not snap.kv_holding_waiting or self.num_in_flight() or self.pending_transfers():
            return False
        return all(rid in snap.block_ids and snap.requests[rid].num_computed_tokens > 0
                   for rid in snap.kv_holding_waiting)

    def pending_transfers(self) -> bool:
        return bool(self.script.pending_loads or self.script.pending_sends)

    def drain(self) -> int:
        """Run the engine with no arrivals until every request finished and every transfer was
        reported (vLLM's engine keeps stepping while finished requests hold blocks)."""
        live = [r for r in self.requests[next(iter(self.targets))].values() if not r.is_finished]
        from kvref.impl.reference.scheduler_liveness import drain_bound

        # every load and send finishes at the next settled step; a failed or retried load costs
        # at most a few steps more per request
        bound = 2 * drain_bound(live, self.pool, self.config) + 8 * len(self.specs) + 16
        start = self.num_schedules
        while self.unfinished() or self.num_in_flight() or self.pending_transfers():
            if self.num_schedules - start > bound:
                snap = next(iter(self.snapshots().values()))
                if any(snap.requests[rid].num_output_placeholders > 0 and not snap.requests[rid].num_in_flight_tokens
                       for rid in snap.running):
                    # vLLM 0.33.0 itself hangs here (docs/coverage.md, findings): under async
                    # scheduling a sync load's invalid blocks skip the step's output, so its
                    # placeholder is never settled; at max_model_len - 1 the request is never
                    # scheduled again. Both targets agreed up to here.
                    CONNECTOR_COVERAGE["vllm_hang_phantom_placeholder"] += 1
                    self.known_hang = True
                    return self.num_schedules - start
                if self._self_reservation_hang(snap):
                    # vLLM 0.33.0 itself hangs here too (docs/coverage.md, findings): a whole
                    # load failed, the request stays in _inflight_prefills without blocks, and
                    # its retried async load reserves its own remaining blocks against itself
                    CONNECTOR_COVERAGE["vllm_hang_self_reservation"] += 1
                    self.known_hang = True
                    return self.num_schedules - start
                if self._spec_step_reservation_hang(snap):
                    # vLLM 0.33.0 itself hangs here (docs/coverage.md, findings): with speculative
                    # decoding an async load is admitted only beside one speculative step's blocks
                    # (_spec_decode_step_blocks) on top of its own, which a pool that startup sized
                    # for max_model_len need not hold; nothing else runs, so it waits for ever
                    CONNECTOR_COVERAGE["vllm_hang_spec_step_reservation"] += 1
                    self.known_hang = True
                    return self.num_schedules - start
                if self._holding_deadlock(snap):
                    # vLLM 0.33.0 itself hangs here too (docs/coverage.md, findings): requests
                    # whose async loads completed hold their loaded blocks in kv_holding_waiting,
                    # none can allocate the rest of its prompt from what is free, and nothing runs
                    # that could be preempted or finish. Lock-step with vLLM reaches the same state
                    CONNECTOR_COVERAGE["vllm_hang_holding_deadlock"] += 1
                    self.known_hang = True
                    return self.num_schedules - start
                raise AssertionError(
                    f"liveness: not drained within {bound} schedule calls with a connector: waiting={snap.waiting} "
                    f"kv_holding_waiting={snap.kv_holding_waiting} running={snap.running} "
                    f"free={snap.num_free_blocks} pending loads={sorted(self.script.pending_loads)}")
            if self.can_schedule() and (self.unfinished() or self.num_in_flight() == 0):
                self.schedule()
                if self.num_in_flight() < self.depth and self.unfinished():
                    continue
            self.complete(None)
        return self.num_schedules - start


MAX_REQUESTS = 8


class ConnectorMachine(SchedulerMachine):
    """The scheduler machine with connector answers per request and worker reports per step."""

    driver: ConnectorLockstep
    driver_class: type = ConnectorLockstep

    @precondition(lambda self: self.num_added < MAX_REQUESTS)
    @rule(data=st.data())
    def add_request(self, data):
        spec = data.draw(request_specs(self.num_added, self.driver.pool.max_model_len))
        hit = tuple(data.draw(external_hits(len(spec.prompt))) for _ in _children(self.driver.script))
        self.num_added += 1
        self.driver.add_with_hit(spec, hit)

    @precondition(lambda self: self.driver.num_in_flight() > 0)
    @rule(data=st.data())
    def complete(self, data):
        self.driver.complete(data.draw)

    @rule(data=st.data())
    def engine_step(self, data):
        d = self.driver
        if d.can_schedule() and (d.unfinished() or d.num_in_flight() == 0):
            d.schedule()
            if d.num_in_flight() < d.depth and d.unfinished():
                return
        d.complete(data.draw)

    @rule(reset_running=st.booleans(), reset_connector=st.booleans())
    def reset_prefix_cache(self, reset_running, reset_connector):
        self.driver.reset_prefix_cache(reset_running, reset_connector)

    def teardown(self):
        driver = getattr(self, "driver", None)
        if driver is None:
            return
        try:
            driver.drain()
        except _AcceptedDuringTeardown:
            return
        if driver.known_hang:
            return
        snap = next(iter(driver.snapshots().values()))
        assert not snap.waiting and not snap.running and not snap.kv_holding_waiting
        assert not snap.block_ids, f"blocks still held after the drain: {snap.block_ids}"
        assert all(s.status == "finished" for s in snap.requests.values())


def connector_machine(factories: dict[str, Callable], setups=None, name: str = "ConnectorMachine"):
    """A :class:`ConnectorMachine` subclass over ``factories`` (``(pool, config, connector) -> target``)."""
    cls = type(name, (ConnectorMachine,), {"factories": factories})
    strategy = setups if setups is not None else connector_setups()

    @initialize(setup=strategy)
    def init(self, setup):
        pool, config, conn = setup
        self.driver = self.driver_class(pool, config, self.factories, conn)
        self.num_added = 0

    cls.init = init
    return cls


def reference_factory(pool, config, connector):
    from kvref.impl.reference.scheduler import Scheduler

    return Scheduler(pool, config, connector=connector)


def vllm_factory(env=None):
    from kvref.impl.vllm.scheduler import VllmEnv, VllmScheduler

    holder = {"env": env}

    def build(pool, config, connector):
        if holder["env"] is None:
            holder["env"] = VllmEnv()
        return VllmScheduler(pool, config, holder["env"], connector=connector)

    return build


# ---- a runner outside pytest (``kvref verify``'s conform-connector) ------------------------------
@dataclass
class ConnectorRun(SchedulerRun):
    """What :func:`run_connector_machine` found: a :class:`SchedulerRun` summarised by the
    connector's counters (#26: it repeated SchedulerRun's fields)."""

    @property
    def summary(self) -> str:
        c = self.coverage
        return (f"{self.traces} generated traces ({self.ops} ops) with a KV connector: "
                f"{c.get('loads_started_async', 0)} async loads, {c.get('load_ok', 0)} finished, "
                f"{c.get('load_failed', 0) + c.get('load_invalid', 0)} failed, "
                f"{c.get('sync_load_invalid', 0)} sync loads with invalid blocks, "
                f"{c.get('sends_finished', 0)} delayed frees, {c.get('aborted_mid_load', 0)} aborts mid-load")


def run_connector_machine(with_vllm: bool, examples: int, reproducible: bool = False, shrink: bool = True,
                          seed: int | None = None, spec: bool = False) -> ConnectorRun:
    """Run the connector machine (reference alone, or lock-step with vLLM) outside pytest;
    ``spec``: on setups with speculative decoding (:func:`connector_setups`)."""
    from .scheduler import run_lockstep_machine

    factories: dict[str, Callable] = {"ref": reference_factory}
    if with_vllm:
        factories = {"vllm": vllm_factory(), **factories}
    drivers: list[ConnectorLockstep] = []

    class Counting(ConnectorLockstep):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            drivers.append(self)

    machine = connector_machine(factories, setups=connector_setups(spec=True) if spec else None,
                                name="ConnectorSpecRun" if spec else "ConnectorRun")
    machine.driver_class = Counting

    CONNECTOR_COVERAGE.clear()
    COVERAGE.clear()
    ok, failure, sig = run_lockstep_machine(machine, examples, steps=40, min_steps=20, seed=seed,
                                            reproducible=reproducible, shrink=shrink)
    return ConnectorRun(ok=ok, traces=len(drivers), ops=sum(d.num_steps for d in drivers),
                        coverage=dict(CONNECTOR_COVERAGE), failure=failure, signature=sig)
