"""The tiering orchestrator (vLLM ``tiering/manager.py::TieringOffloadingManager``).

Rules (each compared with vLLM 0.33.0 on generated traces, models/machines/tiering.py):

* **Cascade.** When a GPU->primary store completes successfully, every secondary tier whose
  back-pressure detector allows it gets a store job for those chunks; each job pins the chunks in
  the primary tier (``prepare_read``) until the tier reports it, so a chunk being copied out is
  never evicted.
* **Promotion.** A primary miss asks the secondary tiers in order; the first HIT reserves a primary
  slot at once (the chunk is then HIT_PENDING there, so a second lookup in the same step does not
  promote it twice) and answers HIT_PENDING; if no slot can be freed the answer is MISS. The loads
  are batched per (tier, request) and submitted at the end of the step. RETRY means a tier does
  not know yet (an async lookup); MISS otherwise.
* **Completion.** Finished jobs are collected at most once per step from lookups, always before a
  ``prepare_store`` (eviction must see released pins), and at the end of the step. A promotion
  that fails loses its reserved slots, except for the keys it did load.
* **Finalization.** A finished request's secondary-tier state is released only when no
  GPU->primary store of it is pending (its completion may still cascade).
* **Reset.** Jobs are drained, the primary tier forgets everything, secondary tiers keep their
  data, promotions are held (lookups of primary misses answer MISS) until ``on_reset_flushed``:
  a late DMA of a job in flight at the reset may still write a freed slot.
* **Cache-hit source.** A chunk promoted for a request is reported as coming from the tier it was
  promoted from (DISK for fs), not from the host.

``check_invariants``: every job's tier holds it in flight; pinned primary chunks are exactly the
cascades in flight (plus loads the caller pinned); reserved (HIT_PENDING) chunks are promotions
in flight or queued, or GPU stores; a key is promoted at most once at a time.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Collection, Iterable, Sequence

from kvref.spec.errors import InvalidFieldError, check_int

from ..cpu_offloading_manager import _check_keys
from ..keys import LookupResult, OffloadKey, OffloadStateError, RequestContext
from ..tier_filter import TierFilter
from .lookup_metrics import LookupMetrics
from .primary_tier import CPUPrimaryTier
from .tier_base import JobResult, SecondaryTier, TierShutdownError, TransferJob

PRIMARY_LABEL = ("0:primary",)
M = "vllm:kv_offload_tiering_"


@dataclass
class PendingPromotion:
    ctx: RequestContext
    keys: list[OffloadKey] = field(default_factory=list)
    chunk_ids: list[int] = field(default_factory=list)


@dataclass
class RequestState:
    ctx: RequestContext
    pending_primary_stores: int = 0
    is_finished: bool = False
    request_level_tiers: set[int] | None = None
    pending_cascade_keys: list[OffloadKey] = field(default_factory=list)


class TieringOffloadingManager:
    """Args:
        primary: the CPU primary tier.
        tiers: secondary tiers, in lookup order.
        clock: monotonic seconds (job submit times, back-pressure).
    """

    def __init__(self, primary: CPUPrimaryTier, tiers: Sequence[SecondaryTier], clock: Callable[[], float]) -> None:
        if not isinstance(primary, CPUPrimaryTier):
            raise InvalidFieldError("primary", primary, "a CPUPrimaryTier")
        if isinstance(tiers, (str, bytes)) or not isinstance(tiers, Sequence) or not all(
                isinstance(t, SecondaryTier) and t.primary is primary.buffer for t in tiers):
            raise InvalidFieldError("tiers", tiers, "a sequence of SecondaryTier built on this primary tier's buffer")
        if not callable(clock):
            raise InvalidFieldError("clock", clock, "a callable returning monotonic seconds")
        self.primary = primary
        self.tiers = list(tiers)
        self.clock = clock
        self.job_counter = 0
        self.jobs: dict[int, tuple[TransferJob, int]] = {}
        self.promotions_held = False
        self.pending_loads: dict[int, dict[str, PendingPromotion]] = {}
        self.processed_this_step = False
        self.req_state: dict[str, RequestState] = {}
        self.load_sources: dict[str, dict[OffloadKey, str]] = {}
        self.counters: Counter = Counter()
        self.load_pins: Counter = Counter()  # pins held by GPU loads (prepare_load), per key
        self.lookup_metrics = LookupMetrics(clock)
        self.shut_down: list = []  # what shutdown() reached, in order: tier indexes, then "primary"

    def shutdown(self) -> None:
        """vLLM's ``shutdown``: every secondary tier gets its attempt, in order, even after one
        failed; then the last failure is raised and the primary tier is kept (a failed tier may
        still use the primary memory), else the primary tier is released too."""
        error = None
        for i, tier in enumerate(self.tiers):
            self.shut_down.append(i)
            try:
                tier.shutdown()
            except TierShutdownError as exc:
                error = exc
        if error is not None:
            raise error
        self.shut_down.append("primary")

    # -- jobs ---------------------------------------------------------------------------------

    def _label(self, i: int) -> tuple[str]:
        return (f"{i + 1}:{self.tiers[i].tier_type}",)

    def _register(self, keys, chunk_ids, is_promotion: bool, ctx: RequestContext, tier_idx: int) -> TransferJob:
        job = TransferJob(self.job_counter, tuple(keys), tuple(int(c) for c in chunk_ids), is_promotion,
                          ctx.req_id, self.clock())
        self.job_counter += 1
        self.jobs[job.job_id] = (job, tier_idx)
        return job

    def create_store_job(self, keys: Collection[OffloadKey], ctx: RequestContext, tier_idx: int) -> TransferJob:
        """Pin ``keys`` (ready primary chunks) and register a cascade to tier ``tier_idx``; the
        caller submits it, or (a tier serving a peer) reports it when the peer is done with the
        chunks (vLLM's ``ParentManager.create_store_job``)."""
        keys = _check_keys("keys", keys)
        self._state(ctx)
        check_int("tier_idx", tier_idx, minimum=0)
        if tier_idx >= len(self.tiers):
            raise InvalidFieldError("tier_idx", tier_idx, f"a tier index < {len(self.tiers)}")
        return self._register(keys, self.primary.prepare_read(keys), False, ctx, tier_idx)

    def _maybe_process_finished_jobs(self) -> None:
        if self.processed_this_step:
            return
        self.processed_this_step = True
        self._process_finished_jobs()

    def _process_finished_jobs(self, only=None) -> None:
        """Collect every tier's finished jobs (``only``: just these tier indexes)."""
        for i, tier in enumerate(self.tiers):
            if only is not None and i not in only:
                continue
            for res in tier.get_finished_jobs():
                if res.job_id not in self.jobs:
                    raise OffloadStateError(f"job_id: {res.job_id} reported by tier #{i} is not in flight")
                job, owner = self.jobs.pop(res.job_id)
                if owner != i:
                    raise OffloadStateError(f"job_id: {res.job_id} reported by tier #{i} belongs to tier #{owner}")
                self._count_finished(job, i, res)
                if job.is_promotion:
                    hist = f"{M}promotion_latency_seconds:{self._label(i) + ('success' if res.success else 'failure',)}"
                    self.counters[hist + "_count"] += 1
                    self.counters[hist + "_sum"] += self.clock() - job.submit_time
                if job.is_promotion:
                    self._complete_promotion(job, i, res)
                else:
                    self.primary.complete_load(job.keys, self._req_ctx(job.req_id))
                    self._update_backpressure(tier, job, res)

    def _count_finished(self, job: TransferJob, i: int, res: JobResult) -> None:
        label = self._label(i)
        n = len(job.keys)
        if not res.success:
            self.counters[f"{M}{'promotion' if job.is_promotion else 'cascade'}_job_failures:{label}"] += 1
            if not (job.is_promotion and res.successful_keys):
                return
            n = len(res.successful_keys)
        kind = "read" if job.is_promotion else "write"
        self.counters[f"{M}{kind}_bytes:{label}"] += n * self.primary.buffer.row_bytes
        if res.transfer_time is not None:
            self.counters[f"{M}{kind}_time:{label}"] += res.transfer_time

    def _complete_promotion(self, job: TransferJob, i: int, res: JobResult) -> None:
        if res.success:
            ok, failed = job.keys, ()
        elif res.successful_keys:
            failed_set = set(job.keys)
            if not failed_set.issuperset(res.successful_keys):
                raise OffloadStateError(f"job_id: {job.job_id} reported keys it was not asked to load")
            failed_set.difference_update(res.successful_keys)
            ok, failed = res.successful_keys, failed_set
        else:
            ok, failed = (), job.keys
        sources = self.load_sources.get(job.req_id)
        if sources is not None:
            for key in failed:
                if sources.get(key) == self.tiers[i].cache_hit_source:
                    del sources[key]
        ctx = self._req_ctx(job.req_id)
        if ok:
            self.primary.complete_store(ok, ctx, True)
        if failed:
            self.primary.complete_store(failed, ctx, False)

    def _update_backpressure(self, tier: SecondaryTier, job: TransferJob, res: JobResult) -> None:
        det = tier.bp_detector
        if det is None:
            return
        # vLLM asks the detector before and after (to log a change); the first question applies the
        # idle decay up to now before the sample lands, so it is part of the arithmetic
        was_under_pressure = det.is_under_pressure()
        if res.success:
            nbytes = res.transfer_bytes if res.transfer_bytes is not None else len(job.keys) * tier.block_size_bytes
            det.update(job.submit_time, nbytes)
        else:
            det.on_store_failed()
        det.is_under_pressure() != was_under_pressure  # noqa: B015 - the second question decays too

    def _should_store_to_tier(self, tier: SecondaryTier, num_blocks: int) -> bool:
        return tier.bp_detector is None or tier.bp_detector.should_store(num_blocks)

    # -- requests -----------------------------------------------------------------------------

    def _check_exclude(self, exclude_tier_idx) -> None:
        if exclude_tier_idx is not None:
            check_int("exclude_tier_idx", exclude_tier_idx, minimum=0)
            if exclude_tier_idx >= len(self.tiers):
                raise InvalidFieldError("exclude_tier_idx", exclude_tier_idx, f"None or a tier index < {len(self.tiers)}")

    def _req_ctx(self, req_id: str) -> RequestContext | None:
        st = self.req_state.get(req_id)
        return st.ctx if st is not None else None

    def _state(self, ctx: RequestContext) -> RequestState:
        if not isinstance(ctx, RequestContext) or ctx.req_id not in self.req_state:
            raise InvalidFieldError("ctx", ctx, f"the context of a live request ({sorted(self.req_state)})")
        return self.req_state[ctx.req_id]

    def on_new_request(self, ctx: RequestContext, exclude_tier_idx: int | None = None) -> str:
        """Returns "request" when any tier wants request-level offloading, else "chunk"."""
        if not isinstance(ctx, RequestContext):
            raise InvalidFieldError("ctx", ctx, "a RequestContext")
        self._check_exclude(exclude_tier_idx)
        st = RequestState(ctx)
        for i, tier in enumerate(self.tiers):
            if i == exclude_tier_idx:  # a tier's own peer request (vLLM's _SecondaryTierFacingParent)
                continue
            if tier.on_new_request(ctx.req_id) == "request":
                st.request_level_tiers = (st.request_level_tiers or set()) | {i}
        self.req_state[ctx.req_id] = st
        self.lookup_metrics.on_new_request(ctx.req_id)
        self.primary.on_new_request(ctx)
        return "request" if st.request_level_tiers else "chunk"

    def on_request_finished(self, ctx: RequestContext, exclude_tier_idx: int | None = None) -> None:
        st = self._state(ctx)
        self._check_exclude(exclude_tier_idx)
        self.primary.on_request_finished(ctx)
        st.is_finished = True
        self._maybe_finalize(ctx.req_id, exclude_tier_idx)

    def _maybe_finalize(self, req_id: str, exclude_tier_idx: int | None = None) -> None:
        st = self.req_state[req_id]
        if not st.is_finished or st.pending_primary_stores or st.pending_cascade_keys:
            return
        for i, tier in enumerate(self.tiers):
            if i != exclude_tier_idx:
                tier.on_request_finished(req_id)
        self.lookup_metrics.on_request_finished(req_id)
        self.load_sources.pop(req_id, None)
        del self.req_state[req_id]

    # -- the OffloadingManager calls ------------------------------------------------------------

    def lookup(self, key: OffloadKey, ctx: RequestContext, exclude_tier_idx: int | None = None) -> LookupResult:
        _check_keys("key", (key,))
        self._state(ctx)
        self._check_exclude(exclude_tier_idx)
        self._maybe_process_finished_jobs()
        found = self.primary.lookup(key, ctx)
        self.lookup_metrics.on_lookup(ctx.req_id, key, PRIMARY_LABEL, found, 0.0)  # no time passes in a call
        if found in (LookupResult.HIT, LookupResult.HIT_PENDING):
            return found
        if self.promotions_held:
            return LookupResult.MISS
        any_retry = False
        # the request's kv_load_tiers (vLLM's ReqContext.load_tier_filter; here in the context's
        # state, keyed by type): a tier it does not allow is not asked, and its lookup not counted
        load_filter = ctx.get_state(TierFilter)
        for i, tier in enumerate(self.tiers):
            if i == exclude_tier_idx:
                continue
            if load_filter is not None and not load_filter.allows(tier.declared_medium, None):
                continue
            result = tier.lookup(key, ctx.req_id)
            self.lookup_metrics.on_lookup(ctx.req_id, key, self._label(i), result, 0.0)
            if result is LookupResult.HIT:
                return LookupResult.HIT_PENDING if self._initiate_promotion(i, key, ctx) else LookupResult.MISS
            any_retry |= result is LookupResult.RETRY
        return LookupResult.RETRY if any_retry else LookupResult.MISS

    def _initiate_promotion(self, i: int, key: OffloadKey, ctx: RequestContext) -> bool:
        out = self.primary.prepare_store([key], ctx)
        if out is None:
            self.counters[M + "promotion_allocation_failures"] += 1
            return False
        sources = self.load_sources.setdefault(ctx.req_id, {})
        for k in out.keys_to_store:
            sources[k] = self.tiers[i].cache_hit_source
        entry = self.pending_loads.setdefault(i, {}).setdefault(ctx.req_id, PendingPromotion(ctx))
        entry.keys.extend(out.keys_to_store)
        entry.chunk_ids.extend(out.chunk_ids)
        return True

    def get_load_source(self, key: OffloadKey, ctx: RequestContext) -> str:
        """Where a hit on ``key`` for this request came from: "DISK"/"HOST" of the tier it was
        promoted from, else "HOST" (the primary tier)."""
        _check_keys("key", (key,))
        self._state(ctx)
        sources = self.load_sources.get(ctx.req_id)
        if sources is not None and key in sources:
            return sources[key]
        return "HOST"

    def prepare_load(self, keys: Collection[OffloadKey], ctx: RequestContext) -> list[int]:
        self._state(ctx)
        ids = self.primary.prepare_load(keys, ctx)
        self.load_pins.update(keys)
        return ids

    def complete_load(self, keys: Collection[OffloadKey], ctx: RequestContext) -> None:
        """Releases pins of ``prepare_load`` only: a cascade's pin is not the GPU's to release.
        The request may have finished meanwhile (its loads still complete)."""
        keys = _check_keys("keys", keys)
        if not isinstance(ctx, RequestContext):
            raise InvalidFieldError("ctx", ctx, "a RequestContext")
        need = Counter(keys)
        short = {k: self.load_pins[k] for k, n in need.items() if self.load_pins[k] < n}
        if short:
            raise OffloadStateError(f"keys: GPU loads hold only {short} pins of {dict(need)} released")
        self.primary.complete_load(keys, ctx)
        self.load_pins.subtract(need)
        self.load_pins = +self.load_pins

    def touch(self, keys: Collection[OffloadKey], ctx: RequestContext) -> None:
        self._state(ctx)
        self.primary.touch(keys, ctx)

    def prepare_store(self, keys: Collection[OffloadKey], ctx: RequestContext):
        keys = _check_keys("keys", keys)
        if len(set(keys)) != len(keys):
            raise InvalidFieldError("keys", keys, "distinct offload keys")
        st = self._state(ctx)
        self.processed_this_step = True
        self._process_finished_jobs()
        out = self.primary.prepare_store(keys, ctx)
        if out is None:
            return None
        if out.keys_to_store:
            st.pending_primary_stores += 1
        if st.request_level_tiers:
            # a request-level tier wants the request's whole prefix: chunks the primary tier already
            # holds are cascaded to it now (newly stored ones cascade at complete_store)
            new = set(out.keys_to_store)
            existing = [k for k in keys if k not in new]
            if existing:
                self._cascade_existing(existing, ctx, st)
        return out

    def _cascade_existing(self, keys: list[OffloadKey], ctx: RequestContext, st: RequestState) -> None:
        """Cascade ready chunks to the request-level tiers; park chunks still being written
        (HIT_PENDING): the scheduler moves past them and never offers them again, so they are
        retried at every end of step until they resolve; absent ones are dropped."""
        ready = []
        for key in keys:
            found = self.primary.lookup(key, ctx)
            if found is LookupResult.HIT:
                ready.append(key)
            elif found is LookupResult.HIT_PENDING:
                st.pending_cascade_keys.append(key)
        if not ready:
            return
        for i in st.request_level_tiers:
            if self._should_store_to_tier(self.tiers[i], len(ready)):
                self.tiers[i].submit_store(self.create_store_job(ready, ctx, i))

    def complete_store(self, keys: Collection[OffloadKey], ctx: RequestContext, success: bool = True) -> None:
        """The GPU->primary store of ``keys`` (the ``keys_to_store`` of one ``prepare_store``) ended."""
        keys = _check_keys("keys", keys)
        if not isinstance(success, bool):
            raise InvalidFieldError("success", success, "a bool")
        st = self._state(ctx)
        if st.pending_primary_stores <= 0:
            raise OffloadStateError(f"ctx: request {ctx.req_id!r} has no GPU->primary store pending")
        if success:
            state = self.primary.chunk_state()
            if any(k not in state or state[k][1] != -1 for k in keys):
                raise OffloadStateError(f"keys: {keys!r} are not all primary chunks being written")
        self.primary.complete_store(keys, ctx, success)
        if success:
            for i, tier in enumerate(self.tiers):
                if not self._should_store_to_tier(tier, len(keys)):
                    continue
                tier.submit_store(self.create_store_job(keys, ctx, i))
        st.pending_primary_stores -= 1
        self._maybe_finalize(ctx.req_id)

    def on_schedule_end(self, new_req_ids=()) -> None:
        """End of the step; ``new_req_ids``: requests scheduled for the first time in it."""
        if (isinstance(new_req_ids, (str, bytes)) or not isinstance(new_req_ids, Iterable)
                or not all(isinstance(r, str) for r in new_req_ids)):
            raise InvalidFieldError("new_req_ids", new_req_ids, "a collection of request ids")
        self._maybe_process_finished_jobs()
        for i, tier in enumerate(self.tiers):  # before the gate reopens: their lookups do not poll
            tier.serve_external_requests(self, i)
        self.processed_this_step = False
        for i, by_req in self.pending_loads.items():
            for entry in by_req.values():
                job = self._register(entry.keys, entry.chunk_ids, True, entry.ctx, i)
                self.tiers[i].submit_load(job)
        self.pending_loads.clear()
        for req_id, st in list(self.req_state.items()):
            if st.pending_cascade_keys:
                keys, st.pending_cascade_keys = st.pending_cascade_keys, []
                self._cascade_existing(keys, st.ctx, st)
                self._maybe_finalize(req_id)
        for tier in self.tiers:
            tier.on_schedule_end()
        for req_id in new_req_ids:
            if req_id in self.req_state:
                self.lookup_metrics.on_request_allocated(req_id)

    def poll_tiers(self) -> None:
        """One round of vLLM's tier-poll thread (``poll_tiers``): the tiers that tolerate off-thread
        polling are polled for finished jobs and serve their peers; the step's poll gate is held
        shut meanwhile and then put back untouched, so the step's own poll still runs."""
        polled = [i for i, t in enumerate(self.tiers) if t.tolerates_off_thread_polling]
        gate, self.processed_this_step = self.processed_this_step, True
        try:
            self._process_finished_jobs(polled)
            for i in polled:
                self.tiers[i].serve_external_requests(self, i)
        finally:
            self.processed_this_step = gate

    def has_pending_work(self) -> bool:
        return (bool(self.jobs) or any(st.pending_cascade_keys for st in self.req_state.values())
                or any(t.has_pending_work() for t in self.tiers))

    def take_events(self) -> list[tuple[tuple[OffloadKey, ...], str, bool]]:
        out = [(tuple(e.keys), "CPU", e.removed) for e in self.primary.take_events()]
        for tier in self.tiers:
            out += [(e.keys, e.medium, e.removed) for e in tier.take_events()]
        return out

    def reset_cache(self) -> None:
        """Every tier's jobs must have finished (vLLM's ``drain_jobs`` blocks until they have)."""
        busy = {i: list(t.in_flight()) for i, t in enumerate(self.tiers) if list(t.in_flight())}
        if busy:
            raise OffloadStateError(f"tiers: jobs still in flight {busy}; drain them before reset_cache")
        for tier in self.tiers:
            tier.drain_jobs()
        self._process_finished_jobs()
        assert not self.jobs
        self.pending_loads.clear()
        self.load_sources.clear()
        finished = []
        for req_id, st in self.req_state.items():
            st.pending_primary_stores = 0
            st.pending_cascade_keys.clear()
            if st.is_finished:
                for tier in self.tiers:
                    tier.on_request_finished(req_id)
                self.lookup_metrics.on_request_finished(req_id)
                finished.append(req_id)
        self.primary.reset_cache()
        self.load_pins.clear()
        for req_id in finished:
            del self.req_state[req_id]
        self.processed_this_step = False
        for tier in self.tiers:
            if tier.bp_detector is not None:
                tier.bp_detector.reset()
        self.promotions_held = bool(self.tiers)

    def on_reset_flushed(self) -> None:
        self.promotions_held = False

    # -- metrics ------------------------------------------------------------------------------

    def take_stats(self) -> dict[str, float]:
        """The modelled part of vLLM's ``get_stats().reduce()`` (tiering counters and gauges)."""
        out: dict[str, float] = {}
        n = self.primary.num_chunks
        for i in range(len(self.tiers)):
            label = self._label(i)
            jobs = [(j, t) for j, t in self.jobs.values() if t == i]
            prom = [j for j, _ in jobs if j.is_promotion]
            casc = [j for j, _ in jobs if not j.is_promotion]
            out[f"{M}primary_write_usage_perc:{label}"] = sum(len(j.chunk_ids) for j in prom) / n
            out[f"{M}primary_read_usage_perc:{label}"] = sum(len(j.chunk_ids) for j in casc) / n
            out[f"{M}active_promotion_jobs:{label}"] = len(prom)
            out[f"{M}active_cascade_jobs:{label}"] = len(casc)
        for i, tier in enumerate(self.tiers):
            det = tier.bp_detector
            if det is None:
                continue
            label = self._label(i)
            out[f"{M}backpressure_store_latency_ema:{label}"] = det.ema
            stores, blocks = det.policy.pop_stores_dropped()
            if stores:
                self.counters[f"{M}backpressure_stores_dropped:{label}"] += stores
            if blocks:
                self.counters[f"{M}backpressure_blocks_dropped:{label}"] += blocks
        out.update(self.counters)
        out.update(self.lookup_metrics.take())
        for tier in self.tiers:
            out.update(tier.take_stats())
        self.counters = Counter()
        return out

    # -- invariants ---------------------------------------------------------------------------

    def check_invariants(self) -> None:
        self.primary.check_invariants()
        for tier in self.tiers:
            tier.check_invariants()
        state = self.primary.chunk_state()
        cascade_pins: Counter = Counter()
        promoting: Counter = Counter()
        for job_id, (job, i) in self.jobs.items():
            assert job_id in self.tiers[i].known_jobs(), f"T1: job {job_id} is unknown to its tier #{i}"
            for k in job.keys:
                (promoting if job.is_promotion else cascade_pins)[k] += 1
        for by_req in self.pending_loads.values():
            for entry in by_req.values():
                promoting.update(entry.keys)
        for k, n in promoting.items():
            assert n == 1, f"T1: {k!r} is being promoted {n} times at once"
            assert k in state and state[k][1] == -1, f"T1: {k!r} is promoted into a slot that is not reserved"
        for k in set(cascade_pins) | set(self.load_pins):
            pins = cascade_pins[k] + self.load_pins[k]
            assert k in state and state[k][1] == pins, (
                f"T1: {k!r} has {cascade_pins[k]} cascades and {self.load_pins[k]} GPU loads "
                f"but ref count {state.get(k)}")
        for k, (_, ref) in state.items():
            assert ref <= 0 or cascade_pins[k] + self.load_pins[k] == ref, f"T1: {k!r} pinned {ref} times by nobody"
        for req_id, st in self.req_state.items():
            assert st.pending_primary_stores >= 0, f"T1: request {req_id}: {st.pending_primary_stores} pending stores"
            assert st.ctx.req_id == req_id, f"T1: request {req_id}'s state carries the context of {st.ctx.req_id}"
        assert all(j < self.job_counter for j in self.jobs), "T1: a job id from the future"
