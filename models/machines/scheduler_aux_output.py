"""Scheduler traces with vLLM 0.33.0's aux-output (routed-experts, "R3") connector on: a part of
``conform-scheduler`` and ``conform-connector`` (issue #22).

With ``--enable-return-routed-experts`` vLLM's scheduler builds an ``AuxOutputSchedulerConnector``
(vllm/distributed/aux_output_connector/connector.py), which caps every prefix hit at the blocks
whose expert routing it can still serve: the local look-up at ``max_cache_hit`` and a KV
connector's external tokens by ``cap_external_hit`` (block-aligned and within ``max_cache_hit``, or
none: an async load is then not started), and keeps the routing of GPU-cached blocks when their
request is preempted or finishes (an LRU of ``num_blocks`` entries, twice that with a KV
connector, trimmed of blocks neither loading nor GPU-cached). The reference models it in
:mod:`kvref.impl.reference.scheduler_aux_output`; here both run in lock step and, after every
operation, besides the scheduler's outputs and snapshots, the connectors' views are compared: the
retained blocks in LRU order (vLLM ``_kv_cached``'s keys, the full-attention block hashes, which
the reference hashes byte for byte alike), the loads held against release, the generation
(advanced by ``reset_prefix_cache``) and the last step's worker metadata (scheduled requests'
routing starts, newly keyed hashes, finished requests, retained and released hashes).

vLLM is built legally: a tiny Mixtral (an MoE model) with prefix caching, validated with the V2
model runner (:class:`~kvref.impl.vllm.scheduler.VllmEnv` ``aux_output=True``). Without a KV
connector both schedulers run as the V2 runner's (resumed requests sent as new); beside the scripted
connector as the V1 runner's (kvref's connector path models the V1 output shape; the KV decisions
do not depend on it: docs/differences.md).

Runs: :func:`run_aux_output_machine` (:class:`CacheControlsMachine`'s arrivals, follow-ups, resets;
tight and roomy pools so retained blocks outlive their GPU copies) and
:func:`run_aux_output_connector_machine` (the connector machine plus repeats of earlier prompts
whose external hit is a whole number of blocks, the only hits ``cap_external_hit`` keeps).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Callable

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from kvref.models.machines.counted_lockstep import run_counted
from kvref.models.machines.scheduler import (
    COVERAGE,
    MAX_REQUESTS,
    SchedulerRun,
    _diverge,
    machine_with,
    run_lockstep_machine,
    scheduler_setups,
)
from kvref.models.machines.scheduler_cache_controls import (
    MAX_FOLLOW_UPS,
    CacheControlsLockstep,
    CacheControlsMachine,
    _cacheable,
    _roomy,
)

#: what the reference's aux-output connector did, summed over a run
AUX_COVERAGE: Counter = Counter()


def aux_view(target) -> dict | None:
    """A target's aux-output connector view (the reference's ``aux_output.view()``, vLLM's adapter's
    ``aux_output_view()``)."""
    view = getattr(target, "aux_output_view", None)
    if view is not None:
        return view()
    aux = getattr(target, "aux_output", None)
    return None if aux is None else aux.view()


class AuxCompare:
    """Lock-step mixin: after the base comparison, the aux-output connectors' views must be equal."""

    def compare(self, what: str) -> None:
        super().compare(what)
        views = {name: aux_view(t) for name, t in self.targets.items()}
        (n0, v0), *rest = views.items()
        for name, v in rest:
            if v != v0:
                keys = [k for k in v0 if v0.get(k) != (v or {}).get(k)]
                _diverge(f"after {what} (step {self.num_steps}): aux-output connector {', '.join(keys)} differ\n"
                         + "\n".join(f"  {k}: {n0} {v0.get(k)}\n  {' ' * len(k)}  {name} {(v or {}).get(k)}"
                                     for k in keys),
                         f"after {what}: aux-output connector {', '.join(keys)} differ")
        if v0 is not None and v0["metadata"] is not None and what == "schedule":
            m = v0["metadata"]
            AUX_COVERAGE["aux_retained_hashes"] += len(m["retained_block_hashes"])
            AUX_COVERAGE["aux_released_hashes"] += len(m["released_block_hashes"])
            AUX_COVERAGE["aux_finished_events"] += len(m["finished_requests"])
            AUX_COVERAGE["aux_steps_loading_held"] += bool(v0["loading"])


class AuxOutputLockstep(AuxCompare, CacheControlsLockstep):
    """:class:`CacheControlsLockstep` comparing the aux-output connectors too."""


class AuxOutputMachine(CacheControlsMachine):
    """:class:`CacheControlsMachine` with repeats: an earlier request's prompt again, so that its
    retained blocks (GPU copies evicted or not) cap or admit the repeat's hit."""

    @precondition(lambda self: self.num_added < MAX_REQUESTS + MAX_FOLLOW_UPS and self.num_added > 0)
    @rule(data=st.data())
    def repeat(self, data):
        prev = self.driver.specs[f"r{data.draw(st.integers(0, self.num_added - 1))}"]
        spec = replace(prev, request_id=f"r{self.num_added}", arrival_time=float(self.num_added),
                       skip_reading_prefix_cache=False)
        self.num_added += 1
        AUX_COVERAGE["aux_repeats"] += 1
        self.driver.add(spec)


def aux_output_setups():
    """Prefix-cached pools as the main machine draws them (FA, FA + SWA / chunked / Mamba, sync or
    async, tight storms), as drawn or roomy; no speculative decoding (its diffusion twin is another
    scheduler class)."""
    drawn = st.one_of(scheduler_setups(), scheduler_setups(tight=True)).filter(_cacheable)
    return st.one_of(drawn, drawn.map(_roomy))


def _counting_cap():
    """Count the reference's ``cap_external_hit`` and ``max_cache_hit`` outcomes (a context:
    restores the class methods on exit)."""
    from contextlib import contextmanager

    from kvref.impl.reference.scheduler_aux_output import AuxOutputControl

    @contextmanager
    def ctx():
        cap, hit = AuxOutputControl.cap_external_hit, AuxOutputControl.max_cache_hit

        def counting_cap(self, request, num_local, num_external):
            kept = cap(self, request, num_local, num_external)
            if num_external:
                AUX_COVERAGE["aux_external_kept" if kept else "aux_external_dropped"] += 1
            return kept

        def counting_hit(self, request):
            n = hit(self, request)
            AUX_COVERAGE["aux_hits_capped_below_prompt"] += n < request.num_tokens - 1
            AUX_COVERAGE["aux_retained_blocks_counted"] += sum(1 for b, _ in self._kv_blocks(self._hashes(request))
                                                               if b in self.kv_cached) > 0
            return n

        def counting_loading(self, request, num_tokens):
            AUX_COVERAGE["aux_async_loads_held"] += 1
            return loading(self, request, num_tokens)

        loading = AuxOutputControl.request_loading
        AuxOutputControl.cap_external_hit, AuxOutputControl.max_cache_hit = counting_cap, counting_hit
        AuxOutputControl.request_loading = counting_loading
        try:
            yield
        finally:
            AuxOutputControl.cap_external_hit, AuxOutputControl.max_cache_hit = cap, hit
            AuxOutputControl.request_loading = loading

    return ctx()


def run_aux_output_machine(examples: int, reproducible: bool = False, shrink: bool = True,
                           seed: int | None = None) -> SchedulerRun:
    """The reference scheduler with its aux-output connector in lock step with vLLM 0.33.0's on
    :class:`AuxOutputMachine` traces (at least 30 operations; liveness drained at teardown)."""
    from kvref.impl.reference.scheduler import Scheduler
    from kvref.impl.vllm.scheduler import VllmEnv, VllmScheduler

    env = VllmEnv(aux_output=True)
    factories: dict[str, Callable] = {
        "vllm": lambda p, c: VllmScheduler(p, c, env, use_v2_model_runner=True),
        "ref": lambda p, c: Scheduler(p, c, use_v2_model_runner=True, aux_output=True)}
    base = machine_with(factories, setups=aux_output_setups(), name="AuxOutputBase")
    with _counting_cap():
        return SchedulerRun(**run_counted(
            lambda counting: type("AuxOutputRun", (AuxOutputMachine, base), {"driver_class": counting}),
            AuxOutputLockstep,
            lambda machine: run_lockstep_machine(machine, examples, steps=45, min_steps=31, seed=seed,
                                                 reproducible=reproducible, shrink=shrink), COVERAGE, AUX_COVERAGE))


# ---- beside a KV connector ---------------------------------------------------------------------
def _connector_parts():
    """The connector machine's classes (imported late: that module is large)."""
    from kvref.models.machines import scheduler_connector as sc

    class AuxConnectorLockstep(AuxCompare, sc.ConnectorLockstep):
        """:class:`ConnectorLockstep` comparing the aux-output connectors too."""

    class AuxConnectorMachine(sc.ConnectorMachine):
        """The connector machine plus repeats of earlier prompts whose external hit is mostly a
        whole number of blocks (``cap_external_hit`` keeps only block-aligned hits within the
        retained or GPU-cached blocks; the connector machine's hits are mostly unaligned), or a
        token or a block less one past it."""

        @precondition(lambda self: self.num_added < MAX_REQUESTS + MAX_FOLLOW_UPS and self.num_added > 0)
        @rule(data=st.data())
        def repeat_with_hit(self, data):
            # mostly a finished request's prompt: its blocks were retained when it left, and only a
            # retained block the pool has since evicted lets an external hit past the local one
            snap = self.driver.last_snapshot
            done = sorted(r for r, s in snap.requests.items() if s.status == "finished") if snap else []
            rid = data.draw(st.sampled_from(done)) if done and data.draw(st.integers(0, 3)) else \
                f"r{data.draw(st.integers(0, self.num_added - 1))}"
            prev = self.driver.specs[rid]
            spec = replace(prev, request_id=f"r{self.num_added}", arrival_time=float(self.num_added))
            bs = self.driver.pool.scheduler_block_size
            most = (len(spec.prompt) - 1) // bs
            blocks = data.draw(st.sampled_from((most, most, None)))
            blocks = data.draw(st.integers(0, most)) if blocks is None else blocks
            # mostly whole blocks; sometimes a few tokens into the next (dropped by vLLM's cap)
            extra = data.draw(st.sampled_from((0, 0, 0, 1, bs - 1)))
            hit = sc.ExternalHit(num_tokens=min(blocks * bs + extra, len(spec.prompt)),
                                 load_async=data.draw(st.sampled_from((True, True, False))))
            self.num_added += 1
            AUX_COVERAGE["aux_repeats"] += 1
            self.driver.add_with_hit(spec, tuple(hit for _ in sc._children(self.driver.script)))

    return sc, AuxConnectorLockstep, AuxConnectorMachine


def aux_connector_setups():
    """The connector machine's setups with prefix caching on (vLLM requires it with aux output)."""
    from kvref.models.machines.scheduler_connector import connector_setups

    return connector_setups().filter(lambda s: s[0].enable_caching)


def run_aux_output_connector_machine(examples: int, reproducible: bool = False, shrink: bool = True,
                                     seed: int | None = None) -> SchedulerRun:
    """The same beside the scripted KV connector: :func:`aux_connector_setups`, the connector
    machine's rules and worker reports, and block-aligned repeats."""
    from kvref.impl.reference.scheduler import Scheduler
    from kvref.impl.vllm.scheduler import VllmEnv, VllmScheduler

    sc, lockstep, machine_cls = _connector_parts()
    env = VllmEnv(aux_output=True)
    factories: dict[str, Callable] = {
        "vllm": lambda p, c, conn: VllmScheduler(p, c, env, connector=conn),
        "ref": lambda p, c, conn: Scheduler(p, c, connector=conn, aux_output=True)}
    base = sc.connector_machine(factories, setups=aux_connector_setups(), name="AuxConnectorBase")
    with _counting_cap():
        return SchedulerRun(**run_counted(
            lambda counting: type("AuxConnectorRun", (machine_cls, base), {"driver_class": counting}),
            lockstep,
            lambda machine: run_lockstep_machine(machine, examples, steps=40, min_steps=20, seed=seed,
                                                 reproducible=reproducible, shrink=shrink),
            sc.CONNECTOR_COVERAGE, AUX_COVERAGE, min_ops=20))
