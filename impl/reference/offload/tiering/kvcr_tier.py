"""vLLM's KVCR secondary tier (``tiering/kvcr/manager.py``) over kvcr's local-DRAM backend.

What the tier holds: up to ``slots`` chunks in its own DRAM, each FILLING (a copy from the primary
tier under way) or READY. Rules, as kvcr 0.1.1 applies them and vLLM's adapter reports them:

* **Lookup.** READY: HIT; FILLING: RETRY (kvcr's FETCHING); else MISS (no peer hint names it).
* **Store** (``deposit``). Per key, in the job's order: READY already: success, recency untouched;
  FILLING: the key's result waits for that fill; else a slot: a free one, or the least recently
  used READY, unclaimed chunk is evicted (never one of the job's own keys; FIFO: the first made
  evictable); none evictable: the key fails. Evictions are announced (one "removed" event for the
  job, before the copy). The job's new keys are copied in one transfer.
* **Load** (``deliver``). Keys not resident fail at once (kvcr asks a remote peer, and none is
  hinted); READY keys are claimed (not evictable) and copied in one transfer; FILLING keys wait for
  their fill. A finished copy records an access (recency) and releases the claim. A job succeeds
  only if every key did; else it names the keys that arrived.
* **When.** A copy runs on kvcr's progress thread and ends before the next poll (the harness's
  guarantee, see kvref.impl.vllm.tiering_kvcr); its effects land when the tiering manager next
  polls the tier (``get_finished_jobs``): the fill's keys become READY (one "stored" event, one
  recency stamp for them all), results complete in that order. A store of keys that need no copy
  completes at the next poll.
* **Stats.** kvcr's state gauges (records, open operations, slots free/used/evictable, completions
  not yet polled) and transfer counters (blocks, bytes per copy kind), and how many operation
  durations it recorded per scope and result (their values are wall-clock and not modelled).

``has_pending_work`` is always true (vLLM's adapter keeps the scheduler polling for control
messages). Framework pins (a peer engine asking this one for blocks) and G3/remote paths are not
modelled (docs/differences.md).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from kvref.spec.errors import InvalidFieldError, check_int

from ..keys import LookupResult, OffloadKey, OffloadStateError
from .tier_base import MEDIUM_CPU, JobResult, SecondaryTier, TierEvent, TransferJob

M = "vllm:kvcr_"


@dataclass
class _Residency:
    state: str  # "filling" | "ready"
    data: bytes | None = None
    claims: int = 0
    last_access: int = 0


@dataclass
class _Op:
    job: TransferJob
    keys: tuple[OffloadKey, ...]
    results: dict[OffloadKey, bool] = field(default_factory=dict)
    dep_keys: frozenset = frozenset()  # the keys kvcr's operation names (a load: the resident ones)


@dataclass
class _Copy:
    op: _Op
    keys: tuple[OffloadKey, ...]
    success: bool


class KVCRTier(SecondaryTier):
    medium = MEDIUM_CPU  # of its inventory events (local DRAM)
    declared_medium = None  # vLLM's KVCR tier class declares no medium: every load tier filter allows it

    @property
    def cache_hit_source(self) -> str:
        """vLLM's KVCR tier declares no medium, so its hits are EXTERNAL_UNSPECIFIED."""
        return "EXTERNAL_UNSPECIFIED"

    def __init__(self, tier_type: str, primary, slots: int, policy: str = "lru", enable_events: bool = True) -> None:
        super().__init__(tier_type, primary, None)
        check_int("slots", slots, minimum=1)
        if policy not in ("lru", "fifo"):
            raise InvalidFieldError("policy", policy, "'lru' or 'fifo'")
        self.slots = slots
        self.policy = policy
        self.res: dict[OffloadKey, _Residency] = {}
        self.evictable: dict[OffloadKey, tuple[float, int]] = {}  # key -> (score, sequence)
        self._seq = 0
        self._now = 0
        self.deps: Counter = Counter()  # key -> open operations naming it (kvcr's block records)
        self.open_ops: list[_Op] = []
        self.copies: list[_Copy] = []  # finished on the progress thread, not yet polled
        self.completed: list[tuple[_Op, dict]] = []  # kvcr's completion queue
        self.finished: list[JobResult] = []  # drained by drain_jobs, reported by the next poll
        self.events: list[TierEvent] | None = [] if enable_events else None
        self.stats: Counter = Counter()
        self.fail_copies = 0  # the next copies this many fail (a NIXL transfer error)
        self.counts: Counter = Counter()  # paths taken (for the tests' reach assertions)
        self.pin_requests: list[tuple[OffloadKey, ...]] = []  # a peer's reads kvcr asked us to pin
        self.pins: list[int] = []  # store jobs pinning what a peer reads, released at the next poll
        self._sources = 0

    # -- helpers ------------------------------------------------------------------------------

    def _tick(self) -> int:
        self._now += 1
        return self._now

    def _make_evictable(self, key: OffloadKey) -> None:
        r = self.res[key]
        if r.state != "ready" or r.claims:
            return
        score = float(r.last_access) if self.policy == "lru" else 0.0
        prev = self.evictable.get(key)
        if prev is not None and prev[0] == score:
            return
        self.evictable[key] = (score, self._seq)
        self._seq += 1

    def _event(self, keys, removed: bool) -> None:
        if self.events is not None and keys:
            self.events.append(TierEvent(tuple(keys), self.medium, removed))

    def _open(self, op: _Op, keys) -> None:
        op.dep_keys = frozenset(keys)
        self.open_ops.append(op)
        self.deps.update(op.dep_keys)

    def _maybe_complete(self, op: _Op) -> None:
        if op in self.open_ops and len(op.results) == len(set(op.keys)):
            self.open_ops.remove(op)
            self.deps.subtract(op.dep_keys)
            self.deps = +self.deps
            self.completed.append((op, dict(op.results)))

    def _copy(self, op: _Op, keys: list[OffloadKey]) -> None:
        if not keys:
            return
        self.stats["copies_started"] += 1
        ok = self.fail_copies <= 0
        self.fail_copies = max(0, self.fail_copies - 1)
        if op.job.is_promotion:  # the bytes move on the progress thread now (an error is reported after)
            for key in keys:
                self.primary.write(op.job.chunk_ids[op.keys.index(key)], self.res[key].data)
        self.copies.append(_Copy(op, tuple(keys), ok))

    # -- the SecondaryTierManager calls ---------------------------------------------------------

    def lookup(self, key: OffloadKey, req_id: str) -> LookupResult:
        r = self.res.get(key)
        if r is None:
            return LookupResult.MISS
        self.counts["hits" if r.state == "ready" else "retries"] += 1
        return LookupResult.HIT if r.state == "ready" else LookupResult.RETRY

    def submit_store(self, job: TransferJob) -> None:
        op = _Op(job, tuple(job.keys))
        if not op.keys:
            self.finished.append(JobResult(job.job_id, True))
            return
        self._open(op, op.keys)
        protected = set(op.keys)
        copy_keys, evicted = [], []
        for key, cid in zip(job.keys, job.chunk_ids):
            r = self.res.get(key)
            if r is not None:
                if r.state == "ready":
                    op.results[key] = True
                continue  # filling: its result waits for the fill
            if len(self.res) >= self.slots:
                victims = sorted((v, k) for k, v in self.evictable.items() if k not in protected)
                if not victims:
                    op.results[key] = False
                    self.counts["stores_refused"] += 1
                    continue
                victim = victims[0][1]
                del self.evictable[victim]
                del self.res[victim]
                evicted.append(victim)
                self.counts["evictions"] += 1
            self.res[key] = _Residency("filling", self.primary.read(cid))
            copy_keys.append(key)
        self._event(evicted, True)
        self._maybe_complete(op)
        self._copy(op, copy_keys)

    def submit_load(self, job: TransferJob) -> None:
        op = _Op(job, tuple(job.keys))
        if not op.keys:
            self.finished.append(JobResult(job.job_id, True))
            return
        local = [k for k in op.keys if k in self.res]
        remote = [k for k in op.keys if k not in self.res]
        if remote:
            self.stats["duration:remote_deliver:failed"] += 1
            self.counts["loads_of_absent_keys"] += 1
        if not local:
            self.completed.append((op, {k: False for k in op.keys}))
            return
        self._open(op, local)
        for k in remote:
            op.results[k] = False
        self._start_deliveries(op, local)

    def _start_deliveries(self, op: _Op, keys) -> None:
        copy_keys = []
        for key in keys:
            if key in op.results:
                continue
            r = self.res.get(key)
            if r is None:
                op.results[key] = False
            elif r.state == "ready":
                r.claims += 1
                self.evictable.pop(key, None)
                copy_keys.append(key)
        self._copy(op, copy_keys)
        self._maybe_complete(op)

    def _poll(self) -> list[JobResult]:
        copies, self.copies = self.copies, []
        for c in copies:
            kind = "local_fill" if not c.op.job.is_promotion else "local_deliver"
            self.stats[f"duration:{kind}:{'success' if c.success else 'failed'}"] += 1
            if c.success:
                self.stats[f"blocks:{kind}"] += len(c.keys)
                self.stats[f"bytes:{kind}"] += len(c.keys) * self.block_size_bytes
            if c.op.job.is_promotion:
                self._finish_delivery(c)
            else:
                self._finish_fill(c)
        out = []
        for op, entries in self.completed:
            ok = all(entries.values())
            self.counts[f"{'loads' if op.job.is_promotion else 'stores'}_{'ok' if ok else 'failed'}"] += 1
            good = {k for k, v in entries.items() if v} if op.job.is_promotion else None
            out.append(JobResult(op.job.job_id, ok, None if ok else good))
        self.completed = []
        out += [JobResult(job_id, True) for job_id in self.pins]
        self.pins = []
        return out

    def _finish_fill(self, c: _Copy) -> None:
        """kvcr's ``_apply_fill_result``: every open operation naming a filled key gets its result
        (a store: the fill's outcome; a load: its delivery starts, or it fails)."""
        now = self._tick()
        committed = []
        affected: list[_Op] = []
        waiting: dict[int, list[OffloadKey]] = {}
        for key in c.keys:
            r = self.res[key]
            if c.success:
                r.state, r.last_access = "ready", now
                self._make_evictable(key)
                committed.append(key)
            else:
                del self.res[key]
            for op in self.open_ops:
                if key not in op.dep_keys or key in op.results:
                    continue
                if op not in affected:
                    affected.append(op)
                if op.job.is_promotion and c.success:
                    waiting.setdefault(id(op), []).append(key)
                else:
                    op.results[key] = c.success
        self._event(committed, False)
        for op in affected:
            if not op.job.is_promotion:
                self._maybe_complete(op)
        for op in affected:
            if op.job.is_promotion:
                self._start_deliveries(op, waiting.get(id(op), ()))

    def _finish_delivery(self, c: _Copy) -> None:
        for key in c.keys:
            r = self.res[key]
            if c.success:
                r.last_access = self._tick()
            r.claims -= 1
            if r.claims == 0:
                self._make_evictable(key)
            c.op.results[key] = c.success
        self._maybe_complete(c.op)

    def request_pin(self, keys) -> None:
        """kvcr asks the framework to pin ``keys`` for a peer's read (its ``request_pin`` binding)."""
        self.pin_requests.append(tuple(keys))

    def serve_external_requests(self, parent, tier_idx: int) -> None:
        """vLLM's ``_FrameworkPinAdapter``: each pin request opens ``kvcr-source:<n>`` (skipping
        this tier), looks every key up, pins the HITs with one ``create_store_job`` and finishes
        the request. kvcr then takes the pin result (the peer's read is done: the pin is released
        at the next poll and its job reported finished after the tier's own results)."""
        from ..keys import RequestContext

        pending, self.pin_requests = self.pin_requests, []
        for keys in pending:
            ctx = RequestContext(f"kvcr-source:{self._sources}")
            self._sources += 1
            parent.on_new_request(ctx, exclude_tier_idx=tier_idx)
            try:
                hits = [k for k in keys if parent.lookup(k, ctx, exclude_tier_idx=tier_idx) is LookupResult.HIT]
                if hits:
                    self.pins.append(parent.create_store_job(hits, ctx, tier_idx).job_id)
                    self.counts["pins"] += 1
            except OffloadStateError:
                # a HIT evicted by a later key's promotion: no pin (vLLM logs it; its prepare_read
                # leaves the keys before the evicted one pinned, kvref's pins nothing: see
                # docs/differences.md, the traces keep out of this case)
                self.counts["pin_failures"] += 1
            finally:
                parent.on_request_finished(ctx, exclude_tier_idx=tier_idx)

    def get_finished_jobs(self) -> list[JobResult]:
        out, self.finished = self.finished, []
        return out + self._poll()

    def drain_jobs(self) -> None:
        while self.open_ops or self.copies or self.completed or self.pins:
            self.finished.extend(self._poll())

    def has_pending_work(self) -> bool:
        return True

    def take_events(self) -> list[TierEvent]:
        if self.events is None:
            return []
        out, self.events = self.events, []
        return out

    def stored_keys(self) -> set[OffloadKey]:
        return {k for k, r in self.res.items() if r.state == "ready"}

    def residency(self) -> dict[OffloadKey, tuple[str, int]]:
        return {k: (r.state, r.claims) for k, r in self.res.items()}

    def known_jobs(self) -> set[int]:
        return ({op.job.job_id for op in self.open_ops} | {op.job.job_id for op, _ in self.completed}
                | {c.op.job.job_id for c in self.copies} | {r.job_id for r in self.finished} | set(self.pins))

    def take_stats(self) -> dict[str, float]:
        """kvcr's telemetry as vLLM reports it (``vllm:kvcr_*``), duration histograms by count."""
        out: dict[str, float] = {}
        for name, n in self.stats.items():
            kind, _, rest = name.partition(":")
            if kind == "duration":
                scope, _, result = rest.partition(":")
                out[f"{M}duration_seconds:{(scope, result)}_count"] = n
            elif kind in ("blocks", "bytes"):
                out[f"{M}transfer_{kind}:{(rest,)}"] = n
        self.stats = Counter()
        records = set(self.res) | set(self.deps)
        ready_free = sum(1 for r in self.res.values() if r.state == "ready" and not r.claims)
        assert ready_free == len(self.evictable)
        state = {"block_records": len(records), "in_flight_ops": len(self.open_ops), "framework_pins": 0,
                 "pinned_keys": 0, "connected_remotes": 0, "completed": len(self.completed),
                 "local_g2_total_slots": self.slots, "local_g2_free_slots": self.slots - len(self.res),
                 "local_g2_allocated_slots": len(self.res), "local_g2_evictable_slots": len(self.evictable)}
        for name, n in state.items():
            out[f"{M}state:{(name,)}"] = n
        return out

    def check_invariants(self) -> None:
        super().check_invariants()
        assert len(self.res) <= self.slots, f"K1: {len(self.res)} chunks held in {self.slots} slots"
        for k, r in self.res.items():
            assert r.claims >= 0, f"K1: {k!r} has {r.claims} claims"
            assert (k in self.evictable) == (r.state == "ready" and r.claims == 0), (
                f"K1: {k!r} is {'' if k in self.evictable else 'not '}evictable in state {r.state} with {r.claims} claims")
        assert set(self.evictable) <= set(self.res), "K1: an evictable key the tier does not hold"
