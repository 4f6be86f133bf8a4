"""A KV-connector scheduler's whole life, with what the engine polls after every step (#22).

``conform-connector``'s main run draws sync and async scheduling, consumers and producers, and
compares queues, requests, blocks and connector calls. This run narrows the setups to the
configuration where vLLM's scheduler does the most KV bookkeeping of its own, and compares what
the main run does not look at:

* async scheduling with a KV *consumer*: two batches in flight, so a finished or preempted
  request's blocks return to the pool only after the steps that may still write them were
  processed (vLLM ``defer_block_free``, ``_free_request_blocks``, ``_drain_deferred_frees``);
* ``log_stats``: after every operation what the engine polls (``has_requests``, ``has_request`` of
  every id, ``pause_state``, the counts of ``scheduler_pause.polled``) and the KV part of
  ``make_stats`` — the waiting requests the scan skipped (``deferred_waiting``,
  left out of ``num_waiting_reqs``), async loads by fetch stage (``_set_kv_fetch_stage``) and the
  connector's prefix-cache stats (external hits at admission, the reset flag);
* requests that skip reading the prefix cache (prompt logprobs): the connector is asked, its hit
  ignored;
* requests whose ``kv_transfer_params`` say ``do_remote_prefill`` (the decode side of a P/D split):
  counted as waiting to start a KV fetch from their arrival, before any lookup;
* the engine's exit: ``Scheduler.shutdown`` shuts the connector down (its last call), after the
  liveness drain;
* on single-group pools half the connectors lack ``SupportsHMA`` (vLLM's ``_connector_finished``
  calls ``request_finished`` with the one group's blocks; under ``MultiConnector`` its own fallback);
* half the setups have a HiSparse host pool (``KVCacheConfig.hisparse_host_num_blocks``): an async
  load admitted while a step is in flight reaches the connector only once that step was processed
  (vLLM ``defer_async_loads``, ``deferred_loads``, ``_drain_deferred_loads``): the connector's call
  log shows when, the stats record it then, and an abort before then frees its blocks at once;
* a run of its own (``reload=True``): tight pools without local prefix caching whose store saves a
  preempted request's tokens, so the request reloads them asynchronously and vLLM promotes it back
  to PREEMPTED, scheduled as resumed (``_handle_blocked_waiting_request``).

A separate machine and run so that the main machine's derandomized traces stay as they are.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Callable

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from kvref.impl.reference.scheduler_connector import KV_CONSUMER

from .scheduler import COVERAGE, SchedulerRun, _diverge, request_specs
from .scheduler_connector import (
    CONNECTOR_COVERAGE,
    MAX_REQUESTS,
    ConnectorLockstep,
    ConnectorMachine,
    _call_lists,
    _children,
    connector_machine,
    connector_setups,
    external_hits,
    vllm_factory,
)
from .scheduler_pause import polled

LIFECYCLE_COVERAGE: Counter = Counter()
"""Tallies of what the lifecycle traces reached (tests assert the rare ones occur)."""


@st.composite
def lifecycle_setups(draw, hisparse: bool | None = None, reload: bool = False):
    """Connector setups with async scheduling, a consumer (deferred frees) and stats on; with a
    HiSparse host pool (deferred async loads) as ``hisparse`` says (None: drawn).

    ``reload``: the setups where a preempted request loads its KV again, asynchronously (see
    :func:`run_lifecycle_machine`): tight pools, so requests are preempted, and no local prefix
    caching, so a preempted request's own computed blocks do not cover the store's hit (with
    caching its lookup starts past them and the store, capped one token short of the prompt, then
    seldom has more: 0 reloads after preemption in 50 traces of the mixed run, seed 0, ci)."""
    pool, cfg, conn = draw(connector_setups(async_scheduling=True, roles=(KV_CONSUMER,),
                                            tight=True if reload else None))
    if reload:
        pool = replace(pool, enable_caching=False)
    if hisparse is None:
        hisparse = draw(st.booleans())  # a HiSparse host pool: async loads are deferred too

    def knobs(c):
        # on a single-group pool a connector may lack SupportsHMA (request_finished on one group)
        hma = True if len(pool.groups) > 1 else draw(st.booleans())
        return replace(c, hisparse_host_pool=hisparse, supports_hma=hma)

    conn = tuple(knobs(c) for c in conn) if isinstance(conn, tuple) else knobs(conn)
    return replace(pool, log_stats=True), cfg, conn


class LifecycleLockstep(ConnectorLockstep):
    """The connector driver comparing the polled counts and ``make_stats`` after every operation,
    with the engine's exit (``shutdown``). Its fake worker reports more loads with invalid blocks
    (single-group pools): a load whose valid prefix survives is promoted with that prefix cached
    (``_update_waiting_for_remote_kv``'s partial recovery, ``_update_requests_with_invalid_blocks``)."""

    outcomes = ("wait", "ok", "ok", "failed", "invalid", "invalid")

    def compare(self, what: str) -> None:
        super().compare(what)
        ids = sorted(self.specs)
        (n0, p0), *rest = ((name, (t.has_requests(), tuple(t.has_request(r) for r in ids), int(t.pause_state))
                            + polled(t)) for name, t in self.targets.items())
        for name, p in rest:
            if p != p0:
                _diverge(f"after {what} (step {self.num_steps}): polled counts differ (has requests, has request per "
                         f"id, pause state, request counts, unfinished, has finished, kv cache usage, stats) "
                         f"{n0}: {p0}, {name}: {p}",
                         f"after {what}: polled counts differ")
        _tally(p0[-1])

    def _reference_state(self):
        return next((t.connector_state for t in self.targets.values()
                     if getattr(t, "connector_state", None) is not None), None)

    #: reload runs (``run_lifecycle_machine(reload=True)``): a preempted request's store holds its
    #: whole prompt, loaded asynchronously
    reload = False

    def schedule(self):
        promoted = set(self._promoted)
        st_ = self._reference_state()
        snap = self.last_snapshot
        reloading = {rid for rid in (st_.loading if st_ is not None and snap is not None else ())
                     if rid in snap.requests and snap.requests[rid].num_preemptions}
        out = super().schedule()
        # vLLM _handle_blocked_waiting_request: a landed reload of a preempted request (scheduler.py 3531)
        LIFECYCLE_COVERAGE["preempted_reload_promoted"] += len(reloading - st_.loading) if st_ is not None else 0
        # a preempted request whose reload landed resumes (vLLM promotes it as PREEMPTED)
        LIFECYCLE_COVERAGE["reload_after_preemption_resumed"] += sum(
            s.kind == "resumed" and s.request_id in promoted for s in out.scheduled)
        st = self._reference_state()
        if st is not None and st.deferred_loads:
            LIFECYCLE_COVERAGE["deferred_loads_pending"] += 1
        if self.reload:
            self._store_preempted()
        return out

    def _store_preempted(self) -> None:
        """An offload tier saved what a preempted request computed: its store now holds the
        request's tokens (prompt and outputs) and loads them asynchronously, the same answer for every target's connector. Drawn
        hits alone reached no reload after a preemption (the request's first hit was mostly
        synchronous, short or absent)."""
        for rid, s in self.last_snapshot.requests.items():
            if s.status != "preempted":
                continue
            n = len(self.specs[rid].prompt) + len(s.output_token_ids)  # its outputs were saved too
            for c in self.connectors.values():
                for child in _children(c):
                    h = child.hits.get(rid)
                    if h is not None and not (h.load_async and h.persistent and h.num_tokens == n):
                        child.set_hit(rid, replace(h, num_tokens=n, load_async=True, persistent=True))
                        LIFECYCLE_COVERAGE["preempted_stored"] += 1

    def worker_report(self, step, draw):
        report = super().worker_report(step, draw)
        if report.invalid_block_ids and self.last_snapshot is not None:
            held = [b for groups in self.last_snapshot.block_ids.values() for g in groups for b in set(g)]
            LIFECYCLE_COVERAGE["invalid_block_shared"] += any(held.count(b) > 1 for b in report.invalid_block_ids)
        return report

    def complete(self, draw=None, report=None) -> None:
        st = self._reference_state()
        before = set(st.deferred_loads) if st is not None else set()
        super().complete(draw, report)
        # the connector stats update_from_output's own SchedulerStats carried (deferred loads it
        # started are recorded there)
        (n0, s0), *rest = ((name, _output_stats(t)) for name, t in self.targets.items())
        for name, s in rest:
            if s != s0:
                _diverge(f"update_from_output (step {self.num_steps}): the connector stats in its SchedulerStats "
                         f"differ: {n0}: {s0}, {name}: {s}", "update_from_output: connector stats differ")
        if s0 and s0.get("requests", 0) + s0.get("preempted_requests", 0):
            LIFECYCLE_COVERAGE["connector_stats_in_output"] += 1
        if before:
            LIFECYCLE_COVERAGE["deferred_loads_started"] += len(before - set(st.deferred_loads))

    def abort(self, request_id: str) -> None:
        st = self._reference_state()
        if st is not None and request_id in st.deferred_loads:
            LIFECYCLE_COVERAGE["deferred_load_aborted"] += 1
        super().abort(request_id)

    def shutdown(self) -> None:
        for t in self.targets.values():
            t.shutdown()
        self.num_steps += 1
        self._compare_calls("shutdown")
        for child in _call_lists(self.script):
            assert child and child[-1] == ("shutdown",), f"the connector's last call is not shutdown: {child[-3:]}"
        LIFECYCLE_COVERAGE["shutdowns"] += 1


def _output_stats(target) -> dict | None:
    st = getattr(target, "connector_state", None)
    return st.output_connector_prefix_cache_stats if st is not None else target.output_connector_prefix_cache_stats


def _tally(stats: dict | None) -> None:
    if not stats:
        return
    LIFECYCLE_COVERAGE["skipped_waiting_polled"] += stats["num_skipped_waiting_reqs"] > 0
    for stage, n in stats["num_kv_fetch_reqs_by_stage"].items():
        LIFECYCLE_COVERAGE[f"kv_fetch_{stage}"] += n > 0
    conn = stats["connector_prefix_cache_stats"] or {}
    LIFECYCLE_COVERAGE["connector_hits_recorded"] += conn.get("hits", 0) > 0
    LIFECYCLE_COVERAGE["connector_preempted_recorded"] += conn.get("preempted_requests", 0) > 0
    LIFECYCLE_COVERAGE["connector_reset_flagged"] += bool(conn.get("reset"))


class LifecycleMachine(ConnectorMachine):
    """The connector machine whose arrivals may skip reading the prefix cache."""

    #: every external hit persistent and asynchronous (``run_lifecycle_machine(reload=True)``)
    reload = False

    @precondition(lambda self: self.num_added < MAX_REQUESTS)
    @rule(data=st.data())
    def add_request(self, data):
        spec = data.draw(request_specs(self.num_added, self.driver.pool.max_model_len))
        spec = replace(spec, skip_reading_prefix_cache=data.draw(st.sampled_from((False, False, False, True))))
        LIFECYCLE_COVERAGE["skip_reading_arrivals"] += spec.skip_reading_prefix_cache
        # the decode side of a prefill/decode split: kv_transfer_params say do_remote_prefill, so
        # vLLM counts the request as waiting to start a KV fetch from its arrival (make_stats); one
        # arrival in three, by its index (no draw: the traces' other draws keep their sequences)
        spec = replace(spec, do_remote_prefill=self.num_added % 3 == 1)
        LIFECYCLE_COVERAGE["remote_prefill_arrivals"] += spec.do_remote_prefill
        hit = tuple(data.draw(external_hits(len(spec.prompt))) for _ in _children(self.driver.script))
        if self.driver.script.config.hisparse_host_pool:  # mostly async loads: the ones HiSparse defers
            hit = tuple(replace(h, load_async=data.draw(st.sampled_from((True, True, True, False)))) for h in hit)
        # an offload tier keeps its copy: a preempted request reloads it (asynchronously: promoted
        # as PREEMPTED, resumed rather than new; vLLM _handle_blocked_waiting_request)
        hit = tuple(replace(h, persistent=data.draw(st.booleans())) for h in hit)
        if self.reload:  # every hit an offload tier's, loaded asynchronously: each preemption reloads
            hit = tuple(replace(h, persistent=True) for h in hit)
        LIFECYCLE_COVERAGE["persistent_hits"] += any(h.persistent for h in hit)
        self.num_added += 1
        self.driver.add_with_hit(spec, hit)

    def _loading(self) -> list[str]:
        st = self.driver._reference_state()
        return sorted(st.loading) if st is not None else []

    def _step_in_flight(self) -> bool:
        """A step that scheduled tokens is in flight (the scheduled-step fence is ahead)."""
        st_ = self.driver._reference_state()
        return st_ is not None and st_.sched_step_seq > st_.processed_step_seq

    @precondition(lambda self: self.num_added < MAX_REQUESTS and self.driver.script.config.hisparse_host_pool
                  and self.driver.can_schedule())
    @rule(data=st.data())
    def async_arrival_in_flight(self, data):
        """Under HiSparse: a request whose prefix the store holds arrives while a step is in flight
        and the engine schedules at once, so its async load is admitted behind that step's fence
        (arrivals at an idle engine are admitted with nothing in flight and never deferred).

        When no step that scheduled tokens is in flight, the engine's next step goes first (an
        empty step in flight is settled before): the machine's other rules seldom leave exactly
        one such step in flight, so the rule, waiting for that state, ran in none of 45 traces
        (seed 0, 40 examples) and an abort of a deferred load was reached once in 50 traces (the
        catalogue's ``sched.deferred_load_unfenced_free`` survived every check)."""
        d = self.driver
        if not self._step_in_flight() and d.unfinished():
            if d.num_in_flight():
                d.complete(data.draw)
            d.schedule()
        LIFECYCLE_COVERAGE["arrival_behind_a_step"] += self._step_in_flight()
        spec = data.draw(request_specs(self.num_added, self.driver.pool.max_model_len))
        hit = tuple(replace(data.draw(external_hits(len(spec.prompt))), load_async=True, num_pending_lookups=0)
                    for _ in _children(self.driver.script))
        self.num_added += 1
        self.driver.add_with_hit(spec, hit)
        self.driver.schedule()
        self._maybe_abort_deferred(data)

    def _maybe_abort_deferred(self, data) -> None:
        """Sometimes abort a load HiSparse just deferred, before it starts (the client gave up: its
        blocks are freed behind the step fence, and no finished_recving will come)."""
        st_ = self.driver._reference_state()
        if st_ is not None and st_.deferred_loads and data.draw(st.sampled_from((True, False))):
            self.driver.abort(data.draw(st.sampled_from(sorted(st_.deferred_loads))))

    @rule(data=st.data())
    def engine_step(self, data):
        """An engine step; a load HiSparse just deferred is sometimes aborted before it starts."""
        d = self.driver
        if d.can_schedule() and (d.unfinished() or d.num_in_flight() == 0):
            d.schedule()
            self._maybe_abort_deferred(data)
            if d.num_in_flight() < d.depth and d.unfinished():
                return
        d.complete(data.draw)

    @precondition(lambda self: bool(self._loading()))
    @rule(data=st.data())
    def abort_loading(self, data):
        """Abort a request whose async load is in flight or, under HiSparse, not started yet
        (its blocks wait for finished_recving, or are freed at once behind the step fence)."""
        deferred = sorted(self.driver._reference_state().deferred_loads)
        pool = deferred if deferred and data.draw(st.booleans()) else self._loading()
        self.driver.abort(data.draw(st.sampled_from(pool)))

    def teardown(self):
        driver = getattr(self, "driver", None)
        super().teardown()
        if driver is not None and not driver.known_hang:
            driver.shutdown()


def lifecycle_machine(factories: dict[str, Callable], driver_class: type = LifecycleLockstep,
                      hisparse: bool | None = None, reload: bool = False):
    base = connector_machine(factories, setups=lifecycle_setups(hisparse, reload), name="LifecycleBase")
    if reload:
        # mostly landing loads: a failed reload is recomputed and never promoted
        driver_class = type("ReloadLockstep", (driver_class,),
                            {"reload": True, "outcomes": ("wait", "ok", "ok", "ok", "failed", "invalid")})
    return type("LifecycleRun", (LifecycleMachine, base), {"driver_class": driver_class, "reload": reload})


def reference_factory(pool, config, connector):
    from kvref.impl.reference.scheduler import Scheduler

    return Scheduler(pool, config, connector=connector, record_prefix_cache_stats=True)


def run_lifecycle_machine(examples: int, reproducible: bool = False, shrink: bool = True,
                          seed: int | None = None, hisparse: bool | None = None,
                          reload: bool = False) -> SchedulerRun:
    """The reference scheduler with kvref's scripted KV connector in lock step with vLLM 0.33.0's
    on lifecycle traces (async consumer, stats polled after every operation, shutdown); ``hisparse``:
    every setup (True), none (False) or half (None) with a HiSparse host pool (deferred loads).

    ``reload``: tight pools without local prefix caching whose every external hit is persistent
    and asynchronous, so a preempted request reloads its KV: vLLM promotes such a request from
    WAITING_FOR_REMOTE_KVS back to PREEMPTED, not WAITING (``_handle_blocked_waiting_request``,
    scheduler.py 3530-3531), and schedules it as resumed; the snapshots (statuses) and the
    scheduled kinds are compared after every operation."""
    from .counted_lockstep import run_counted
    from .scheduler import run_lockstep_machine

    factories: dict[str, Callable] = {"vllm": vllm_factory(), "ref": reference_factory}
    return SchedulerRun(**run_counted(
        lambda counting: lifecycle_machine(factories, counting, hisparse, reload), LifecycleLockstep,
        lambda machine: run_lockstep_machine(machine, examples, steps=40, min_steps=20, seed=seed,
                                             reproducible=reproducible, shrink=shrink),
        CONNECTOR_COVERAGE, COVERAGE, LIFECYCLE_COVERAGE, min_ops=0))
