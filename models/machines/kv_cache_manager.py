"""A Hypothesis state machine that drives KV cache managers with scheduler-like operations.

``kv_cache_manager_machine(kinds)`` builds a ``RuleBasedStateMachine`` that applies every
generated operation to all implementations in ``kinds`` through one
:class:`~kvref.models.conformance.differential.Harness`, which compares what they observe after every step
(exact block ids, free-queue order, cached hashes, admission decisions) and checks invariants:

* ``("reference",)``            the reference alone (its invariants + protocol invariants);
* ``("vllm",)``                 vLLM alone (its invariants read through the adapter);
* ``("reference", "vllm")``     the differential pairing (conformance);
* ``("reference", "torch")``    later, the torch implementation.

On a failure the (shrunk) trace is saved as JSON (see :mod:`kvref.models.conformance.trace`) under
``$KVREF_TRACE_DIR`` (default: ``<tmp>/kvref-traces``) and its path is in the error message;
``kvref.models.conformance.differential.replay`` replays it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import reject
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from kvref.impl.interface import make_manager
from kvref.spec.kv_cache_interface import MambaSpec

from kvref.models.conformance.accepted import is_accepted
from kvref.models.conformance.differential import Divergence, Harness
from kvref.models.strategies.pools import CACHE_SALTS, GROUP_SETS, TOKENS, pool_configs, prompts
from kvref.models.conformance.trace import Op

MAX_LIVE_REQUESTS = 6
MAX_BATCHES_IN_FLIGHT = 2  # vLLM's max_concurrent_batches with async scheduling


@dataclass
class MachineStats:
    """What the runs of one machine class did (tests assert on it: trace lengths, coverage)."""

    steps: list[int] = field(default_factory=list)
    admission_rejections: int = 0
    step_rejections: int = 0
    ops_applied: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    async_batches: int = 0
    external_loads: int = 0
    #: issue #13's classes: async KV loads (and how many completed), external tokens after a prefix
    #: hit on a hybrid pool, admissions at the pool's boundary (<= 1 block of slack), spec-decode
    #: steps of a request admitted with a hit on a pool of >= 3 groups, multi-victim preemptions
    async_loads: int = 0
    loads_done: int = 0
    external_hybrid: int = 0
    boundary_admissions: int = 0
    lookahead_hits: int = 0
    preemption_storms: int = 0
    admissions: int = 0
    evictions: int = 0
    null_slots: int = 0
    partial_entries: int = 0
    #: KV cache events compared, by type (BlockStored / BlockRemoved / AllBlocksCleared)
    kv_events: dict[str, int] = field(default_factory=dict)
    resets: int = 0  # successful reset_prefix_cache ops
    seconds_in_harness: float = 0.0
    group_sets: dict[str, int] = field(default_factory=dict)
    unsupported_pools: int = 0
    #: traces discarded at a difference the user's baseline accepts (kvref.models.conformance.accepted)
    accepted_divergences: int = 0
    seconds_by_kind: dict[str, float] = field(default_factory=dict)

    def runs_with_at_least(self, n: int) -> int:
        return sum(1 for s in self.steps if s >= n)


def trace_dir() -> Path:
    return Path(os.environ.get("KVREF_TRACE_DIR", Path(tempfile.gettempdir()) / "kvref-traces"))


def _group_set_name(pool) -> str:
    return "+".join(type(g.kv_cache_spec).__name__.replace("Spec", "") for g in pool.groups)


def kv_cache_manager_machine(kinds: tuple[str, ...], group_sets: tuple[str, ...] = GROUP_SETS,
                             max_blocks: int = 48, eagle: bool | str = True,
                             mamba_align_external_loads: bool = False,
                             kv_events: bool = True) -> type[RuleBasedStateMachine]:
    """A state machine class driving the implementations ``kinds`` side by side.

    A pool that an implementation other than vLLM refuses (``ValueError``: kvref's "not modelled"
    or bad-input errors) is rejected as an example; vLLM refusing a generated pool is a failure
    (the strategies only make pools vLLM accepts).

    ``kv_events``: pools are built with ``enable_kv_cache_events`` so that the harness compares
    the KV cache event streams after every op (where every implementation has them).
    """
    kinds = tuple(kinds)

    class KVCacheManagerMachine(RuleBasedStateMachine):
        stats = MachineStats()

        def __init__(self) -> None:
            super().__init__()
            self.h: Harness | None = None
            self.async_mode = False
            self._next_rid = 0
            self.num_storms = 0

        @initialize(pool=pool_configs(group_sets=group_sets, max_blocks=max_blocks, eagle=eagle),
                    async_mode=st.booleans())
        def setup(self, pool, async_mode) -> None:
            if kv_events:
                pool = dataclasses.replace(pool, enable_kv_cache_events=True)
            managers = {}
            for kind in kinds:
                try:
                    managers[kind] = make_manager(kind, pool)
                except ValueError:
                    if kind == "vllm":
                        raise
                    self.stats.unsupported_pools += 1
                    reject()
            self.h = Harness(pool, managers)
            self.async_mode = async_mode
            name = _group_set_name(pool)
            self.stats.group_sets[name] = self.stats.group_sets.get(name, 0) + 1

        def teardown(self) -> None:
            if self.h is not None:
                self.stats.steps.append(self.h.num_applied)
                self.stats.admission_rejections += self.h.num_admission_rejections
                self.stats.step_rejections += self.h.num_step_rejections
                self.stats.ops_applied += self.h.num_applied
                self.stats.prefix_hits += self.h.num_prefix_hits
                self.stats.preemptions += self.h.num_preemptions
                self.stats.async_batches += self.h.num_async_batches
                self.stats.external_loads += self.h.num_external_loads
                self.stats.async_loads += self.h.num_async_loads
                self.stats.loads_done += self.h.num_loads_done
                self.stats.external_hybrid += self.h.num_external_hybrid
                self.stats.boundary_admissions += self.h.num_boundary_admissions
                self.stats.lookahead_hits += self.h.num_lookahead_hits
                self.stats.preemption_storms += self.num_storms
                self.stats.admissions += self.h.num_admissions
                self.stats.evictions += self.h.num_evictions
                self.stats.null_slots += self.h.num_null_slots
                self.stats.partial_entries += self.h.num_partial_entries
                self.stats.resets += self.h.num_resets
                for k, v in self.h.num_events.items():
                    self.stats.kv_events[k] = self.stats.kv_events.get(k, 0) + v
                for k, v in self.h.seconds_by_kind.items():
                    self.stats.seconds_by_kind[k] = self.stats.seconds_by_kind.get(k, 0.0) + v

        # -- helpers ---------------------------------------------------------------------------

        def _apply(self, op: Op) -> None:
            assert self.h is not None
            t = time.perf_counter()
            try:
                self.h.apply(op)
            except Divergence as exc:
                if is_accepted(exc.signature):
                    # a difference the developer accepted (baseline): discard this trace, keep searching
                    self.stats.accepted_divergences += 1
                    reject()
                # One file per distinct finding: shrinking re-runs failing traces hundreds of times and
                # ends on the minimal one, which overwrites the earlier, longer ones.
                key = hashlib.sha256((exc.signature or str(exc)).encode()).hexdigest()[:12]
                path = self.h.trace.save(trace_dir() / f"trace-{key}.json")
                raise Divergence(f"{exc}\n  kinds={kinds}; trace ({len(self.h.trace.ops)} ops) saved to {path}"
                                 f"\n  replay: kvref replay {path} --kinds {','.join(kinds)}",
                                 exc.signature) from exc
            finally:
                self.stats.seconds_in_harness += time.perf_counter() - t

        def _in_flight_allowed(self, rid: str, chunk: int) -> bool:
            assert self.h is not None
            if not self.async_mode:
                return False
            s = self.h.reqs[rid]
            cap = self.h.pool_config.effective_max_in_flight_tokens
            return len(s.batches) < MAX_BATCHES_IN_FLIGHT and s.request.num_in_flight_tokens + chunk <= cap

        def _has(self, what: str) -> bool:
            return self.h is not None and bool(getattr(self.h, what)())

        # -- rules -----------------------------------------------------------------------------

        @precondition(lambda self: self.h is not None and len(self.h.live()) < MAX_LIVE_REQUESTS)
        @rule(data=st.data())
        def add_request(self, data) -> None:
            assert self.h is not None
            prompt = data.draw(prompts(self.h.pool_config.max_model_len, self.h.token_sequences()), label="prompt")
            rid = f"r{self._next_rid}"
            self._next_rid += 1
            self._apply(Op("add", dict(rid=rid, prompt=prompt, max_tokens=data.draw(st.integers(1, 32)),
                                       cache_salt=data.draw(CACHE_SALTS))))

        @precondition(lambda self: self.h is not None and len(self.h.live()) < MAX_LIVE_REQUESTS)
        @rule(data=st.data())
        def add_and_admit(self, data) -> None:
            """An arrival the scheduler admits at once. Besides ``admit``: Hypothesis' swarm testing
            switches rules off per trace, and a trace whose only admission rule is off compares
            nothing but arrivals, evictions and empty steps."""
            assert self.h is not None
            self.add_request(data)
            rid = f"r{self._next_rid - 1}"
            chunk = data.draw(st.sampled_from((1, 4, 16, 64, 1024)), label="chunk")
            self._admit(data, rid, chunk, 0)

        @precondition(lambda self: self._has("waiting"))
        @rule(data=st.data())
        def admit(self, data) -> None:
            assert self.h is not None
            waiting = self.h.waiting()
            # FCFS: mostly the head of the queue; sometimes another one (a skipped head).
            rid = waiting[0] if data.draw(st.integers(0, 3)) else data.draw(st.sampled_from(waiting))
            chunk = data.draw(st.sampled_from((1, 2, 4, 8, 16, 64, 1024)), label="chunk")
            external = (data.draw(st.sampled_from((0, 0, 0, 0, 0, 4, 16, 64)), label="external")
                        if self._external_loads_ok() else 0)
            self._admit(data, rid, chunk, external)

        def _admit(self, data, rid: str, chunk: int, external: int) -> None:
            self._apply(Op("admit", dict(
                rid=rid, chunk=chunk, full_sequence_must_fit=data.draw(st.booleans()),
                reserved_blocks=data.draw(st.sampled_from((0, 0, 0, 0, 1, 3))),
                in_flight=self._in_flight_allowed(rid, chunk) and data.draw(st.booleans()),
                token=data.draw(TOKENS), external=external,
                # a connector's async load (WAITING_FOR_REMOTE_KVS) for some of the external ones
                async_load=external > 0 and data.draw(st.booleans(), label="async_load"),
                # the scheduler's reservation for in-flight prefills, drawn relative to the free
                # blocks: admission decided with 0-4 blocks to spare, whatever the pool's size
                reserve_slack=data.draw(st.sampled_from((-1,) * 8 + (0, 1, 2, 4)), label="reserve_slack"))))

        @precondition(lambda self: self.h is not None and self.h.reqs and len(self.h.live()) < MAX_LIVE_REQUESTS
                      and self._external_loads_ok())
        @rule(data=st.data())
        def follow_up_with_external(self, data) -> None:
            """A KV connector's path: a new request extends a known sequence (a multi-turn
            follow-up, so the local prefix cache hits, on every group of a hybrid pool), and the
            connector claims tokens past the hit (``num_external_computed_tokens``), loaded
            synchronously or asynchronously. vLLM #33775 (external blocks allocated before a
            later group's hits were touched) lives only on this path."""
            assert self.h is not None
            # extend a request whose KV was computed (cached now, or still held), else any known one
            computed = sorted(r for r, x in self.h.reqs.items() if x.holds_blocks or x.request.output_token_ids)
            base = self.h.reqs[data.draw(st.sampled_from(computed or sorted(self.h.reqs)), label="extends")].request
            limit = max(1, min(self.h.pool_config.max_model_len - 1, 64))
            tail = data.draw(st.integers(1, 16), label="tail")
            prompt = (list(base.all_token_ids) + [data.draw(TOKENS) for _ in range(min(tail, 4))]
                      + [0] * max(0, tail - 4))[:limit]
            rid = f"r{self._next_rid}"
            self._next_rid += 1
            self._apply(Op("add", dict(rid=rid, prompt=prompt, max_tokens=data.draw(st.integers(1, 8)),
                                       cache_salt=base.cache_salt)))
            chunk = data.draw(st.sampled_from((4, 16, 1024)), label="chunk")
            self._admit(data, rid, chunk, data.draw(st.sampled_from((4, 16, 64)), label="external"))

        @precondition(lambda self: self.h is not None and self.h.reqs and len(self.h.live()) < MAX_LIVE_REQUESTS
                      and self._external_loads_ok())
        @rule(data=st.data())
        def follow_up_again(self, data) -> None:
            """A second rule: connector admissions about as often as plain ones."""
            self.follow_up_with_external(data)

        @precondition(lambda self: self._has("loading"))
        @rule(data=st.data())
        def load_done(self, data) -> None:
            """An async KV load completes (``_update_waiting_for_remote_kv``)."""
            assert self.h is not None
            self._apply(Op("load_done", dict(rid=data.draw(st.sampled_from(self.h.loading())))))

        @precondition(lambda self: self._has("loading"))
        @rule(data=st.data())
        def load_done_again(self, data) -> None:
            """A second rule: loads complete about as often as steps run (else a trace ends first)."""
            self.load_done(data)

        def _external_loads_ok(self) -> bool:
            """No connector loads on Mamba "align" pools: vLLM 0.33.0 under-counts the state blocks
            they take and raises mid-allocation (tests/conformance/regressions/
            test_mamba_align_external_load.py); the reference reproduces that exactly."""
            assert self.h is not None
            return mamba_align_external_loads or not any(
                isinstance(g.kv_cache_spec, MambaSpec) and g.kv_cache_spec.mamba_cache_mode == "align"
                for g in self.h.pool_config.groups)

        def _step(self, data) -> None:
            assert self.h is not None
            rid = data.draw(st.sampled_from(self.h.steppable()))
            chunk = data.draw(st.sampled_from((1, 1, 2, 3, 4, 8, 16, 64)), label="chunk")
            self._apply(Op("step", dict(
                rid=rid, chunk=chunk, lookahead=data.draw(st.sampled_from((0, 0, 0, 0, 1, 2))),
                in_flight=self._in_flight_allowed(rid, chunk) and data.draw(st.booleans()),
                token=data.draw(TOKENS))))

        @precondition(lambda self: self._has("steppable"))
        @rule(data=st.data())
        def step(self, data) -> None:
            self._step(data)

        @precondition(lambda self: self._has("steppable"))
        @rule(data=st.data())
        def step_again(self, data) -> None:
            """A second step rule: running requests advance about twice as often as other ops."""
            self._step(data)

        @precondition(lambda self: self._has("steppable"))
        @rule(data=st.data())
        def step_more(self, data) -> None:
            """A third: with the connector, reset and eviction rules beside them, two step rules left
            windows too rarely slid past their first blocks (sliding-window faults survived)."""
            self._step(data)

        @precondition(lambda self: self._has("in_flight"))
        @rule(data=st.data())
        def process_output(self, data) -> None:
            assert self.h is not None
            self._apply(Op("process", dict(rid=data.draw(st.sampled_from(self.h.in_flight())))))

        @precondition(lambda self: self._has("running"))
        @rule(data=st.data())
        def preempt(self, data) -> None:
            assert self.h is not None
            # The scheduler's victim is the last running request (FCFS); allow any.
            running = self.h.running()
            rid = running[-1] if data.draw(st.booleans()) else data.draw(st.sampled_from(running))
            self._apply(Op("preempt", dict(rid=rid)))

        @precondition(lambda self: self.h is not None and len(self.h.running()) >= 2)
        @rule(data=st.data())
        def preemption_storm(self, data) -> None:
            """The pool ran dry with several requests running: vLLM preempts the newest running
            request, then the next newest, ... (``running.pop()``), each freed in turn, so the
            free queue takes their blocks in that order."""
            assert self.h is not None
            running = self.h.running()
            k = data.draw(st.integers(2, len(running)), label="victims")
            for rid in running[::-1][:k]:
                self._apply(Op("preempt", dict(rid=rid)))
            self.num_storms += 1

        @precondition(lambda self: self._has("live"))
        @rule(data=st.data())
        def finish(self, data) -> None:
            assert self.h is not None
            self._apply(Op("finish", dict(rid=data.draw(st.sampled_from(self.h.live())))))

        @precondition(lambda self: self._has_all("reset_prefix_cache") and bool(self.h._prev_cached) and (
            not self.h.running() or self.h.num_applied % 10 == 9))
        @rule(reset_running=st.booleans())
        def reset_prefix_cache(self, reset_running) -> None:
            """RLHF weight updates / benchmarks reset the cache (an ``AllBlocksCleared`` event).
            Only when something is cached, and while requests run only at one op position in ten:
            a reset that preempts everything would otherwise crowd out the long runs the other
            rules build."""
            self._apply(Op("reset_prefix_cache", dict(reset_running_requests=reset_running)))

        @precondition(lambda self: self._has_all("evict_blocks"))
        @rule(data=st.data())
        def evict_blocks(self, data) -> None:
            """A KV connector invalidates blocks (failed loads): their hashes are removed."""
            assert self.h is not None
            n = self.h.pool_config.num_blocks
            ids = data.draw(st.lists(st.integers(1, max(1, n - 1)), max_size=3), label="block_ids")
            self._apply(Op("evict_blocks", dict(block_ids=ids)))

        def _has_all(self, method: str) -> bool:
            return self.h is not None and self.h._all_have(method)

        @precondition(lambda self: self.h is not None)
        @rule()
        def new_step(self) -> None:
            self._apply(Op("new_step", {}))

    KVCacheManagerMachine.__name__ = KVCacheManagerMachine.__qualname__ = \
        "KVCacheManagerMachine_" + "_vs_".join(kinds)
    return KVCacheManagerMachine


@dataclass
class MachineRun:
    """Outcome of :func:`run_machine`: the stats, and the failure (with the saved trace) if any."""

    stats: MachineStats
    seconds: float
    failure: str | None = None
    trace_path: str | None = None
    #: the finding without ids (for baselines), when the failure is a divergence
    signature: str | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None


def run_machine(kinds: tuple[str, ...], examples: int, *, steps: int = 40, min_steps: int = 30,
                seed: int | None = None, out_dir: str | None = None, shrink: bool = True,
                **machine_kwargs) -> MachineRun:
    """Run the machine outside pytest (``kvref verify``): never raises on a divergence.

    Args:
        kinds: implementations to drive side by side (``("reference", "vllm")``).
        examples: generated traces (each at least ``min_steps`` ops, at most ``steps``).
        seed: a Hypothesis seed for a reproducible run (None: random).
        out_dir: where a failing trace is saved (default ``$KVREF_TRACE_DIR`` or ``<tmp>/kvref-traces``).
        shrink: shrink a failing trace to a minimal one (slower; off gives the first failing trace).
    """
    import hypothesis.core as hcore
    from hypothesis import HealthCheck, Phase, settings
    from hypothesis.stateful import run_state_machine_as_test

    final_dir = Path(out_dir) if out_dir is not None else trace_dir()
    saved_dir = os.environ.get("KVREF_TRACE_DIR")
    # Failing traces go to a staging folder while Hypothesis searches and shrinks (it re-runs failing
    # traces hundreds of times, and shrinking can pass through other findings); only the trace of the
    # finding it reports is kept, in the out dir: one file per finding.
    staging = tempfile.mkdtemp(prefix="kvref-staging-")
    os.environ["KVREF_TRACE_DIR"] = staging
    machine = kv_cache_manager_machine(tuple(kinds), **machine_kwargs)
    phases = tuple(Phase) if shrink else tuple(p for p in Phase if p != Phase.shrink)
    s = settings(max_examples=examples, stateful_step_count=steps, deadline=None, database=None,
                 suppress_health_check=list(HealthCheck), print_blob=True, phases=phases)
    t = time.perf_counter()
    # run_state_machine_as_test takes no seed; Hypothesis' own --hypothesis-seed hook does the job
    saved_seed = hcore.global_force_seed
    try:
        if seed is not None:
            hcore.global_force_seed = seed
        run_state_machine_as_test(machine, settings=s, _min_steps=min_steps + 1)
    except Exception as exc:  # a Divergence, or several (ExceptionGroup), or Hypothesis' own errors
        subs = exc.exceptions if isinstance(exc, BaseExceptionGroup) else (exc,)
        msg = "\n".join(f"{type(e).__name__}: {e}" for e in subs)
        path = msg.split("saved to ", 1)[1].split("\n", 1)[0] if "saved to " in msg else None
        if path and os.path.exists(path):
            final_dir.mkdir(parents=True, exist_ok=True)
            kept = str(final_dir / os.path.basename(path))
            shutil.move(path, kept)
            msg, path = msg.replace(path, kept), kept
        sig = next((e.signature for e in subs if isinstance(e, Divergence)), None)
        return MachineRun(machine.stats, time.perf_counter() - t, msg, path, sig)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        hcore.global_force_seed = saved_seed
        if saved_dir is None:
            os.environ.pop("KVREF_TRACE_DIR", None)
        else:
            os.environ["KVREF_TRACE_DIR"] = saved_dir
    return MachineRun(machine.stats, time.perf_counter() - t)
