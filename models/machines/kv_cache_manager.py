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
``traces_to`` / ``run_machine(out_dir=...)`` (default ``$KVREF_TRACE_DIR``, else ``<tmp>/kvref-traces``);
the raised :class:`Divergence` carries its path in ``trace_path`` (and the message names it);
``kvref.models.conformance.differential.replay`` replays it.

Layout (#26): :class:`KVCacheManagerRules` holds the rules, the setup, the teardown and the
comparison after every op; :mod:`kvref.models.machines.kv_cache_manager_edges` holds the functions
that aim an op at the pool's edge (fillers, the largest reservation that still fits, vLLM #33775's
full-pool follow-up); :func:`kv_cache_manager_machine` only narrows its options into a
:class:`MachineConfig` and adds the setup rule whose arguments depend on them. The split moved code
without changing a draw: ``run_machine`` with a seed explores the same traces as before it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import reject
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from kvref.impl.interface import make_manager
from kvref.spec.kv_cache_interface import MambaSpec, RSWASpec, SlidingWindowSpec

from kvref.models.conformance.accepted import is_accepted
from kvref.models.conformance.differential import Divergence, Harness
from kvref.models.strategies.hash_inputs import hashing_settings, request_hash_inputs
from kvref.models.strategies.pools import CACHE_SALTS, GROUP_SETS, TOKENS, pool_configs, prompts, tokens_from_seed
from kvref.models.conformance.trace import Op
from kvref.models.machines.context_parallel import context_parallel_draws, with_context_parallel
from kvref.models.machines import kv_cache_manager_edges as edges
from kvref.models.machines.kv_cache_manager_edges import MAX_LIVE_REQUESTS, EdgeCounts, RequestIds
from kvref.models.machines.kv_metrics_pairing import MetricsPairing
from kvref.models.machines.mamba_chunks import aligned_chunk, mamba_split_config
from kvref.models.machines.mamba_junctions import (
    JunctionCheckpoints,
    compare_shared_prefix_checkpoint,
    shared_prefix_checkpoint_draws,
    with_shared_prefix_checkpoint,
    with_split_junction_stop,
)

MAX_BATCHES_IN_FLIGHT = 2  # vLLM's max_concurrent_batches with async scheduling


@dataclass
class MachineStats:
    """What the runs of one machine class did (tests assert on it: trace lengths, coverage)."""

    steps: list[int] = field(default_factory=list)
    #: copy-on-write pairs released (fine-grained partial hits on Mamba "align" pools, issue #23)
    cow_copies: int = 0
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
    #: ops aimed at the pool's exact edge (issue #13): admissions under the largest reservation that
    #: still fits (or one block more), steps/admissions after a filler request left them exactly the
    #: blocks they need (or one short), and connector follow-ups on a pool a filler made full
    edge_reservations: int = 0
    edge_fills: int = 0
    full_pool_follow_ups: int = 0
    #: how often each rule ran (rule name -> count), for balancing them
    rules: dict[str, int] = field(default_factory=dict)
    seconds_in_harness: float = 0.0
    group_sets: dict[str, int] = field(default_factory=dict)
    unsupported_pools: int = 0
    #: why an implementation refused a pool (message -> count): a test requiring none names them
    unsupported_reasons: Counter = field(default_factory=Counter)
    #: traces discarded at a difference the user's baseline accepts (kvref.models.conformance.accepted)
    accepted_divergences: int = 0
    #: KV zeroing (issue #23): block ids drained by take_new_block_ids and compared; async loads that
    #: failed with a valid prefix (blocks re-recorded for zeroing)
    zeroed_blocks: int = 0
    failed_loads: int = 0
    seconds_by_kind: dict[str, float] = field(default_factory=dict)
    #: block residency metrics compared (reference and vLLM paired): eviction events, those with
    #: reuse gaps, the most blocks followed at once, of them hit (kv_metrics_pairing)
    metrics_events: int = 0
    metrics_events_with_gaps: int = 0
    metrics_max_followed: int = 0
    metrics_max_followed_hit: int = 0
    #: sparse prefix-cache retention (issue #23): pools by interval ("dense", "0", "k*sbs"), lookups
    #: whose hit a sparse group held below a longer one (shared_prefix_boundary > 0), of them on
    #: sparse-retention pools
    retention_pools: dict[str, int] = field(default_factory=dict)
    junctions: int = 0
    retention_junctions: int = 0
    #: retention intervals probed on each pool (vLLM's coordinator vs the reference's rule)
    retention_probes: dict[str, int] = field(default_factory=dict)
    #: pools by ``num_prefill_lookahead`` (multi-module MTP re-prefillable tails, issue #23)
    prefill_lookahead_pools: dict[int, int] = field(default_factory=dict)
    #: pools by ``num_hash_lookahead_tokens`` where a prefill lookahead was drawn (multi-module MTP
    #: with lookahead hashes: every block's hash covers the next n tokens, issue #23)
    hash_lookahead_pools: dict[int, int] = field(default_factory=dict)
    #: prefix hits on pools hashing a lookahead of >= 2 tokens
    hash_lookahead_hits: int = 0
    #: Mamba "align" boundary-state hand-offs and finishing producers' partial tails compared
    boundary_state_offloads: int = 0
    partial_tail_offloads: int = 0
    #: pools by context-parallel world sizes ("dcp2/pcp1", ...; issue #23), and the prefix hits and
    #: copy-on-write pairs compared on pools where DCP scales some group's block
    context_parallel_pools: dict[str, int] = field(default_factory=dict)
    dcp_prefix_hits: int = 0
    dcp_cow_copies: int = 0
    #: Mamba shared-prefix checkpoint (issue #23): pools by whether vLLM's narrowed flag is on
    #: ("on", or "off" where it was asked for and narrowed away), and junction states keyed in a
    #: sub-block (reference and vLLM compared after each op)
    shared_prefix_checkpoint_pools: dict[str, int] = field(default_factory=dict)
    junction_checkpoints: int = 0

    def runs_with_at_least(self, n: int) -> int:
        return sum(1 for s in self.steps if s >= n)


def trace_dir() -> Path:
    return Path(os.environ.get("KVREF_TRACE_DIR", Path(tempfile.gettempdir()) / "kvref-traces"))


def _group_set_name(pool) -> str:
    return "+".join(type(g.kv_cache_spec).__name__.replace("Spec", "") for g in pool.groups)


def _one_sliding_window_group(pool) -> bool:
    return len(pool.groups) == 1 and isinstance(pool.groups[0].kv_cache_spec, SlidingWindowSpec)


@dataclass(frozen=True)
class MachineConfig:
    """The options of one machine class: :func:`kv_cache_manager_machine`'s arguments, narrowed to
    what the driven implementations model (``breadth`` and what needs it are off where torch is
    driven). The rules read them from ``self.config``."""

    kinds: tuple[str, ...]
    group_sets: tuple[str, ...]
    max_blocks: int
    eagle: bool | str
    mamba_align_external_loads: bool
    kv_events: bool
    breadth: bool
    traces_to: str | Path | None
    retention: bool | str
    prefill_lookahead: bool
    context_parallel: bool
    shared_prefix_checkpoint: bool | str
    hash_lookahead_always: bool


class KVCacheManagerRules(RuleBasedStateMachine):
    """The rules of the KV cache manager machine: what a trace may do (arrivals, admissions, steps,
    preemptions, connector loads, cache invalidation), each op applied to every implementation
    through the :class:`Harness`, which compares them and checks invariants after it (``_apply``).
    Where an op is aimed at the pool's edge, the arguments come from
    :mod:`kvref.models.machines.kv_cache_manager_edges` (#26: rules and aiming are two concepts).

    :func:`kv_cache_manager_machine` subclasses it per configuration: it sets ``config`` and a
    fresh ``stats``, and adds the setup rule, whose arguments depend on the configuration (an
    argument drawn where it is off would shift every other run's inputs). Hypothesis collects
    rules by name, so where a rule is defined changes no draw.
    """

    config: MachineConfig
    stats: MachineStats

    def __init__(self) -> None:
        super().__init__()
        self.h: Harness | None = None
        self.metrics: MetricsPairing | None = None
        self.mamba_split = None
        self.dcp_scaled = False  # some group's manager block is scaled by DCP
        self.junctions = JunctionCheckpoints()
        self.async_mode = False
        self.rids = RequestIds()  # r0, r1, ... (the edge functions name fillers too)
        self.num_storms = 0
        self.edges = EdgeCounts()  # ops aimed at the pool's edge (kv_cache_manager_edges)

    def _drawn_pool(self, pool, hashing: dict, num_prefill_lookahead: int, context_parallel_draw,
                    shared_prefix_draw):
        """The drawn pool with the drawn options applied as vLLM combines them: KV events, the hash
        settings (no lookahead hashes on Mamba pools; lookahead hashes prove the boundary, so no
        EAGLE drop), DCP/PCP, the Mamba shared-prefix checkpoint, the multi-module MTP lookahead."""
        drawn_eagle = pool.use_eagle or any(g.is_eagle_group for g in pool.groups)
        if self.config.kv_events:
            pool = dataclasses.replace(pool, enable_kv_cache_events=True)
        if self.config.breadth:
            if self.config.hash_lookahead_always and drawn_eagle:
                hashing = {**hashing, "num_hash_lookahead_tokens": 1}
            if any(isinstance(g.kv_cache_spec, MambaSpec) for g in pool.groups):
                hashing = {**hashing, "num_hash_lookahead_tokens": 0}  # see hashing_settings
            if hashing["num_hash_lookahead_tokens"]:  # lookahead hashes prove the boundary: no drop
                hashing = {**hashing, "use_eagle": False}
            pool = dataclasses.replace(pool, **hashing)
        if context_parallel_draw is not None:
            pool = with_context_parallel(pool, *context_parallel_draw)
            key = f"dcp{pool.dcp_world_size}/pcp{pool.pcp_world_size}"
            self.stats.context_parallel_pools[key] = self.stats.context_parallel_pools.get(key, 0) + 1
        if shared_prefix_draw is not None:
            pool = with_shared_prefix_checkpoint(pool, *shared_prefix_draw)
        if num_prefill_lookahead:
            # vLLM: 0 without EAGLE; the hash lookahead equals it when lookahead hashes are on
            eagle_pool = pool.use_eagle or any(g.is_eagle_group for g in pool.groups)
            n = 0 if not eagle_pool else 1 if pool.num_hash_lookahead_tokens \
                else min(num_prefill_lookahead, pool.scheduler_block_size)
            if pool.num_hash_lookahead_tokens and drawn_eagle and not _one_sliding_window_group(pool):
                # multi-module MTP with lookahead hashes (vLLM's num_hash_lookahead_tokens is
                # num_prefill_lookahead_tokens, the block drop off); not on a pool of one
                # sliding-window group, where vLLM's lookup reads a hash lookahead of >= 2
                # leaves out (IndexError, docs/coverage.md)
                n = min(num_prefill_lookahead, pool.scheduler_block_size)
                pool = dataclasses.replace(pool, num_hash_lookahead_tokens=n)
            if pool.num_hash_lookahead_tokens:
                k = pool.num_hash_lookahead_tokens
                self.stats.hash_lookahead_pools[k] = self.stats.hash_lookahead_pools.get(k, 0) + 1
            pool = dataclasses.replace(pool, num_prefill_lookahead=n)
            self.stats.prefill_lookahead_pools[n] = self.stats.prefill_lookahead_pools.get(n, 0) + 1
        return pool

    def _setup(self, pool, async_mode: bool, hashing: dict, retention_probe: int | None,
               num_prefill_lookahead: int, context_parallel_draw, shared_prefix_draw) -> None:
        """The setup rule's body: the implementations built on the drawn pool (an implementation
        other than vLLM refusing it rejects the example), the harness that compares them, and the
        per-pool helpers (metrics pairing, Mamba chunk split, junction checkpoints)."""
        pool = self._drawn_pool(pool, hashing, num_prefill_lookahead, context_parallel_draw, shared_prefix_draw)
        managers = {}
        for kind in self.config.kinds:
            try:
                managers[kind] = make_manager(kind, pool)
            except ValueError as exc:
                if kind == "vllm":
                    raise
                self.stats.unsupported_pools += 1
                self.stats.unsupported_reasons[f"{kind}: {exc}"[:300]] += 1
                reject()
        self.h = Harness(pool, managers)
        self.metrics = MetricsPairing(managers, pool.num_blocks) if {"reference", "vllm"} <= set(managers) \
            else None
        self.mamba_split = mamba_split_config(pool)  # None unless a Mamba group is "align"
        if pool.enable_mamba_shared_prefix_checkpoint:
            on = compare_shared_prefix_checkpoint(managers)
            self.mamba_split = with_split_junction_stop(self.mamba_split, on)
            key = "on" if on else "off"
            self.stats.shared_prefix_checkpoint_pools[key] = self.stats.shared_prefix_checkpoint_pools.get(key, 0) + 1
            self.junctions = JunctionCheckpoints(self.h, managers.get("reference") if on else None)
        self.dcp_scaled = any(g.kv_cache_spec.effective_block_size(pool.dcp_world_size)
                              != g.kv_cache_spec.block_size for g in pool.groups)
        self._probe_retention_validation(managers, retention_probe)
        self.async_mode = async_mode
        name = _group_set_name(pool)
        self.stats.group_sets[name] = self.stats.group_sets.get(name, 0) + 1
        interval = pool.prefix_cache_retention_interval
        kind = "dense" if interval is None else str(interval // pool.scheduler_block_size) + "*sbs"
        self.stats.retention_pools[kind] = self.stats.retention_pools.get(kind, 0) + 1

    def teardown(self) -> None:
        if self.h is not None:
            self.stats.steps.append(self.h.num_applied)
            self.stats.admission_rejections += self.h.num_admission_rejections
            self.stats.step_rejections += self.h.num_step_rejections
            self.stats.ops_applied += self.h.num_applied
            self.stats.prefix_hits += self.h.num_prefix_hits
            if self.h.pool_config.num_hash_lookahead_tokens >= 2:
                self.stats.hash_lookahead_hits += self.h.num_prefix_hits
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
            self.stats.cow_copies += self.h.num_cow_copies
            self.stats.zeroed_blocks += self.h.num_zeroed_blocks
            self.stats.boundary_state_offloads += self.h.num_boundary_state_offloads
            self.stats.partial_tail_offloads += self.h.num_partial_tail_offloads
            self.stats.failed_loads += self.h.num_failed_loads
            self.stats.junctions += self.h.num_junctions
            self.stats.junction_checkpoints += self.junctions.count
            if self.dcp_scaled:
                self.stats.dcp_prefix_hits += self.h.num_prefix_hits
                self.stats.dcp_cow_copies += self.h.num_cow_copies
            if self.h.pool_config.prefix_cache_retention_interval is not None:
                self.stats.retention_junctions += self.h.num_junctions
            self.stats.resets += self.h.num_resets
            self.stats.edge_reservations += self.edges.reservations
            self.stats.edge_fills += self.edges.fills
            self.stats.full_pool_follow_ups += self.edges.full_pool_follow_ups
            if self.metrics is not None:
                self.stats.metrics_events += self.metrics.num_events
                self.stats.metrics_events_with_gaps += self.metrics.num_events_with_gaps
                self.stats.metrics_max_followed = max(self.stats.metrics_max_followed,
                                                      self.metrics.max_followed)
                self.stats.metrics_max_followed_hit = max(self.stats.metrics_max_followed_hit,
                                                          self.metrics.max_followed_hit)
            for k, v in self.h.num_events.items():
                self.stats.kv_events[k] = self.stats.kv_events.get(k, 0) + v
            for k, v in self.h.seconds_by_kind.items():
                self.stats.seconds_by_kind[k] = self.stats.seconds_by_kind.get(k, 0.0) + v

    # -- helpers ---------------------------------------------------------------------------

    def _probe_retention_validation(self, managers: dict, retention_interval: int | None) -> None:
        """Would this pool's groups take ``retention_interval``? vLLM's coordinator (a fresh
        manager built with it) and the reference's rule must agree (issue #23): a non-zero
        interval without sliding-window/Mamba groups, a negative one, one off the scheduler
        block grid are refused."""
        probes = {k: getattr(m, "rejects_prefix_cache_retention_interval", None) for k, m in managers.items()}
        if len(probes) < 2 or None in probes.values():
            return
        answers = {k: probe(retention_interval) for k, probe in probes.items()}
        if len(set(answers.values())) > 1:
            raise Divergence(f"prefix_cache_retention_interval={retention_interval!r} refused: {answers}",
                             "setup: prefix_cache_retention_interval validation differs")
        key = "refused" if next(iter(answers.values())) else "accepted"
        self.stats.retention_probes[key] = self.stats.retention_probes.get(key, 0) + 1

    def _apply(self, op: Op) -> None:
        assert self.h is not None
        t = time.perf_counter()
        try:
            if self.metrics is None:
                self.h.apply(op)
            else:
                with self.metrics.vllm_random():
                    self.h.apply(op)
                differs = self.metrics.compare()
                if differs is not None:
                    raise Divergence(f"after op {len(self.h.trace.ops)} {op.name}: {differs}",
                                     f"{op.name}: kv cache metrics differ")
        except Divergence as exc:
            if is_accepted(exc.signature):
                # a difference the developer accepted (baseline): discard this trace, keep searching
                self.stats.accepted_divergences += 1
                reject()
            # One file per distinct finding: shrinking re-runs failing traces hundreds of times and
            # ends on the minimal one, which overwrites the earlier, longer ones.
            key = hashlib.sha256((exc.signature or str(exc)).encode()).hexdigest()[:12]
            path = self.h.trace.save(Path(self.config.traces_to or trace_dir()) / f"trace-{key}.json")
            kinds = self.config.kinds
            raise Divergence(f"{exc}\n  kinds={kinds}; trace ({len(self.h.trace.ops)} ops) saved to {path}"
                             f"\n  replay: kvref replay {path} --kinds {','.join(kinds)}",
                             exc.signature, trace_path=str(path)) from exc
        finally:
            self.stats.seconds_in_harness += time.perf_counter() - t
        self.junctions.observe()

    def _in_flight_allowed(self, rid: str, chunk: int) -> bool:
        assert self.h is not None
        if not self.async_mode:
            return False
        s = self.h.reqs[rid]
        cap = self.h.pool_config.effective_max_in_flight_tokens
        return len(s.batches) < MAX_BATCHES_IN_FLIGHT and s.request.num_in_flight_tokens + chunk <= cap

    def _has(self, what: str) -> bool:
        return self.h is not None and bool(getattr(self.h, what)())

    def _count(self, rule: str) -> None:
        self.stats.rules[rule] = self.stats.rules.get(rule, 0) + 1

    def _apply_all(self, ops: list[Op]) -> None:
        for op in ops:
            self._apply(op)

    # -- rules -----------------------------------------------------------------------------

    @precondition(lambda self: self.h is not None and len(self.h.live()) < MAX_LIVE_REQUESTS)
    @rule(data=st.data())
    def add_request(self, data) -> None:
        self._count("add_request")
        self._add(data)

    def _add(self, data) -> str:
        assert self.h is not None
        prompt = data.draw(prompts(self.h.pool_config.max_model_len, self.h.token_sequences()), label="prompt")
        rid = self.rids.take()
        extras = data.draw(request_hash_inputs(prompt), label="hash_inputs") if self.config.breadth else {}
        if self.mamba_split is not None or self.dcp_scaled:
            # aligned_chunk looks the hit up on the compared reference itself: with "full"
            # reporting that lookup would queue KV events vLLM never sees; under DCP vLLM
            # announces hits at the unscaled block size (docs/differences.md, issue #23)
            extras.pop("report_full", None)
        self._apply(Op("add", dict(rid=rid, prompt=prompt, max_tokens=data.draw(st.integers(1, 32)),
                                   cache_salt=data.draw(CACHE_SALTS), **extras)))
        return rid

    @precondition(lambda self: self.h is not None and len(self.h.live()) < MAX_LIVE_REQUESTS)
    @rule(data=st.data())
    def add_and_admit(self, data) -> None:
        """An arrival the scheduler admits at once. Besides ``admit``: Hypothesis' swarm testing
        switches rules off per trace, and a trace whose only admission rule is off compares
        nothing but arrivals, evictions and empty steps."""
        self._count("add_and_admit")
        rid = self._add(data)
        chunk = data.draw(st.sampled_from((1, 4, 16, 64, 1024)), label="chunk")
        self._admit(data, rid, chunk, 0)

    @precondition(lambda self: self._has("waiting"))
    @rule(data=st.data())
    def admit(self, data) -> None:
        self._count("admit")
        assert self.h is not None
        waiting = self.h.waiting()
        # FCFS: mostly the head of the queue; sometimes another one (a skipped head), or the
        # longest (admission caps of windowed groups bind on long requests only).
        pick = data.draw(st.integers(0, 5))
        rid = (waiting[0] if pick > 1 else data.draw(st.sampled_from(waiting)) if pick else
               max(waiting, key=lambda r: self.h.reqs[r].request.num_tokens))
        chunk = data.draw(st.sampled_from((1, 2, 4, 8, 16, 64, 1024)), label="chunk")
        external = (data.draw(st.sampled_from((0, 0, 0, 0, 0, 4, 16, 64)), label="external")
                    if self._external_loads_ok() else 0)
        self._admit(data, rid, chunk, external, fill=True)

    def _admit(self, data, rid: str, chunk: int, external: int, fill: bool = False) -> None:
        """One admission. Where it is decided (drawn): under a plain reservation (0-3 blocks), at
        the pool's boundary (``reserve_slack``: 0-4 free blocks left, the scheduler's reservation
        for in-flight prefills, PR 44560), under the largest reservation it still fits (or one
        more: refused by a block), or (``fill``) after filler requests took all but what it
        needs (the full-sequence gate decided by a block: no reservation reaches that gate)."""
        # one draw decides where: plain reservations (0-3 blocks), the boundary (reserve_slack), the
        # edge by reservation or (fill) by fillers (few draws per op: Hypothesis' per-draw cost
        # dominated the check's time once ops were aimed)
        if self.mamba_split is not None and data.draw(st.integers(0, 3), label="mamba_split"):
            chunk = aligned_chunk(self.h, self.mamba_split, rid, chunk, admitting=True)
        aim, amount = data.draw(st.sampled_from(
            (("plain", 0),) * 6 + (("plain", 1), ("plain", 3), ("slack", 0), ("slack", 1), ("slack", 2),
                                   ("slack", 4), ("edge", 0), ("edge_short", 0)) * 2
            + ((("fill", 0), ("fill_short", 0)) if fill else ())),
            label="aim")
        if not edges.can_aim(self.h) and aim not in ("plain", "slack"):
            aim, amount = "plain", 0
        op = Op("admit", dict(
            rid=rid, chunk=chunk, full_sequence_must_fit=data.draw(st.booleans()),
            reserved_blocks=amount if aim == "plain" else 0,
            in_flight=self._in_flight_allowed(rid, chunk) and data.draw(st.booleans()),
            token=self._token(rid), external=external,
            # a connector's async load (WAITING_FOR_REMOTE_KVS) for some of the external ones
            async_load=external > 0 and data.draw(st.booleans(), label="async_load"),
            # the scheduler's reservation for in-flight prefills, drawn relative to the free
            # blocks: admission decided with 0-4 blocks to spare, whatever the pool's size
            reserve_slack=amount if aim == "slack" else -1))
        if aim.startswith("edge"):
            reserved = edges.edge_reserved(self.h, op, aim == "edge_short", self.edges)
            if reserved is not None:
                op = Op("admit", {**op.args, "reserved_blocks": reserved, "reserve_slack": -1})
        elif aim.startswith("fill"):
            # the full-sequence gate is what only a full pool decides (it ignores reservations)
            plain = Op("admit", {**op.args, "reserved_blocks": 0, "reserve_slack": -1,
                                 "full_sequence_must_fit": True})
            self._apply_all(edges.fill_to_edge(self.h, data, self.rids, self.edges, [plain],
                                               short=aim == "fill_short"))
            op = plain
        self._apply(op)

    @precondition(lambda self: self.h is not None and self.h.reqs and len(self.h.live()) < MAX_LIVE_REQUESTS
                  and self._external_loads_ok())
    @rule(data=st.data())
    def follow_up_with_external(self, data) -> None:
        """A KV connector's path: a new request extends a known sequence (a multi-turn
        follow-up, so the local prefix cache hits, on every group of a hybrid pool), and the
        connector claims tokens past the hit (``num_external_computed_tokens``), loaded
        synchronously or asynchronously. vLLM #33775 (external blocks allocated before a
        later group's hits were touched) lives only on this path: one time in three the
        extended request is still running, filler requests take every free block, then it
        and the fillers finish (its blocks at the free queue's head, the fillers' behind), and
        the follow-up's external blocks are taken from exactly that queue."""
        self._count("follow_up_with_external")
        assert self.h is not None
        if (edges.can_aim(self.h) and self.h.pool_config.enable_caching and len(self.h.pool_config.groups) > 1
                and data.draw(st.integers(0, 1), label="full_pool") == 0):
            edges.full_pool_follow_up(self.h, data, self.rids, self.edges, self._apply_all)
            return
        # extend a request whose KV was computed (cached now, or still held), else any known one
        computed = sorted(r for r, x in self.h.reqs.items() if x.holds_blocks or x.request.output_token_ids)
        base = self.h.reqs[data.draw(st.sampled_from(computed or sorted(self.h.reqs)), label="extends")].request
        self._follow_up(data, base, data.draw(st.integers(1, 16), label="tail"))

    def _follow_up(self, data, base, tail: int) -> None:
        assert self.h is not None
        limit = max(1, min(self.h.pool_config.max_model_len - 1, 64))
        prompt = (list(base.all_token_ids) + [data.draw(TOKENS) for _ in range(min(tail, 4))]
                  + [0] * max(0, tail - 4))[:limit]
        rid = self.rids.take()
        # the follow-up hits the local cache: in "full" report mode (which changes no hash) that hit
        # is announced in KV events (vLLM's emit_cached_block_events; not where aligned_chunk
        # looks hits up on the reference alone, see _add)
        full = (self.config.breadth and self.mamba_split is None and not self.dcp_scaled
                and data.draw(st.booleans(), label="report_full"))
        self._apply(Op("add", dict(rid=rid, prompt=prompt, max_tokens=data.draw(st.integers(1, 8)),
                                   cache_salt=base.cache_salt, **({"report_full": True} if full else {}))))
        chunk = data.draw(st.sampled_from((4, 16, 1024)), label="chunk")
        sbs = self.h.pool_config.scheduler_block_size
        self._admit(data, rid, chunk, data.draw(st.sampled_from((sbs, 2 * sbs, 4, 16, 64)), label="external"))

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
        self._count("load_done")
        assert self.h is not None
        rid = data.draw(st.sampled_from(self.h.loading()))
        args = dict(rid=rid)
        if self.config.breadth and data.draw(st.integers(0, 3), label="load_fails") == 0:
            # the load fails: only a prefix of it is valid (KV zeroing re-records the rest, #23)
            args["valid_tokens"] = data.draw(st.integers(0, self.h.reqs[rid].request.num_computed_tokens),
                                             label="valid_tokens")
        self._apply(Op("load_done", args))

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
        return self.config.mamba_align_external_loads or not any(
            isinstance(g.kv_cache_spec, MambaSpec) and g.kv_cache_spec.mamba_cache_mode == "align"
            for g in self.h.pool_config.groups)

    def _step(self, data) -> None:
        """A running request's next chunk. One step in four starts a new scheduler step first
        (``new_step_starts``: only Mamba managers act on it); one in eight runs after filler
        requests left it exactly the blocks it needs, or one short (refused: the scheduler would
        preempt), where a step predictor that under-counts makes vLLM raise mid-allocation."""
        self._count("step")
        assert self.h is not None
        aim = data.draw(st.sampled_from(("plain",) * 10 + ("new_step",) * 4 + ("fill", "fill_short")
                                        + (("stats",) if self.config.breadth else ())), label="aim")
        if aim == "new_step":
            self._apply(Op("new_step", {}))
        if aim == "stats":  # the scheduler's make_stats: prefix-cache stats taken and reset
            self._count("make_prefix_cache_stats")
            self._apply(Op("make_prefix_cache_stats", {}))
        rid = data.draw(st.sampled_from(self.h.steppable()))
        chunk = data.draw(st.sampled_from((1, 1, 2, 3, 4, 8, 16, 64)), label="chunk")
        if self.mamba_split is not None and data.draw(st.integers(0, 3), label="mamba_split"):
            chunk = aligned_chunk(self.h, self.mamba_split, rid, chunk, admitting=False)
        op = Op("step", dict(
            rid=rid, chunk=chunk, lookahead=data.draw(st.sampled_from((0, 0, 0, 0, 1, 2))),
            in_flight=self._in_flight_allowed(rid, chunk) and data.draw(st.booleans()),
            token=self._token(rid)))
        if aim.startswith("fill") and edges.can_aim(self.h):
            self._apply_all(edges.fill_to_edge(self.h, data, self.rids, self.edges, [op],
                                               short=aim == "fill_short"))
        self._apply(op)

    def _token(self, rid: str) -> int:
        """The token a step samples, from the request's id and length (no draw: tokens are a
        small vocabulary anyway, and prefix hits come from shared prompts)."""
        assert self.h is not None
        return (7 * int(rid[1:]) + 3 * self.h.reqs[rid].request.num_tokens + 1) % 8

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

    @precondition(lambda self: self._has("steppable") and self.h.pool_config.groups and any(
        isinstance(g.kv_cache_spec, RSWASpec) for g in self.h.pool_config.groups))
    @rule(data=st.data())
    def decode_run(self, data) -> None:
        """R-SWA pools: one request decodes a run of tokens, one by one, so the decode window
        moves past the prompt and the gap between them is freed (issue #23)."""
        self._count("decode_run")
        assert self.h is not None
        # the request with the most output left: the window must move past the prompt's end
        rid = max(self.h.steppable(), key=lambda r: self.h.reqs[r].request.max_tokens
                  - len(self.h.reqs[r].request.output_token_ids))
        for i in range(data.draw(st.integers(8, 24), label="run")):
            if rid not in self.h.steppable():
                break
            # the rest of the prompt first (one chunk), then one token per step
            chunk = self.h._num_schedulable(self.h.reqs[rid]) if i == 0 else 1
            self._apply(Op("step", dict(rid=rid, chunk=chunk, lookahead=0, in_flight=False,
                                        token=self._token(rid))))

    @precondition(lambda self: self._has("in_flight"))
    @rule(data=st.data())
    def process_output(self, data) -> None:
        self._count("process_output")
        assert self.h is not None
        self._apply(Op("process", dict(rid=data.draw(st.sampled_from(self.h.in_flight())))))

    @precondition(lambda self: self._has("running"))
    @rule(data=st.data())
    def preempt(self, data) -> None:
        self._count("preempt")
        assert self.h is not None
        # The scheduler's victim is the last running request (FCFS); allow any.
        running = self.h.running()
        rid = running[-1] if data.draw(st.booleans()) else data.draw(st.sampled_from(running))
        self._apply(Op("preempt", dict(rid=rid, hold_view=self.config.breadth and data.draw(st.booleans()))))

    @precondition(lambda self: self.h is not None and len(self.h.running()) >= 2)
    @rule(data=st.data())
    def preemption_storm(self, data) -> None:
        """The pool ran dry with several requests running: vLLM preempts the newest running
        request, then the next newest, ... (``running.pop()``), each freed in turn, so the
        free queue takes their blocks in that order."""
        self._count("preemption_storm")
        assert self.h is not None
        running = self.h.running()
        k = data.draw(st.integers(2, len(running)), label="victims")
        for rid in running[::-1][:k]:
            self._apply(Op("preempt", dict(rid=rid)))
        self.num_storms += 1

    @precondition(lambda self: self._has("live"))
    @rule(data=st.data())
    def finish(self, data) -> None:
        self._count("finish")
        assert self.h is not None
        self._apply(Op("finish", dict(rid=data.draw(st.sampled_from(self.h.live())),
                                      hold_view=self.config.breadth and data.draw(st.booleans()))))

    @precondition(lambda self: self.h is not None and bool(self.h._prev_cached)
                  and (self._has_all("evict_blocks") or self._has_all("reset_prefix_cache")))
    @rule(data=st.data())
    def invalidate_cache(self, data) -> None:
        """Cached blocks lose their hashes, only while something is cached (else both are no-ops
        that, always enabled, crowded out the rest: ``evict_blocks`` alone was up to 44 % of a
        run's ops). Mostly a KV connector invalidating blocks (failed loads; mostly blocks that
        are cached, held or free); sometimes an RLHF weight update / benchmark resetting the
        prefix cache (an ``AllBlocksCleared`` event), while requests run only at one op position
        in ten: a reset that preempts everything would crowd out the long runs the other rules
        build."""
        assert self.h is not None
        can_reset = self._has_all("reset_prefix_cache") and (
            not self.h.running() or self.h.num_applied % 10 == 9)
        if can_reset and (not self._has_all("evict_blocks") or data.draw(st.integers(0, 3), label="reset") == 0):
            self._count("reset_prefix_cache")
            self._apply(Op("reset_prefix_cache", dict(reset_running_requests=data.draw(st.booleans()))))
            return
        if not self._has_all("evict_blocks"):
            return
        self._count("evict_blocks")
        n = self.h.pool_config.num_blocks
        cached = sorted({b for (_, b) in self.h._prev_cached})
        ids = data.draw(st.lists(st.one_of(st.sampled_from(cached), st.integers(1, max(1, n - 1))),
                                 max_size=3), label="block_ids")
        self._apply(Op("evict_blocks", dict(block_ids=ids)))

    @precondition(lambda self: self.config.breadth and self._has("waiting"))
    @rule(data=st.data())
    def connector_lookup(self, data) -> None:
        """A KV connector's lookup for a waiting request and its hit truncated at an aligned
        endpoint; mostly followed by the admission itself. No state changes."""
        self._count("connector_lookup")
        assert self.h is not None
        rid = data.draw(st.sampled_from(self.h.waiting()))
        sbs = self.h.pool_config.scheduler_block_size
        self._apply(Op("connector_lookup", dict(rid=rid, truncate=sbs * data.draw(st.integers(0, 8)))))
        if data.draw(st.integers(0, 3)):
            self._admit(data, rid, data.draw(st.sampled_from((1, 4, 16, 1024)), label="chunk"), 0)

    def _has_all(self, method: str) -> bool:
        return self.h is not None and self.h._all_have(method)

    @precondition(lambda self: self.h is not None and self.h.pool_config.enable_caching and any(
        isinstance(g.kv_cache_spec, MambaSpec) for g in self.h.pool_config.groups))
    @rule()
    def new_step(self) -> None:
        """``new_step_starts`` on its own, where it acts (a Mamba group that caches forgets the
        blocks it cached this step); one step in four starts a new scheduler step too. Always
        enabled, it was the most frequent op (29 % of them over seeds 0-2, 42 % on one)."""
        self._count("new_step")
        self._apply(Op("new_step", {}))


class _SiblingRules:
    """The rule a machine has only where the Mamba shared-prefix checkpoint is asked for (a rule
    that exists elsewhere would shift the other runs' inputs); mixed in before
    :class:`KVCacheManagerRules`."""

    @precondition(lambda self: self.junctions.managers and len(self.h.live()) < MAX_LIVE_REQUESTS - 1
                  and bool(self._computed_prefixes()))
    @rule(data=st.data())
    def add_siblings(self, data) -> None:
        """Where the Mamba shared-prefix checkpoint is on (issue #23): one or two requests
        sharing a cut of a computed sequence, each with a fresh tail, admitted at once (a
        new scheduler step between them). The attention groups hit the shared prefix, the
        Mamba group lags (its states sit at other requests' chunk ends), so the lookup
        returns a junction; the split stops the first chunk there and the Mamba group keys
        that state, which the second sibling resumes at."""
        self._count("add_siblings")
        assert self.h is not None
        known = data.draw(st.sampled_from(self._computed_prefixes()), label="known")
        limit = max(3, min(self.h.pool_config.max_model_len - 1, 64))
        cut = data.draw(st.integers(2, min(len(known), limit - 1)), label="cut")
        for n in range(data.draw(st.integers(1, 2), label="siblings")):
            if n:
                self._apply(Op("new_step", {}))
            tail = tokens_from_seed(data.draw(st.integers(0, 2**16), label="tail_seed"),
                                    data.draw(st.integers(1, limit - cut), label="tail"))
            rid = self.rids.take()
            self._apply(Op("add", dict(rid=rid, prompt=list(known[:cut]) + tail,
                                       max_tokens=data.draw(st.integers(1, 8)), cache_salt=None)))
            self._admit(data, rid, 1024, 0)

    def _computed_prefixes(self) -> list[list[int]]:
        return [s.request.all_token_ids[:s.request.num_computed_tokens] for s in self.h.reqs.values()
                if s.request.num_computed_tokens > 2]


def kv_cache_manager_machine(kinds: tuple[str, ...], group_sets: tuple[str, ...] = GROUP_SETS,
                             max_blocks: int = 48, eagle: bool | str = True,
                             mamba_align_external_loads: bool = False,
                             kv_events: bool = True, breadth: bool = True,
                             traces_to: str | Path | None = None,
                             retention: bool | str = False,
                             prefill_lookahead: bool = False,
                             context_parallel: bool = False,
                             shared_prefix_checkpoint: bool | str = False,
                             hash_lookahead_always: bool = False) -> type[RuleBasedStateMachine]:
    """A state machine class driving the implementations ``kinds`` side by side.

    A pool that an implementation other than vLLM refuses (``ValueError``: kvref's "not modelled"
    or bad-input errors) is rejected as an example; vLLM refusing a generated pool is a failure
    (the strategies only make pools vLLM accepts).

    ``kv_events``: pools are built with ``enable_kv_cache_events`` so that the harness compares
    the KV cache event streams after every op (where every implementation has them).

    ``traces_to``: the folder a failing trace is saved to (default :func:`trace_dir`); the raised
    :class:`Divergence` carries the file in ``trace_path``.

    ``breadth``: draw block-hash inputs (multimodal, LoRA, prompt embeds, session, skip-reading),
    hash functions, NONE_HASH seeds, hash lookahead and stats, and the connector-view ops (issue
    #23); only where every implementation models them (the torch implementation hashes token ids
    and the salt only).

    ``retention``: draw sparse prefix-cache retention intervals for sliding-window and Mamba pools
    (``pool_configs``' argument: True one pool in two, ``"always"``) and probe a drawn interval's
    validation on every pool (issue #23); only where ``breadth`` holds. Off by default, so the
    other runs keep their inputs; ``kvref verify``'s conform-kv-manager turns it on.

    ``prefill_lookahead``: draw vLLM's ``num_prefill_lookahead`` (1..4, clamped to the scheduler
    block size) for EAGLE pools without lookahead hashes (multi-module MTP with
    ``disable_lookahead_block_hashes``) and, with them, the same n as ``num_hash_lookahead_tokens``
    (vLLM derives one from the other: every block's hash covers the next n tokens) except on a pool
    of one sliding-window group (1 there: vLLM's IndexError, docs/coverage.md); only where ``breadth``
    holds. Off by default (then not an argument of the setup rule, so the other runs keep their inputs).
    ``hash_lookahead_always``: every EAGLE pool hashes a lookahead (the drawn n with
    ``prefill_lookahead``), for tests that must reach it in a few examples.

    ``context_parallel``: run pools under DCP/PCP (``models.machines.context_parallel``: DCP 2 or
    4 in three pools of four, PCP 2 in one of four, groups and block sizes re-resolved as vLLM accepts
    them; issue #23); only where ``breadth`` holds. Off by default, likewise not a setup argument.

    ``shared_prefix_checkpoint``: ask for vLLM's ``enable_mamba_shared_prefix_checkpoint`` on pools
    with a Mamba "align" group (True one pool in two, ``"always"`` every such pool), with EAGLE
    drafting one such pool in two (the feature needs EAGLE groups; vLLM narrows it away without
    them, without partial hash hits and under an MTP tail, and both narrowings are compared); chunks
    then stop at the junction and the Mamba group keys its state there (issue #23). Only where
    ``breadth`` holds; off by default, likewise not a setup argument.
    """
    kinds = tuple(kinds)
    breadth = breadth and set(kinds) <= {"reference", "vllm"}
    cfg = MachineConfig(kinds=kinds, group_sets=group_sets, max_blocks=max_blocks, eagle=eagle,
                        mamba_align_external_loads=mamba_align_external_loads, kv_events=kv_events,
                        breadth=breadth, traces_to=traces_to, retention=retention if breadth else False,
                        prefill_lookahead=prefill_lookahead and breadth,
                        context_parallel=context_parallel and breadth,
                        shared_prefix_checkpoint=shared_prefix_checkpoint if breadth else False,
                        hash_lookahead_always=hash_lookahead_always)
    # the lookahead is an argument only when drawn: even st.just(0) shifts the other runs' inputs
    setup_args = {"num_prefill_lookahead": st.integers(1, 4)} if cfg.prefill_lookahead else {}
    if cfg.context_parallel:
        setup_args["context_parallel_draw"] = context_parallel_draws()
    if cfg.shared_prefix_checkpoint:
        setup_args["shared_prefix_draw"] = shared_prefix_checkpoint_draws(cfg.shared_prefix_checkpoint)
    bases = (_SiblingRules, KVCacheManagerRules) if cfg.shared_prefix_checkpoint else (KVCacheManagerRules,)

    class KVCacheManagerMachine(*bases):
        config = cfg
        stats = MachineStats()

        @initialize(pool=pool_configs(group_sets=cfg.group_sets, max_blocks=cfg.max_blocks, eagle=cfg.eagle,
                                      retention=cfg.retention),
                    async_mode=st.booleans(), hashing=hashing_settings(),
                    retention_probe=st.one_of(st.none(), st.integers(-8, 40)) if cfg.retention else st.none(),
                    **setup_args)
        def setup(self, pool, async_mode, hashing, retention_probe, num_prefill_lookahead=0,
                  context_parallel_draw=None, shared_prefix_draw=None) -> None:
            self._setup(pool, async_mode, hashing, retention_probe, num_prefill_lookahead, context_parallel_draw,
                        shared_prefix_draw)

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
    from hypothesis import HealthCheck, Phase, settings
    from hypothesis.stateful import run_state_machine_as_test

    from kvref.models.hypothesis_runs.reproducible import seeded

    final_dir = Path(out_dir) if out_dir is not None else trace_dir()
    # Failing traces go to a staging folder while Hypothesis searches and shrinks (it re-runs failing
    # traces hundreds of times, and shrinking can pass through other findings); only the trace of the
    # finding it reports is kept, in the out dir: one file per finding.
    staging = tempfile.mkdtemp(prefix="kvref-staging-")
    machine = kv_cache_manager_machine(tuple(kinds), traces_to=staging, **machine_kwargs)
    phases = tuple(Phase) if shrink else tuple(p for p in Phase if p != Phase.shrink)
    # A seed must win over a derandomizing profile: Hypothesis' own ``ci`` profile (loaded wherever
    # the CI variable is set) derandomizes, and derandomize beats global_force_seed, so without
    # this ``kvref verify --seed 3`` in a CI job silently drew other traces than the same command
    # run elsewhere (a Ray run of it disagreed with the local one).
    extra = {"derandomize": False} if seed is not None else {}
    s = settings(max_examples=examples, stateful_step_count=steps, deadline=None, database=None,
                 suppress_health_check=list(HealthCheck), print_blob=True, phases=phases, **extra)
    t = time.perf_counter()
    # run_state_machine_as_test takes no seed; Hypothesis' own --hypothesis-seed hook does the job
    try:
        # seeded: no constants from the modules this process has loaded either (the scheduler
        # machines do the same), so the seed alone fixes the traces, in any process (a Ray worker)
        with seeded(seed):
            run_state_machine_as_test(machine, settings=s, _min_steps=min_steps + 1)
    except Exception as exc:  # a Divergence, or several (ExceptionGroup), or Hypothesis' own errors
        subs = exc.exceptions if isinstance(exc, BaseExceptionGroup) else (exc,)
        msg = "\n".join(f"{type(e).__name__}: {e}" for e in subs)
        path = next((e.trace_path for e in subs if isinstance(e, Divergence) and e.trace_path), None)
        if path and os.path.exists(path):
            final_dir.mkdir(parents=True, exist_ok=True)
            kept = str(final_dir / os.path.basename(path))
            shutil.move(path, kept)
            msg, path = msg.replace(path, kept), kept
        sig = next((e.signature for e in subs if isinstance(e, Divergence)), None)
        return MachineRun(machine.stats, time.perf_counter() - t, msg, path, sig)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return MachineRun(machine.stats, time.perf_counter() - t)
