"""Multi-tier offloading: kvref's reference vs vLLM 0.33.0's ``TieringOffloadingManager``, in lock-step.

:class:`TieringWorld` drives both with the same operation and compares, after every operation,
everything either can observe: the answer (lookup results incl. RETRY/HIT_PENDING, prepare_store's
keys/chunks/evictions, prepare_load's chunks), the primary tier's chunks with ref counts, every job
in flight (tier, direction, keys, primary chunks, request), the promotions queued for the end of
the step, per-request state, which keys each secondary tier holds (fs: files on disk), each fs
tier's async lookup probes (phase, verdict, requests), back-pressure detector state, KV events,
the tiering metrics, ``has_pending_work``, and the whole primary byte buffer. Content oracle: a
file on disk holds the bytes the GPU stored for its key, and a chunk promoted from fs holds them
again in the primary tier.

Operations (:func:`random_trace`): new/finish request, lookup, prepare_store + complete_store
(success or failure, late, out of order), prepare_load + complete_load, touch, end of step,
an fs job finishing (or failing with an I/O error) in any order, the lookup worker answering a
batch, a file disappearing, the clock advancing (back-pressure), reset_cache + on_reset_flushed,
a NIXL call of the object-store tier failing (a refused submission, a state query or handle release
that raises: which call takes the fault is compared too). A run with an obj tier tries each such
fault once more at its end and shuts down with object transfers still in flight: the agent must
then hold no registration, descriptor list or transfer handle (but those a failed release leaked).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field

from kvref.impl.reference.offload.keys import LookupResult, RequestContext
from kvref.impl.reference.offload.tier_filter import parse_tier_filter
from kvref.impl.reference.offload.tiering.backpressure import POLICIES, EMABackpressureDetector, default_config
from kvref.impl.reference.offload.tiering.clock import VirtualClock
from kvref.impl.reference.offload.tiering.example_tier import ExampleTier, PolledTier
from kvref.impl.reference.offload.tiering.fs_tier import FileSystemTier
from kvref.impl.reference.offload.tiering.kvcr_tier import KVCRTier
from kvref.impl.reference.offload.tiering.manager import TieringOffloadingManager
from kvref.impl.reference.offload.tiering.obj_tier import FAULTS as OBJ_FAULTS
from kvref.impl.reference.offload.tiering.obj_tier import ObjectStoreTier
from kvref.impl.reference.offload.tiering.primary_tier import CPUPrimaryTier
from kvref.impl.reference.offload.tiering.tier_base import TierShutdownError
from kvref.spec.errors import InvalidFieldError

ROW_BYTES = 4096
#: "RequestLevelTier": vLLM's example tier asking for request-level offloading, loaded as an
#: out-of-tree tier (kvref.impl.vllm.tiering_tiers)
REQUEST_LEVEL = "RequestLevelTier"
#: "PolledTier": vLLM's example tier serving a peer from the tier-poll thread (kvref.impl.vllm.tiering_tiers)
POLLED = "PolledTier"
TIER_LAYOUTS = (("fs",), ("fs", "example"), ("example", "fs"), ("fs", "fs"), ("fs", REQUEST_LEVEL),
                (REQUEST_LEVEL, "fs"), ("obj",), ("obj", "fs"), ("kvcr",), ("kvcr", "fs"), ("fs", "kvcr"),
                (POLLED, "fs"), ("fs", POLLED), (REQUEST_LEVEL, POLLED))
#: every run of this many traces or more draws a layout with each of these tiers
MUST_DRAW = ("kvcr", POLLED, "obj")
#: tiers whose jobs and lookups run on threads the trace drives (file system, object store)
ASYNC_TIERS = ("fs", "obj")
MAX_JOBS_PER_TIER = 40  # below the 48 pool threads a gated vLLM fs tier has
#: kv_load_tiers values a request may carry (None: none given); most requests carry none
LOAD_TIERS = (None, None, None, None, None, [], [{"medium": "cpu"}], [{"medium": "storage"}],
              [{"locality": "remote"}], [{"medium": "storage", "locality": "local"}], "all")
#: tiers a configuration with back-pressure gives a detector: the storage tiers, and the
#: request-level tier (its cascades of chunks already in the primary tier are then gated too)
BACKPRESSURED = ASYNC_TIERS + (REQUEST_LEVEL,)


class TieringDivergence(AssertionError):
    """kvref's reference and vLLM's tiering manager disagree (or an oracle failed)."""


@dataclass
class TieringConfig:
    num_chunks: int
    tiers: tuple[str, ...]
    cache_policy: str = "lru"
    backpressure: str | None = None  # None or a policy class name
    warmup: int = 2
    num_keys: int = 8
    report_scheduled: bool = True  # end of step names newly scheduled requests (lookup counting stops)
    kvcr_slots: int = 2  # local-DRAM slots of a KVCR tier
    kvcr_policy: str = "lru"
    #: the out-of-tree tiers' (request-level, polled) shutdown raises; None: in configurations with
    #: an odd number of primary chunks (so it takes nothing from the trace's random stream)
    fail_shutdown: bool | None = None

    def fails_shutdown(self) -> bool:
        return self.num_chunks % 2 == 1 if self.fail_shutdown is None else self.fail_shutdown

    @staticmethod
    def random(rng: random.Random) -> "TieringConfig":
        return TieringConfig(num_chunks=rng.randint(2, 5), tiers=rng.choice(TIER_LAYOUTS),
                             cache_policy=rng.choice(("lru", "lru", "arc")),
                             backpressure=rng.choice((None, "ThrottledDropPolicy", "DropStorePolicy")),
                             warmup=rng.randint(1, 3), num_keys=rng.randint(6, 10),
                             report_scheduled=rng.random() < 0.5,
                             # mostly more slots than primary chunks: what the primary tier evicts
                             # is still there to come back; sometimes fewer (stores refused, evictions)
                             kvcr_slots=rng.choice((1, 2, 6, 7, 8, 10)),
                             kvcr_policy=rng.choice(("lru", "lru", "fifo")))

    def vllm_tier_configs(self) -> list[dict]:
        out = []
        for t in self.tiers:
            cfg: dict = {"type": t}
            if t == "kvcr":
                from kvref.impl.vllm.tiering_kvcr import kvcr_tier_config

                cfg = kvcr_tier_config(self.kvcr_slots, self.kvcr_policy)
            if t in (REQUEST_LEVEL, POLLED):
                cfg["module_path"] = "kvref.impl.vllm.tiering_tiers"
            if t in BACKPRESSURED and self.backpressure:
                cfg["backpressure"] = {"backpressure_cls": "EMABackpressureDetector", "policy_cls": self.backpressure,
                                       "warmup_completions": self.warmup}
            out.append(cfg)
        return out


def key_of(i: int) -> bytes:
    return hashlib.sha256(b"kvref-tiering-%d" % i).digest()[:16] + b"\0\0\0\0"


def content_of(key: bytes) -> bytes:
    """What the GPU stores for ``key``: a row-sized pattern only this key has."""
    return (hashlib.sha256(key).digest() * (ROW_BYTES // 32 + 1))[:ROW_BYTES]


@dataclass
class _Outstanding:
    stores: list[tuple[str, tuple, tuple]] = field(default_factory=list)  # (req, keys, chunk ids)
    loads: list[tuple[str, tuple]] = field(default_factory=list)


class TieringWorld:
    def __init__(self, cfg: TieringConfig, clock: VirtualClock) -> None:
        """``clock`` must be the one vLLM's modules read (:func:`kvref.impl.vllm.tiering.virtual_time`)."""
        from kvref.impl.vllm.tiering import build_vllm_tiering

        self.cfg = cfg
        self.clock = clock
        self.keys = [key_of(i) for i in range(cfg.num_keys)]
        self.primary = CPUPrimaryTier(cfg.num_chunks, ROW_BYTES, cfg.cache_policy, enable_events=True)
        tiers = []
        for t in cfg.tiers:
            det = None
            if t in BACKPRESSURED and cfg.backpressure:
                det = EMABackpressureDetector(**default_config(t), warmup_completions=cfg.warmup,
                                              policy=POLICIES[cfg.backpressure](), clock=self.clock.monotonic)
            if t == "kvcr":
                tiers.append(KVCRTier(t, self.primary.buffer, cfg.kvcr_slots, cfg.kvcr_policy))
            elif t in ASYNC_TIERS:
                cls = ObjectStoreTier if t == "obj" else FileSystemTier
                tiers.append(cls(t, self.primary.buffer, self.clock.monotonic, det, enable_events=True))
            elif t == POLLED:
                tiers.append(PolledTier(t, self.primary.buffer, det))
            else:
                tiers.append(ExampleTier(t, self.primary.buffer, det, "request" if t == REQUEST_LEVEL else "chunk"))
        self.ref = TieringOffloadingManager(self.primary, tiers, self.clock.monotonic)
        self.vllm = build_vllm_tiering(cfg.num_chunks, cfg.vllm_tier_configs(), self.clock, cfg.cache_policy)
        self.ctx: dict[str, RequestContext] = {}
        self.live: list[str] = []  # requests not finished
        self.next_req = 0
        self.out = _Outstanding()
        self.metrics_seen: set[str] = set()
        self.unscheduled: list[str] = []  # requests the next end of step reports as newly scheduled
        self.closed = False
        #: which successful fs stores race another writer's rename (EEXIST): its own generator,
        #: seeded by the configuration, so the trace's random stream (and every draw) stays as it was
        self.race_rng = random.Random(f"rename-race-{cfg!r}")
        if cfg.fails_shutdown():  # a third-party tier whose teardown fails
            for i, t in enumerate(cfg.tiers):
                if t in (REQUEST_LEVEL, POLLED):
                    self.ref.tiers[i].fail_shutdown = True
                    self.vllm.tiers[i].fail_shutdown = True
        self.stats = {"ops": 0, "promotions": 0, "fs_promotions_checked": 0, "retries": 0, "io_errors": 0,
                      "evictions": 0, "stores_refused": 0, "fs_promotions": 0,
                      "partial_promotions": 0, "request_level_cascades": 0, "parked_cascade_steps": 0,
                      "kvcr_copy_failures": 0, "poll_rounds": 0, "peer_requests": 0, "peer_pins": 0,
                      "obj_faults_armed": 0, "obj_abandoned": 0, "failed_shutdowns": 0, "fs_short_writes": 0,
                      "obj_shutdown_faults": 0, "load_tier_filters": 0,
                      "fs_rename_races": 0}

    # -- helpers ------------------------------------------------------------------------------

    def _both(self, what: str, ref_call, vllm_call):
        errs = []
        try:
            r = ref_call()
        except Exception as exc:  # noqa: BLE001 - compared below
            r, errs = None, [f"reference: {type(exc).__name__}: {exc}"]
        try:
            v = vllm_call()
        except Exception as exc:  # noqa: BLE001
            v = None
            errs.append(f"vLLM: {type(exc).__name__}: {exc}")
        if errs:
            raise TieringDivergence(f"{what}: " + "; ".join(errs))
        return r, v

    def _vctx(self, rid):
        return self.vllm.req_context(rid)

    def fs_tiers(self) -> list[int]:
        return [i for i, t in enumerate(self.cfg.tiers) if t in ASYNC_TIERS]

    # -- operations ---------------------------------------------------------------------------

    def apply(self, op: tuple) -> None:
        name, args = op[0], op[1:]
        getattr(self, "op_" + name)(*args)
        self.stats["ops"] += 1
        self.compare(op)

    def op_new_request(self) -> None:
        rid = f"r{self.next_req}"
        # the request's kv_load_tiers, drawn from its number and the config (not the trace's
        # random stream): which tiers may serve its loads
        raw = LOAD_TIERS[(7 * self.next_req + self.cfg.num_keys) % len(LOAD_TIERS)]
        self.next_req += 1
        self.ctx[rid] = RequestContext(rid)
        if raw is not None:
            flt = parse_tier_filter(raw)
            self.ctx[rid].set_state(flt)
            self.vllm.set_load_tier_filter(rid, flt.matchers, flt.everything)
            self.stats["load_tier_filters"] += 1
        self.live.append(rid)
        if self.cfg.report_scheduled:
            self.unscheduled.append(rid)
        self._both("on_new_request", lambda: self.ref.on_new_request(self.ctx[rid]),
                   lambda: self.vllm.manager.on_new_request(self._vctx(rid)))

    def op_finish_request(self, pick: int) -> None:
        if not self.live:
            return
        rid = self.live.pop(pick % len(self.live))
        self._both("on_request_finished", lambda: self.ref.on_request_finished(self.ctx[rid]),
                   lambda: self.vllm.manager.on_request_finished(self._vctx(rid)))

    def _req(self, pick: int) -> str | None:
        return self.live[pick % len(self.live)] if self.live else None

    def op_lookup(self, pick: int, k: int) -> None:
        rid = self._req(pick)
        if rid is None:
            return
        key = self.keys[k % len(self.keys)]
        r, v = self._both("lookup", lambda: self.ref.lookup(key, self.ctx[rid]),
                          lambda: self.vllm.manager.lookup(key, self._vctx(rid)))
        if r.name != v.name:
            raise TieringDivergence(f"lookup({key.hex()[:8]}, {rid}): reference {r.name}, vLLM {v.name}")
        self.stats["retries"] += r is LookupResult.RETRY
        self.stats["promotions"] += r is LookupResult.HIT_PENDING

    def op_prepare_store(self, pick: int, ks: tuple) -> None:
        rid = self._req(pick)
        if rid is None:
            return
        keys = list(dict.fromkeys(self.keys[k % len(self.keys)] for k in ks))
        jobs_before = self.ref.job_counter
        r, v = self._both("prepare_store", lambda: self.ref.prepare_store(keys, self.ctx[rid]),
                          lambda: self.vllm.manager.prepare_store(keys, self._vctx(rid)))
        self.stats["request_level_cascades"] += self.ref.job_counter - jobs_before
        rr = None if r is None else (list(r.keys_to_store), list(r.chunk_ids), list(r.evicted_keys))
        vv = None if v is None else ([bytes(k) for k in v.keys_to_store], [int(c) for c in v.store_spec.chunk_ids],
                                     [bytes(k) for k in v.evicted_keys])
        if rr != vv:
            raise TieringDivergence(f"prepare_store({rid}): reference {rr}, vLLM {vv}")
        self.stats["stores_refused"] += r is None
        self.stats["evictions"] += len(r.evicted_keys) if r is not None else 0
        if r is not None and r.keys_to_store:
            self.out.stores.append((rid, tuple(r.keys_to_store), tuple(r.chunk_ids)))

    def op_complete_store(self, pick: int, success: bool) -> None:
        if not self.out.stores:
            return
        rid, keys, cids = self.out.stores.pop(pick % len(self.out.stores))
        if success:
            for key, cid in zip(keys, cids):
                self.primary.buffer.write(cid, content_of(key))
                self.vllm.write_chunk(cid, content_of(key))
        self._both("complete_store", lambda: self.ref.complete_store(list(keys), self.ctx[rid], success),
                   lambda: self.vllm.manager.complete_store(list(keys), self._vctx(rid), success))

    def op_prepare_load(self, pick: int, ks: tuple) -> None:
        rid = self._req(pick)
        if rid is None:
            return
        state = self.primary.chunk_state()
        keys = [self.keys[k % len(self.keys)] for k in ks]
        keys = [k for k in dict.fromkeys(keys) if k in state and state[k][1] >= 0]
        if not keys:
            return
        r, v = self._both("prepare_load", lambda: self.ref.prepare_load(keys, self.ctx[rid]),
                          lambda: self.vllm.manager.prepare_load(keys, self._vctx(rid)))
        if list(r) != [int(c) for c in v.chunk_ids]:
            raise TieringDivergence(f"prepare_load({rid}): reference {list(r)}, vLLM {list(v.chunk_ids)}")
        for key, cid in zip(keys, r):  # a chunk promoted from disk holds the bytes stored for its key
            if (self.ref.get_load_source(key, self.ctx[rid]) == "DISK"
                    and self.primary.buffer.read(cid) != content_of(key)):
                raise TieringDivergence(f"prepare_load({rid}): chunk {cid} promoted from disk for "
                                        f"{key.hex()[:8]} does not hold the bytes stored for it")
        self.out.loads.append((rid, tuple(keys)))

    def op_complete_load(self, pick: int) -> None:
        if not self.out.loads:
            return
        rid, keys = self.out.loads.pop(pick % len(self.out.loads))
        self._both("complete_load", lambda: self.ref.complete_load(list(keys), self.ctx[rid]),
                   lambda: self.vllm.manager.complete_load(list(keys), self._vctx(rid)))

    def op_touch(self, pick: int, ks: tuple) -> None:
        rid = self._req(pick)
        if rid is None:
            return
        keys = list(dict.fromkeys(self.keys[k % len(self.keys)] for k in ks))
        self._both("touch", lambda: self.ref.touch(keys, self.ctx[rid]),
                   lambda: self.vllm.manager.touch(keys, self._vctx(rid)))

    def op_schedule_end(self) -> None:
        from kvref.impl.vllm.tiering import schedule_end_context

        self.stats["fs_promotions"] += sum(len(by) for t, by in self.ref.pending_loads.items()
                                           if self.cfg.tiers[t] in ASYNC_TIERS)
        new, self.unscheduled = [r for r in self.unscheduled if r in self.live], []
        self._both("on_schedule_end", lambda: self.ref.on_schedule_end(new),
                   lambda: self.vllm.manager.on_schedule_end(schedule_end_context(new)))

    def op_finish_job(self, t: int, pick: int, io_error: bool) -> None:
        fs = self.fs_tiers()
        if not fs:
            return
        i = fs[t % len(fs)]
        jobs = self.ref.tiers[i].in_flight()
        if not jobs:
            return
        job = jobs[pick % len(jobs)]
        self.stats["io_errors"] += io_error
        if self.ref.jobs[job][0].is_promotion and not io_error:
            self.stats["fs_promotions_checked"] += 1
        # a successful store on an fs tier: about one in four has its renames meet EEXIST after
        # another writer published the same blocks (vLLM's _store_block counts them stored)
        race = (not io_error and self.cfg.tiers[i] == "fs" and not self.ref.jobs[job][0].is_promotion
                and self.race_rng.random() < 0.25)
        race_kw = {"rename_race": True} if race else {}  # the obj tier's finish_job takes none
        res, _ = self._both("finish_job", lambda: self.ref.tiers[i].finish_job(job, io_error, **race_kw),
                            lambda: self.vllm.finish_job(i, job, io_error, **race_kw))
        gates = self.vllm.job_gates.get(i)
        if gates is not None:
            self.stats["fs_short_writes"] = sum(g.short_write_failures for g in self.vllm.job_gates.values())
        if race:
            ref_races = sum(t.rename_races for t in self.ref.tiers if type(t) is FileSystemTier)
            vllm_races = sum(g.rename_races for g in self.vllm.job_gates.values())
            if ref_races != vllm_races:
                raise TieringDivergence(f"finish_job {job}: blocks whose rename met EEXIST: reference "
                                        f"{ref_races}, vLLM {vllm_races}")
            self.stats["fs_rename_races"] = ref_races
        self.stats["partial_promotions"] += bool(not res.success and res.successful_keys)

    def op_lookup_worker(self, t: int) -> None:
        fs = self.fs_tiers()
        if not fs:
            return
        i = fs[t % len(fs)]
        r, v = self._both("lookup worker", lambda: self.ref.tiers[i].run_lookup_worker(),
                          lambda: self.vllm.run_lookup_worker(i))
        if r != v:
            raise TieringDivergence(f"lookup worker of tier #{i}: reference had a batch {r}, vLLM {v}")

    def op_settle(self) -> None:
        """End the step and let every fs lookup worker answer: the next lookups see verdicts."""
        self.op_schedule_end()
        for t, i in enumerate(self.fs_tiers()):
            while self.ref.tiers[i].lookups.to_worker:
                self.op_lookup_worker(t)

    def op_drain(self, fail_promotions: bool = False, fail_stores: bool = False) -> None:
        """Every fs tier catches up (its jobs finish, oldest first; ``fail_promotions`` /
        ``fail_stores``: those fail with an I/O error), then the step ends."""
        for t, i in enumerate(self.fs_tiers()):
            while self.ref.tiers[i].in_flight():
                job = self.ref.tiers[i].in_flight()[0]
                promotion = self.ref.jobs[job][0].is_promotion
                self.op_finish_job(t, 0, fail_promotions if promotion else fail_stores)
        self.op_schedule_end()

    def op_revisit(self, ks, lose: int = -1) -> None:
        """A new request asks for keys ``ks`` (an int or a tuple), the step ends, the probes are
        answered, it asks again (how chunks that left the primary tier come back from disk: one
        promotion job per tier for the request); with ``lose >= 0`` the file of ``ks[lose]``
        disappears before the promotion runs (a partial failure: the keys before it are kept)."""
        ks = (ks,) if isinstance(ks, int) else tuple(ks)
        while self.live:  # their probes of the keys would answer for the new request
            self.op_finish_request(0)
        self.op_new_request()
        pick = len(self.live) - 1
        for k in ks:
            self.op_lookup(pick, k)
        self.op_settle()
        for k in ks:
            self.op_lookup(pick, k)
        if 0 <= lose < len(ks):
            for t in range(len(self.fs_tiers())):
                if self.cfg.num_keys % 2:  # half the configurations lose the file, half tear it
                    self.op_truncate_file(t, ks[lose], ROW_BYTES // 2)
                else:
                    self.op_lose_file(t, ks[lose])

    def kvcr_tiers(self) -> list[int]:
        return [i for i, t in enumerate(self.cfg.tiers) if t == "kvcr"]

    def polled_tiers(self) -> list[int]:
        return [i for i, t in enumerate(self.cfg.tiers) if t == POLLED]

    def op_peer_request(self, ks: tuple) -> None:
        """A peer asks the polled tier for keys ``ks`` (served at the next round)."""
        keys = [self.keys[k % len(self.keys)] for k in ks]
        for i in self.polled_tiers():
            self.ref.tiers[i].peer_request(keys)
            self.vllm.tiers[i].peer_request(keys)
            self.stats["peer_requests"] += 1

    def op_poll_tiers(self) -> None:
        """A round of the tier-poll thread between two manager calls."""
        if not self.polled_tiers():
            return
        jobs_before = self.ref.job_counter
        self._both("poll_tiers", self.ref.poll_tiers, self.vllm.poll_tiers)
        self.stats["poll_rounds"] += 1
        self.stats["peer_pins"] += self.ref.job_counter - jobs_before

    def op_kvcr_pin(self, ks: tuple) -> None:
        """A peer reads keys ``ks`` through the KVCR tier: they are pinned at the end of the step
        (only where the KVCR tier is the only secondary tier, see docs/differences.md)."""
        if self.cfg.tiers != ("kvcr",):
            return
        keys = [self.keys[k % len(self.keys)] for k in ks]
        self.ref.tiers[0].request_pin(keys)
        self.vllm.kvcr_request_pin(0, keys)

    def op_kvcr_fail(self) -> None:
        """The next copy the KVCR tier starts fails (its NIXL transfer reports an error)."""
        for i in self.kvcr_tiers():
            self.ref.tiers[i].fail_copies += 1
            self.vllm.kvcr_gates[i].fail_next()
            self.stats["kvcr_copy_failures"] += 1

    def obj_tiers(self) -> list[int]:
        return [i for i, t in enumerate(self.cfg.tiers) if t == "obj"]

    def op_obj_fault(self, t: int, stage: int) -> None:
        """The next NIXL call of kind ``OBJ_FAULTS[stage]`` an obj tier makes fails (one armed at a time)."""
        objs = self.obj_tiers()
        if not objs:
            return
        i = objs[t % len(objs)]
        if self.ref.tiers[i].armed is not None:
            return
        name = OBJ_FAULTS[stage % len(OBJ_FAULTS)]
        self.ref.tiers[i].arm(name)
        self.vllm.obj_fault(i, name)
        self.stats["obj_faults_armed"] += 1

    def op_lose_file(self, t: int, k: int) -> None:
        fs = self.fs_tiers()
        if not fs:
            return
        i = fs[t % len(fs)]
        key = self.keys[k % len(self.keys)]
        self._both("lose_file", lambda: self.ref.tiers[i].lose_file(key), lambda: self.vllm.lose_file(i, key))

    def op_truncate_file(self, t: int, k: int, size: int) -> None:
        fs = self.fs_tiers()
        if not fs:
            return
        i = fs[t % len(fs)]
        key = self.keys[k % len(self.keys)]
        r, v = self._both("truncate_file", lambda: self.ref.tiers[i].truncate_file(key, size),
                          lambda: self.vllm.truncate_file(i, key, size))
        if r != v:
            raise TieringDivergence(f"truncate_file: reference {r}, vLLM {v}")

    def op_quiescent(self) -> None:
        """With every request finished, the tiers drained and one more end of step, nothing is left:
        no job, no queued promotion, no pinned or reserved primary chunk, no request state, no
        lookup probe (vLLM's state equals this, compared after each step)."""
        self.op_settle()  # submits promotions still queued (for requests that finished meanwhile)
        self.op_drain()
        self.op_schedule_end()  # collects what the drain's step could not (its poll was spent)
        left = {"jobs": sorted(self.ref.jobs), "queued promotions": dict(self.ref.pending_loads),
                "requests": sorted(self.ref.req_state),
                "pinned or reserved": [k.hex()[:8] for k, (_, r) in self.primary.chunk_state().items() if r != 0],
                "probes": [len(t.lookups.state) for t in self.ref.tiers if isinstance(t, FileSystemTier)
                           if t.lookups.state]}
        busy = bool(self.ref.jobs) or any(not isinstance(t, KVCRTier) and t.has_pending_work() for t in self.ref.tiers)
        if any(left.values()) or busy:  # a KVCR tier always answers has_pending_work (control messages)
            raise TieringDivergence(f"not quiescent after every request and job finished: {left}")

    def op_advance(self, dt: float) -> None:
        self.clock.advance(dt)

    def op_reset(self) -> None:
        for i in self.fs_tiers():  # vLLM's reset_cache drains the tiers: every job finishes first
            for job in list(self.ref.tiers[i].in_flight()):
                self.op_finish_job(self.fs_tiers().index(i), self.ref.tiers[i].in_flight().index(job), False)
        self.out = _Outstanding()  # GPU transfers in flight at a reset are abandoned by the scheduler
        self._both("reset_cache", self.ref.reset_cache, self.vllm.manager.reset_cache)

    def op_reset_flushed(self) -> None:
        self._both("on_reset_flushed", self.ref.on_reset_flushed, self.vllm.manager.on_reset_flushed)

    # -- the comparison -------------------------------------------------------------------------

    def compare(self, op) -> None:
        self.ref.check_invariants()
        self.stats["parked_cascade_steps"] += any(st.pending_cascade_keys for st in self.ref.req_state.values())
        v = self.vllm
        diffs = []

        def same(what, r, x):
            if r != x:
                diffs.append(f"{what}: reference {r!r}, vLLM {x!r}")

        same("primary chunks", self.primary.chunk_state(), v.chunk_state())
        same("jobs", {j: (i, job.is_promotion, job.keys, job.chunk_ids, job.req_id)
                      for j, (job, i) in self.ref.jobs.items()}, v.jobs())
        same("queued promotions", {t: {r: (tuple(e.keys), tuple(e.chunk_ids)) for r, e in by.items()}
                                   for t, by in self.ref.pending_loads.items()}, v.pending_loads())
        same("requests", {r: (s.pending_primary_stores, s.is_finished, s.request_level_tiers, tuple(s.pending_cascade_keys))
                          for r, s in self.ref.req_state.items()}, v.req_state())
        same("has_pending_work", self.ref.has_pending_work(), v.manager.has_pending_work())
        same("temporary files left by fs stores", [], v.temp_files())
        for i, tier in enumerate(self.ref.tiers):
            same(f"tier #{i} keys", tier.stored_keys(), v.stored_keys(i, self.keys))
            if isinstance(tier, FileSystemTier):
                same(f"tier #{i} lookups", tier.lookups.snapshot(), v.lookup_state(i))
                same(f"tier #{i} jobs in flight", tier.in_flight(), v.in_flight(i))
                for key, data in tier.files.items():
                    if v.tier_bytes(i, key) != data or data != content_of(key)[:len(data)]:
                            diffs.append(f"tier #{i}: file of {key.hex()[:8]} does not hold the bytes stored for it")
            if isinstance(tier, ObjectStoreTier):
                agent = v.obj_agents()[i]
                same(f"tier #{i} armed NIXL fault", tier.armed, agent.armed)
                same(f"tier #{i} NIXL faults taken", tier.fired, agent.fired)
            if isinstance(tier, KVCRTier):
                gate = v.kvcr_gates[i]
                same(f"tier #{i} KVCR residency", tier.residency(), gate.residency())
                for key, r in tier.res.items():
                    if r.state == "ready" and gate.slot_bytes(key) != r.data:
                        diffs.append(f"tier #{i}: KVCR slot of {key.hex()[:8]} does not hold the bytes stored for it")
            det = tier.bp_detector
            same(f"tier #{i} back-pressure", det.snapshot() if det else None, v.detector_snapshot(i))
        for rid in self.ref.req_state:
            for key in self.keys:
                same(f"load source of {key.hex()[:8]} for {rid}", self.ref.get_load_source(key, self.ctx[rid]),
                     v.manager.get_load_source(key, v.req_context(rid)).name)
        same("events", self.ref.take_events(), v.take_events())
        stats = v.take_stats()
        same("metrics", self.ref.take_stats(), stats)
        self.metrics_seen.update(stats)
        if bytes(self.primary.buffer.data) != v.primary_bytes():
            rows = [c for c in range(self.cfg.num_chunks)
                    if self.primary.buffer.read(c) != v.primary_bytes()[c * ROW_BYTES:(c + 1) * ROW_BYTES]]
            diffs.append(f"primary buffer rows {rows} differ")
        if diffs:
            raise TieringDivergence(f"after {op}: " + "; ".join(diffs[:6]))

    def check_declarations(self) -> None:
        """Every tiering metric vLLM reported is declared, with the kind its values have, and every
        info label the manager reports (one mapping per tier, primary first) is declared."""
        defs = self.vllm.metric_definitions()
        for key in self.metrics_seen:
            name, _, rest = key.partition(":(")
            kind = "histogram" if rest.endswith(("_count", "_sum")) else None
            if name not in defs or (kind and defs[name] != kind) or (not kind and defs[name] == "histogram"):
                raise TieringDivergence(f"metric {key}: reported, but declared as {defs.get(name)}")
        keys, infos = self.vllm.config_info()
        if len(infos) != 1 + len(self.cfg.tiers) or any(not set(i) <= set(keys) for i in infos):
            raise TieringDivergence(f"config info {infos} vs declared labels {keys}")
        labels = [i.get("tier") for i in infos]
        expected = ["0:primary"] + [f"{n + 1}:{t}" for n, t in enumerate(self.cfg.tiers)]
        if labels != expected:
            raise TieringDivergence(f"config info tier labels {labels}, expected {expected}")

    def close(self) -> None:
        """Shut vLLM's manager down (transfers may still be in flight, and in some configurations
        one NIXL release of the obj tier's shutdown fails); an obj tier's NIXL agent must be left
        holding nothing but what the failed release leaked (:meth:`InMemoryObjAgent.leaks`)."""
        if self.closed:
            return
        self.closed = True
        agents = self.vllm.obj_agents()
        self.stats["obj_abandoned"] += sum(len(a.in_flight()) for a in agents.values())
        # a release the object store's shutdown makes fails (drawn from the config, so it takes
        # nothing from the trace's random stream): the others must still be released
        stage = (None, "release_xfer", "release_dlist", "deregister")[(self.cfg.num_keys + self.cfg.num_chunks) % 4]
        armed = {i: stage for i, a in agents.items() if stage is not None and a.armed is None}
        for i, st in armed.items():
            agents[i].arm(st)
        fired = {i: agents[i].fired[st] for i, st in armed.items()}
        try:
            self.ref.shutdown()
            ref_failed = False
        except TierShutdownError:
            ref_failed = True
        vllm_failed = self.vllm.shutdown()
        self.stats["obj_shutdown_faults"] = sum(agents[i].fired[st] > fired[i] for i, st in armed.items())
        self.stats["failed_shutdowns"] += ref_failed
        if (self.ref.shut_down, ref_failed) != (self.vllm.shutdown_calls, vllm_failed):
            raise TieringDivergence(f"shutdown: reference reached {self.ref.shut_down} (a tier failed: {ref_failed}), "
                                    f"vLLM {self.vllm.shutdown_calls} (a tier failed: {vllm_failed})")
        for i, agent in agents.items():
            leaks = agent.leaks()
            if armed.get(i) == "release_xfer" and agent.fired["release_xfer"] > fired[i]:
                # the transfer whose handle the shutdown failed to release stays with the agent
                leaks = {k: n - (k == "transfers") for k, n in leaks.items() if n - (k == "transfers")}
            if leaks:
                raise TieringDivergence(f"tier #{i}: after shutdown the object store's NIXL agent still holds "
                                        f"{leaks}")


def random_op(rng: random.Random, world: TieringWorld) -> tuple:
    """One operation, weighted toward what moves chunks between tiers."""
    nk = world.cfg.num_keys
    primary = world.primary.chunk_state()
    absent = [i for i, k in enumerate(world.keys) if k not in primary]

    def ks() -> tuple:  # mostly keys the primary tier lacks: stores that need room, evictions
        pool = absent if absent and rng.random() < 0.7 else range(nk)
        return tuple(rng.choice(pool) for _ in range(rng.randint(1, min(3, world.cfg.num_chunks))))

    def held() -> tuple:  # mostly keys the primary tier holds: a peer asks for what it was told exists
        present = [i for i, k in enumerate(world.keys) if k in primary]
        pool = present if present and rng.random() < 0.8 else range(nk)
        return tuple(rng.choice(pool) for _ in range(rng.randint(1, 3)))

    p = rng.randrange(1000)
    busy = max((len(world.ref.tiers[i].in_flight()) for i in world.fs_tiers()), default=0)
    choices = [
        (9, ("new_request",) if len(world.live) < 3 else ("finish_request", p)),
        (7, ("finish_request", p)),
        (22, ("lookup", p, rng.randrange(nk))),
        (18, ("prepare_store", p, ks()) if busy < MAX_JOBS_PER_TIER - 2 else ("finish_job", 0, p, False)),
        (16, ("complete_store", p, rng.random() < 0.9) if busy < MAX_JOBS_PER_TIER - 2 else ("finish_job", 1, p, False)),
        (5, ("prepare_load", p, tuple(rng.randrange(nk) for _ in range(rng.randint(1, 3))))),
        (5, ("complete_load", p)),
        (2, ("touch", p, ks())),
        (12, ("schedule_end",)),
        (26, ("finish_job", rng.randrange(2), p, rng.random() < 0.12)),
        (8, ("lookup_worker", rng.randrange(2))),
        (6, ("settle",)),
        (5, ("drain",)),
        (6, ("revisit", _evicted_to_disk(rng, world))),
        (2, ("lose_file", rng.randrange(2), rng.randrange(nk))),
        (1, ("truncate_file", rng.randrange(2), rng.randrange(nk), rng.choice((0, 1, ROW_BYTES - 1)))),
        (6, ("advance", rng.choice((0.0005, 0.002, 0.02, 0.3, 2.0, 5.0)))),
        (1, ("reset",)),
        (3 if world.kvcr_tiers() else 0, ("kvcr_fail",)),
        (8 if world.cfg.tiers == ("kvcr",) else 0, ("kvcr_pin", held())),
        (8 if world.polled_tiers() else 0, ("peer_request", held())),
        (8 if world.polled_tiers() else 0, ("poll_tiers",)),
        (30 if world.ref.promotions_held else 1, ("reset_flushed",)),  # the scheduler flushes soon after
    ]
    if world.obj_tiers():  # drawn only here: traces without an obj tier keep their random stream
        choices.append((5, ("obj_fault", rng.randrange(2), rng.randrange(len(OBJ_FAULTS)))))
    if not world.live and rng.random() < 0.8:
        return ("new_request",)  # most operations act for a live request
    total = sum(w for w, _ in choices)
    x = rng.randrange(total)
    for w, op in choices:
        if x < w:
            return op
        x -= w
    raise AssertionError("unreachable")


def _evicted_to_disk(rng: random.Random, world: TieringWorld) -> int:
    """A key on some fs tier but not in the primary tier, when there is one."""
    primary = world.primary.chunk_state()
    on_disk = sorted({world.keys.index(k) for i in world.fs_tiers() for k in world.ref.tiers[i].files
                      if k not in primary} | {world.keys.index(k) for i in world.kvcr_tiers()
                                              for k in world.ref.tiers[i].stored_keys() if k not in primary})
    return rng.choice(on_disk) if on_disk and rng.random() < 0.8 else rng.randrange(world.cfg.num_keys)


def _tail(rng: random.Random, world: TieringWorld):
    """The end of every trace (generated lazily, it reads the world): everything in flight
    completes; after an optional reset one request stores every key in turn (the primary tier,
    smaller than the key set, evicts the oldest to make room; the tiers catch up after each store);
    fresh requests then ask for keys that left the primary tier, so they come back from a
    secondary tier, are handed to the GPU (bytes checked) and released; a final reset."""
    for _ in list(world.live):
        yield ("finish_request", 0)
    while world.out.loads:
        yield ("complete_load", 0)
    while world.out.stores:
        yield ("complete_store", 0, True)
    yield ("drain",)
    if rng.random() < 0.3:
        yield ("reset",)
        yield ("reset_flushed",)
    yield ("new_request",)
    slow = rng.random() < 0.5  # the tiers' stores take time (back-pressure), or fail (a full disk)
    failing = rng.random() < 0.2
    for k in rng.sample(range(world.cfg.num_keys), world.cfg.num_keys):
        yield ("prepare_store", 0, (k,))
        if world.out.stores:
            yield ("complete_store", 0, True)
        if slow:
            yield ("advance", rng.choice((0.0, 0.0001, 0.001, 0.01, 0.1, 3.0)))
        yield ("drain", False, failing and rng.random() < 0.7)
    yield ("finish_request", 0)
    # a second request offers the keys the primary tier holds: a request-level tier gets them now
    resident = tuple(i for i, k in enumerate(world.keys) if k in world.primary.chunk_state())
    if resident:
        yield ("new_request",)
        yield ("prepare_store", 0, resident)
        while world.out.stores:
            yield ("complete_store", 0, True)
        yield ("drain",)
        yield ("finish_request", 0)
    if world.polled_tiers():  # a peer asks for what the primary tier holds; two rounds pin and release
        held = tuple(i for i, k in enumerate(world.keys) if k in world.primary.chunk_state())
        yield ("peer_request", held + tuple(rng.sample(range(world.cfg.num_keys), 2)))
        yield ("poll_tiers",)
        yield ("poll_tiers",)
    if world.cfg.tiers == ("kvcr",):  # a peer reads what the primary tier holds: pinned, then released
        held = tuple(i for i, k in enumerate(world.keys) if k in world.primary.chunk_state())
        yield ("kvcr_pin", held + tuple(rng.sample(range(world.cfg.num_keys), 2)))
        yield ("schedule_end",)
        yield ("schedule_end",)
    primary = world.primary.chunk_state()
    gone = [i for i, k in enumerate(world.keys) if k not in primary]
    group = tuple(rng.sample(gone, min(len(gone), 3)))
    for ks in ([group] if rng.random() < 0.5 else [(k,) for k in group]):
        lose = rng.randrange(1, len(ks)) if len(ks) > 1 and rng.random() < 0.6 else -1
        yield ("revisit", ks, lose)
        yield ("schedule_end",)  # submits the promotions
        yield ("drain", lose < 0 and rng.random() < 0.3)
        for k in ks:
            yield ("lookup", 0, k)
        yield ("prepare_load", 0, ks)
        while world.out.loads:
            yield ("complete_load", 0)
        yield ("finish_request", 0)
    if world.obj_tiers():
        yield from _obj_fault_rounds(rng, world)
    yield ("drain",)
    yield ("quiescent",)
    yield ("reset",)
    if world.obj_tiers():  # shut down with object transfers in flight (the close checks the agent)
        yield ("new_request",)
        for k in rng.sample(range(world.cfg.num_keys), 2):
            yield ("prepare_store", 0, (k,))
            while world.out.stores:
                yield ("complete_store", 0, True)
        yield ("schedule_end",)


def _obj_fault_rounds(rng: random.Random, world: TieringWorld):
    """Each NIXL fault in turn (random order): armed, then (until a call takes it, a few tries) a
    store of a key the primary tier lacks or a promotion of one it lost; the store's transfer is
    collected by a poll or by the drain of a reset_cache (its results wait for the next poll)."""
    tier = world.ref.tiers[world.obj_tiers()[0]]
    for stage in rng.sample(range(len(OBJ_FAULTS)), len(OBJ_FAULTS)):
        yield ("obj_fault", 0, stage)
        for _ in range(3):
            if tier.armed is None:
                break
            primary = world.primary.chunk_state()
            absent = [i for i, k in enumerate(world.keys) if k not in primary]
            if absent and rng.random() < 0.6:
                yield ("new_request",)
                yield ("prepare_store", 0, (rng.choice(absent),))
                while world.out.stores:
                    yield ("complete_store", 0, True)
                yield ("schedule_end",)  # submits the cascades
                yield ("finish_request", 0)
                if rng.random() < 0.5:
                    yield ("reset",)  # the drain polls what the reset's harness finished
                    yield ("reset_flushed",)
                yield ("drain",)
            else:
                yield ("revisit", _evicted_to_disk(rng, world))
                yield ("schedule_end",)
                yield ("drain",)
                yield ("finish_request", 0)
                yield ("drain",)


def run_trace(cfg: TieringConfig, rng: random.Random, n_ops: int) -> tuple[dict, list]:
    """Run ``n_ops`` generated operations on a fresh world; returns (stats, the trace)."""
    from kvref.impl.vllm.tiering import virtual_time

    clock = VirtualClock()
    with virtual_time(clock):
        return _run_trace(cfg, rng, n_ops, clock)


def _run_trace(cfg: TieringConfig, rng: random.Random, n_ops: int, clock: VirtualClock) -> tuple[dict, list]:
    world = TieringWorld(cfg, clock)
    trace: list = []
    try:
        world.compare(("start",))
        for _ in range(n_ops):
            op = random_op(rng, world)
            trace.append(op)
            world.apply(op)
        for op in _tail(rng, world):
            trace.append(op)
            world.apply(op)
        world.check_declarations()
        for tier in world.ref.tiers:
            if isinstance(tier, ObjectStoreTier):
                for name, n in tier.fired.items():
                    world.stats[f"obj_fault_{name}"] = world.stats.get(f"obj_fault_{name}", 0) + n
            if isinstance(tier, KVCRTier):
                for name, n in tier.counts.items():
                    world.stats[f"kvcr_{name}"] = world.stats.get(f"kvcr_{name}", 0) + n
        world.close()
        result = dict(world.stats), trace
    except TieringDivergence as exc:
        _close_quietly(world)
        raise TieringDivergence(f"{exc}\nconfig {cfg}\ntrace {trace}") from None
    except BaseException:
        _close_quietly(world)
        raise
    return result


def _close_quietly(world: TieringWorld) -> None:
    """Close after a failure without hiding it: a planted fault may also keep a job from ever
    ending, so the tier's drain times out (TierTimeout); the first failure is the one to report."""
    from kvref.impl.vllm.tiering import TierTimeout

    try:
        world.close()
    except (TierTimeout, TieringDivergence):
        pass


def run_ops(cfg: TieringConfig, ops: list) -> dict:
    """Run the given operations (a directed trace) on a fresh world; returns its stats."""
    from kvref.impl.vllm.tiering import virtual_time

    clock = VirtualClock()
    with virtual_time(clock):
        world = TieringWorld(cfg, clock)
        try:
            world.compare(("start",))
            for op in ops:
                world.apply(op)
            return dict(world.stats)
        finally:
            world.close()


def run_traces(seed: int, n: int, n_ops: tuple[int, int] = (25, 60), layouts=None) -> dict:
    """``n`` generated configurations and traces (seeded by ``seed``); sums their stats.
    ``layouts``: draw the tier layouts from these (default :data:`TIER_LAYOUTS`)."""
    if layouts is not None and (not layouts or any(lay not in TIER_LAYOUTS for lay in layouts)):
        raise InvalidFieldError("layouts", layouts, f"None or tier layouts from {TIER_LAYOUTS}")
    rng = random.Random(f"conform-tiering-{seed}")
    total = {"traces": 0, "kvcr_traces": 0, "polled_traces": 0}
    drawn: list[tuple[str, ...]] = []
    for t in range(n):
        cfg = TieringConfig.random(rng)
        if layouts is not None:
            cfg.tiers = rng.choice(list(layouts))
        elif n >= len(MUST_DRAW):  # every run of a few traces drives each kind of tier at least once
            missing = [kind for kind in MUST_DRAW if not any(kind in lay for lay in drawn)]
            if missing and n - t <= len(missing):
                cfg.tiers = rng.choice([lay for lay in TIER_LAYOUTS if missing[0] in lay])
        drawn.append(cfg.tiers)
        stats, _ = run_trace(cfg, random.Random(rng.random()), rng.randint(*n_ops))
        for k, val in stats.items():
            total[k] = total.get(k, 0) + val
        total["traces"] += 1
        total["kvcr_traces"] += "kvcr" in cfg.tiers
        total["polled_traces"] += POLLED in cfg.tiers
    return total
