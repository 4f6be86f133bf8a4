"""Scheduler traces with a KV connector on full attention + a bounded-replay sliding window
(DeepSeek-V4.1 "SWA bounded replay" beside a connector): a part of ``conform-connector`` (#22).

The pools are the connector machine's FA + sliding-window pools with the window group replaced by a
:class:`~kvref.spec.kv_cache_interface.SlidingWindowMLASpec` with ``bounded_replay=True`` (vLLM
0.33.0: not prefix-cacheable, ``prefix_replay_tokens = sliding_window``; windows of 1 token to 4
blocks), contexts of four blocks at least. Each request's external hit (mostly long, mostly
asynchronous: :func:`replay_external_hits`) also draws whether its load
restores every group (``ExternalHit.loads_all_groups``: a P/D transfer, vLLM's NIXL / Mooncake
``get_loaded_kv_cache_group_ids``) or the prefix-cacheable ones only (the connector default: a
hash-addressed store). vLLM's ``Scheduler`` then cuts a load without the window to whole blocks,
drops a hit (local + external) no longer than the window, rewinds a longer one by the window at a
sync admission or once an async load landed (``_update_waiting_for_remote_kv``), and takes a load
with the window whole (``replay_start = 0``). The reference
(:mod:`kvref.impl.reference.scheduler_connector`, :mod:`kvref.impl.reference.scheduler_prefix_replay`)
must do the same: everything the connector machine compares after every operation (scheduler
output, queues, request states and computed tokens, block tables per group, free blocks, the
connector's call log with the external tokens of each allocation), and each live request's
``replay_start`` after every schedule.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from kvref.impl.reference.scheduler_connector import ExternalHit
from kvref.models.machines.counted_lockstep import run_counted
from kvref.models.machines.scheduler import COVERAGE, request_specs, run_lockstep_machine
from kvref.models.machines.scheduler_connector import (
    CONNECTOR_COVERAGE,
    MAX_REQUESTS,
    ConnectorLockstep,
    ConnectorMachine,
    ConnectorRun,
    _children,
    connector_machine,
    connector_setups,
    reference_factory,
    vllm_factory,
)
from kvref.models.machines.scheduler_prefix_replay import _replay_group, compare_replay_starts

#: what the reference's replay did beside the connector, summed over a run
REPLAY_CONNECTOR_COVERAGE: Counter = Counter()


def _replay_pool(setup):
    pool, config, conn = setup
    return replace(pool, groups=tuple(_replay_group(g) for g in pool.groups)), config, conn


def replay_connector_setups():
    """The connector machine's FA + sliding-window setups (sync or async scheduling, consumer or
    producer, either failure policy, one in three a MultiConnector), contexts of four blocks at
    least, the window group made a bounded-replay SWA-MLA group."""
    return connector_setups(kinds=("full+swa",)).filter(
        lambda s: s[0].max_model_len >= 4 * s[0].scheduler_block_size).map(_replay_pool)


class ReplayConnectorLockstep(ConnectorLockstep):
    """:class:`ConnectorLockstep` that also compares every live request's ``replay_start`` (vLLM's
    ``Request.replay_start``, set at a replayed admission and when an async load is promoted) with
    vLLM's after each schedule."""

    #: a driver operation raised (a divergence): the teardown then leaves the targets alone
    failed = False

    def _watch(self, op, *args):
        try:
            return op(*args)
        except BaseException:
            self.failed = True
            raise

    def add_with_hit(self, spec, hit) -> None:
        self._watch(super().add_with_hit, spec, hit)

    def complete(self, draw=None, report=None) -> None:
        self._watch(super().complete, draw, report)

    def abort(self, request_id: str) -> None:
        self._watch(super().abort, request_id)

    def reset_prefix_cache(self, reset_running_requests: bool, reset_connector: bool) -> None:
        self._watch(super().reset_prefix_cache, reset_running_requests, reset_connector)

    def schedule(self):
        return self._watch(self._schedule_and_compare_replay)

    def _schedule_and_compare_replay(self):
        out = super().schedule()
        compare_replay_starts(self)
        return out


@st.composite
def replay_external_hits(draw, prompt_len: int) -> ExternalHit:
    """What the store holds, weighed for the replay: mostly long hits (half the prompts whole) and
    mostly asynchronous loads (two in three: their replay comes when they land), with or without the
    window (``loads_all_groups``: a P/D transfer restores every group)."""
    kind = draw(st.sampled_from(("none", "prefix", "prefix", "whole", "whole", "whole")))
    n = {"none": 0, "whole": prompt_len}.get(kind) or draw(st.integers(1, prompt_len))
    return ExternalHit(num_tokens=n, load_async=draw(st.sampled_from((True, True, False))),
                       num_pending_lookups=draw(st.sampled_from((0, 0, 0, 1))),
                       delay_free=draw(st.sampled_from((False, False, True))),
                       loads_all_groups=draw(st.booleans()))


class ReplayConnectorMachine(ConnectorMachine):
    """The connector machine whose external hits also draw ``loads_all_groups``, with a rule that
    lands the loads in flight."""

    @precondition(lambda self: self.num_added < MAX_REQUESTS)
    @rule(data=st.data())
    def add_request(self, data):
        spec = data.draw(request_specs(self.num_added, self.driver.pool.max_model_len,
                                       min_length=self.driver.pool.scheduler_block_size))
        hit = tuple(data.draw(replay_external_hits(len(spec.prompt))) for _ in _children(self.driver.script))
        self.num_added += 1
        self.driver.add_with_hit(spec, hit)

    def teardown(self):
        """Drain as the connector machine does, unless an operation of the trace already raised: the
        teardown runs in Hypothesis' ``finally``, and draining targets that parted would replace the
        divergence with whatever the drain then meets."""
        driver = getattr(self, "driver", None)
        if driver is not None and driver.failed:
            return
        super().teardown()

    @precondition(lambda self: self.driver.num_in_flight() > 0 and bool(self.driver.script.pending_loads))
    @rule()
    def land_loads(self):
        """Settle the oldest step with every transfer finishing cleanly, then schedule: landed async
        loads are promoted (and replayed) inside the trace. Without it most promotions came in the
        drain at teardown, where Hypothesis discards a difference once the example has overrun its
        data (it takes an error raised after the data froze for the overrun)."""
        d = self.driver
        d.complete(None)
        if d.can_schedule() and (d.unfinished() or d.num_in_flight() == 0):
            d.schedule()


def run_replay_connector_machine(examples: int, reproducible: bool = False, shrink: bool = True,
                                 seed: int | None = None) -> ConnectorRun:
    """The reference scheduler in lock step with vLLM 0.33.0's, a scripted connector each, on
    bounded-replay pools (traces of at least 20 operations, drained at teardown). The coverage adds,
    by the reference's count: ``replay_external_hits_cut`` (a load without the window cut to whole
    blocks), ``replay_connector_hits_dropped`` (a hit no longer than the window dropped with its
    load), ``replay_window_loaded`` (a load carrying the window taken whole), ``replay_connector_rewound``
    (a sync admission rewound by the window) and ``replay_after_async_load`` (a landed load rewound)."""
    from kvref.impl.reference import scheduler_connector as conn_module
    from kvref.impl.reference import scheduler_prefix_replay as replay_module

    originals = (replay_module.trim_external_hit, replay_module.drop_short_hit, replay_module.mark_prefix_replay,
                 conn_module.update_waiting_for_remote_kv)
    trim, drop, mark, promote = originals
    promoting = [False]

    def counting_trim(block_size, num_external, load_async, window_loaded):
        out = trim(block_size, num_external, load_async, window_loaded)
        REPLAY_CONNECTOR_COVERAGE["replay_external_hits_cut"] += out[0] < num_external
        return out

    def counting_drop(window, num_hit):
        dropped = drop(window, num_hit)
        REPLAY_CONNECTOR_COVERAGE["replay_connector_hits_dropped"] += dropped
        return dropped

    def counting_mark(window, num_hit, window_loaded):
        out = mark(window, num_hit, window_loaded)
        REPLAY_CONNECTOR_COVERAGE["replay_window_loaded"] += window_loaded
        if out[0]:
            REPLAY_CONNECTOR_COVERAGE["replay_after_async_load" if promoting[0] else "replay_connector_rewound"] += 1
        return out

    def counting_promote(sched, request):
        promoting[0] = True
        try:
            return promote(sched, request)
        finally:
            promoting[0] = False

    factories = {"vllm": vllm_factory(), "ref": reference_factory}
    replay_module.trim_external_hit, replay_module.drop_short_hit = counting_trim, counting_drop
    replay_module.mark_prefix_replay, conn_module.update_waiting_for_remote_kv = counting_mark, counting_promote
    try:
        def machine_for(counting):
            machine = connector_machine(factories, setups=replay_connector_setups(), name="ReplayConnectorRun")
            return type("ReplayConnectorRun", (ReplayConnectorMachine, machine), {"driver_class": counting})

        return ConnectorRun(**run_counted(
            machine_for, ReplayConnectorLockstep,
            lambda machine: run_lockstep_machine(machine, examples, steps=40, min_steps=20, seed=seed,
                                                 reproducible=reproducible, shrink=shrink),
            COVERAGE, CONNECTOR_COVERAGE, REPLAY_CONNECTOR_COVERAGE, min_ops=20))
    finally:
        (replay_module.trim_external_hit, replay_module.drop_short_hit, replay_module.mark_prefix_replay,
         conn_module.update_waiting_for_remote_kv) = originals
