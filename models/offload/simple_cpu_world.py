"""A small engine around the SimpleCPU offload scheduler, with a content model beside it.

:class:`SimpleOffloadWorld` drives a GPU KV cache manager and a ``SimpleCPUOffloadScheduler``
the way vLLM's v1 ``Scheduler`` does (lookup -> connector match -> ``allocate_slots`` ->
``update_state_after_alloc``; ``build_connector_meta`` before ``num_computed_tokens`` advances;
async loads park the request until the worker reports it; finish -> ``request_finished`` then
``free``), while transfer completions are delivered whenever the trace says: late, out of order,
per worker.

Two backends answer the same calls: ``"reference"`` (kvref) and ``"vllm"`` (vLLM 0.33.0's
``KVCacheManager`` + ``SimpleCPUOffloadScheduler``), so one trace can run on both and be compared
(conformance) — and the reference can be run with historic variants. The engine side (GPU
``KVCacheManager``, requests, the scheduler's bookkeeping) is shared with the OffloadingConnector
world in :mod:`kvref.models.offload.world_common`.

The content model tracks a *content token* per GPU and CPU block: the (group, block-hash) of the
tokens the block holds. Computing tokens writes it, a store copies it GPU -> CPU at completion,
a load copies it CPU -> GPU. It checks, at every transfer:

* a GPU block is never the source of two in-flight stores (vLLM #41289; PR 42903);
* a block being stored (or loaded into) is not re-allocated before the transfer completes;
* a load reads a CPU block whose store completed, and what it reads is exactly the content the
  destination position needs (the block hash of that position in that group).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvref.impl.reference.block_hash import make_block_hash_with_group_id
from kvref.impl.reference.offload.simple_cpu_offload_scheduler import (
    SimpleOffloadStep,
)
from kvref.spec.kv_cache_interface import ChunkedLocalAttentionSpec, KVCacheGroupSpec

from kvref.impl.offload_backends import SimpleCPUReferenceBackend

from kvref.models.offload.world_common import (
    OffloadInvariantError,
    OffloadWorldBase,
    ScheduledBatch,
    WorldRequest,
    kvref_kv_cache_groups,
)


@dataclass(frozen=True)
class SimpleOffloadConfig:
    block_size: int = 4
    num_gpu_blocks: int = 24
    num_cpu_blocks: int = 10
    sliding_window: int | None = None  # adds an SWA group beside the full-attention one
    lazy: bool = False
    world_size: int = 1
    max_model_len: int = 256
    max_num_batched_tokens: int = 64
    # vLLM's AsyncScheduler: step N is scheduled before step N-1's output is processed, so a request
    # carries output placeholders (tokens sampled by a step still in flight) when the connector
    # builds its metadata.
    async_scheduling: bool = False
    # vLLM's ``kv_events_config.enable_kv_cache_events``: the connector publishes the CPU cache's
    # BlockStored / BlockRemoved / AllBlocksCleared events, compared after every operation.
    kv_events: bool = False
    # The connector sits in a MultiConnector beside a child without HMA support (one KV cache
    # group): the engine's finish reaches it as ``request_finished`` (MultiConnector falls back
    # from ``request_finished_all_groups``), which does not flush the confirmed blocks its eager
    # cursors have not reached; the reference finishes with no block table then.
    non_hma_sibling: bool = False
    # adds a chunked-local attention group (this chunk size, a multiple of the block size): an
    # external hit must start on a chunk boundary, so a local prefix ending mid-chunk loads nothing
    local_chunk: int | None = None
    # the full-attention group listed last, after the window/chunked ones (a model whose first
    # layers are local, as Gemma 3's): the connector finds it by kind, not by position
    full_attention_last: bool = False

    def kvref_groups(self) -> tuple[KVCacheGroupSpec, ...]:
        groups = list(kvref_kv_cache_groups(self.block_size, self.sliding_window))
        if self.local_chunk is not None:
            groups.append(KVCacheGroupSpec(("local",), ChunkedLocalAttentionSpec(
                block_size=self.block_size, num_kv_heads=1, head_size=1, dtype="float32",
                attention_chunk_size=self.local_chunk)))
        if self.full_attention_last:
            groups.append(groups.pop(0))
        return tuple(groups)

    @classmethod
    def random(cls, rng: Any) -> SimpleOffloadConfig:
        """A random small configuration for the generated-trace checks (``kvref verify``'s
        conform-offload / machine-offload): tight GPU pools, CPU pools from roomy to one block,
        synchronous or async scheduling, KV cache events on or off, a chunked-local group in about
        a quarter, the full-attention group listed last in about half of those with several.

        The scheduling mode is drawn from a generator seeded by ``rng``'s state, without advancing
        ``rng``: the checks draw the OffloadingConnector's cases from the same stream, and they stay
        what they were."""
        import random

        # Seeded from the state's int tuple alone: the whole state ends in ``gauss_next``, None here,
        # and Python 3.11 hashes None by address, so hash(rng.getstate()) changed from process to
        # process (the draw, and so SimpleCPU's reach, varied between runs of one seed).
        mode = random.Random(hash(rng.getstate()[1]))
        cfg = cls(block_size=4, num_gpu_blocks=rng.randint(8, 16), num_cpu_blocks=rng.choice([40, 24, 8, 3, 1]),
                  sliding_window=rng.choice([None, None, 4, 8, 12]), lazy=rng.random() < 0.5,
                  world_size=rng.randint(1, 2), max_num_batched_tokens=rng.choice([8, 16]),
                  async_scheduling=mode.random() < 0.5, kv_events=mode.random() < 0.5)
        from dataclasses import replace

        if cfg.sliding_window is None and mode.random() < 0.3:  # one group: a non-HMA sibling is allowed
            cfg = replace(cfg, non_hma_sibling=True)
        # further groups, from a generator of their own (the draws above stay what they were)
        groups = random.Random(hash(rng.getstate()[1]) + 1)
        if not cfg.non_hma_sibling and groups.random() < 0.25:
            cfg = replace(cfg, local_chunk=groups.choice([8, 12]))
        if (cfg.sliding_window is not None or cfg.local_chunk is not None) and groups.random() < 0.5:
            cfg = replace(cfg, full_attention_last=True)
        return cfg


# --------------------------------------------------------------------------------------------
# Backends


def _vllm_backend(cfg: SimpleOffloadConfig, variant: str = "reference"):
    from kvref.impl.vllm.offload import SimpleCPUVllmBackend

    return SimpleCPUVllmBackend(cfg, variant)


BACKENDS = {"reference": SimpleCPUReferenceBackend, "vllm": _vllm_backend}


# --------------------------------------------------------------------------------------------
# The world


@dataclass
class _Transfer:
    pairs: list[tuple[int, int]]  # (gpu, cpu)
    content: dict[int, Any] = field(default_factory=dict)  # source content at issue
    reported: int = 0
    abandoned: bool = False  # a reset() gave it up: it still runs, but publishes nothing


class SimpleOffloadWorld(OffloadWorldBase):
    """Drives one backend through requests, steps and completions; checks the content model.

    ``check_no_double_store`` can be turned off to let a trace run on past a duplicate store
    (e.g. to compare a 0.33.0 trace that has one, PR 42903).
    """

    def __init__(self, cfg: SimpleOffloadConfig, backend: str = "reference", variant: str = "reference",
                 check_no_double_store: bool = True, allow_duplicates_within_event: bool = False) -> None:
        self.cfg = cfg
        self.b = BACKENDS[backend](cfg, variant)
        self.check_no_double_store = check_no_double_store
        # 0.33.0 can store one block twice *within* one event (PR 42903, kept as vLLM does it);
        # across events (a store of a block whose earlier store is still in flight) it is #41289.
        self.allow_duplicates_within_event = allow_duplicates_within_event
        self.reqs: dict[str, WorldRequest] = {}
        self.order: list[str] = []
        self.finished_pending: set[str] = set()
        self.preempted_pending: set[str] = set()
        self.stores: dict[int, _Transfer] = {}
        self.loads: dict[str, _Transfer] = {}  # by request
        self.load_event_of: dict[str, int] = {}
        self.gpu_content: dict[int, Any] = {}
        self.cpu_content: dict[int, Any] = {}
        self.metas: list[tuple] = []
        self.kv_events: list[dict] = []  # every KV cache event the connector published, in order
        self.load_blocks_total = 0  # the connector's LOAD_BLOCKS counter, summed over its intervals
        self.duplicate_stores: list[tuple[int, int]] = []  # (store event, gpu block)
        self._n = 0
        self.failed: str | None = None
        # Async scheduling: the step whose output is not processed yet (its batch and the requests
        # that sample a token in it), per request the tokens scheduled in it (vLLM's
        # ``num_in_flight_tokens``) and the in-flight steps whose output is stale (preempted since).
        self._in_flight: tuple[ScheduledBatch, set[str]] | None = None
        self._in_flight_tokens: dict[str, int] = {}
        self._stale: dict[str, int] = {}

    # -- helpers -------------------------------------------------------------------------------

    def _fail(self, msg: str) -> None:
        self.failed = msg
        raise OffloadInvariantError(msg)

    def _expected(self, r: WorldRequest, g: int, pos: int) -> Any:
        return make_block_hash_with_group_id(self.b.block_hashes(r.req)[pos], g)

    def _write_computed(self, r: WorldRequest, start: int, end: int) -> None:
        """Tokens [start, end) were computed: blocks that became full now hold their content."""
        bs = self.cfg.block_size
        table = self.b.table(r.rid)
        hashes = self.b.block_hashes(r.req)
        for g, ids in enumerate(table):
            for pos in range(start // bs, end // bs):
                if pos < len(ids) and ids[pos] != 0 and pos < len(hashes):
                    self.gpu_content[ids[pos]] = make_block_hash_with_group_id(hashes[pos], g)

    # -- operations ----------------------------------------------------------------------------

    def step(self, chunk: int) -> tuple:
        """One ``schedule()``: running requests first, then waiting ones (a local look-up, the
        connector's match, an async load or a chunk), then the connector's metadata. The Mamba world
        (:mod:`.simple_cpu_mamba_world`) is this loop with its own look-up, chunk clipping and
        step extras (the hooks ``_lookup``, ``_clip``, ``_connector_step``)."""
        batch = ScheduledBatch()
        for rid in self.live("running"):
            r = self.reqs[rid]
            ph = r.req.num_output_placeholders
            if ph > 0 and r.computed + 2 - ph >= r.req.num_prompt_tokens + r.max_out:
                continue  # async: the step in flight already samples the last token (vLLM's guard)
            n = self._clip(r, min(chunk, r.req.num_tokens + ph - r.computed), 0)
            if n <= 0:
                continue
            ids = self.b.allocate(r.req, n)
            if ids is None:
                continue
            batch.add(r, self.b.table(rid) if r.full_table_next else ids, r.full_table_next, n)
        for rid in self.live("waiting"):
            r = self.reqs[rid]
            if self._stale.get(rid):
                continue  # async: preempted in a schedule; resumes after its stale output is back
            hits, n_hit = (None, 0)
            if r.computed == 0:
                hits, n_hit = self._lookup(r)
                n_ext, _ = self.b.match(r.req, n_hit)
            else:
                n_ext = 0
            if n_ext > 0:
                ids = self.b.allocate(r.req, 0, n_hit, hits, n_ext, True)
                if ids is None:
                    continue
                self._wait_for_remote_kvs(r, n_hit, n_ext)
                continue
            n = self._clip(r, min(chunk, r.req.num_tokens - r.computed - n_hit), n_hit)
            # vLLM schedules no empty chunk: the hit leaves at least one token, but a clip may not
            ids = self.b.allocate(r.req, n, n_hit, hits if n_hit else None) if n > 0 else None
            if ids is None:
                if r.computed == 0:
                    self.b.match(r.req, 0)  # vLLM re-looks-up next time; drop any pin now (as retry would)
                continue
            if r.computed == 0:
                self.b.after_alloc(r.req, 0)
            self._schedule_waiting(batch, r, n_hit, n)
        meta = self.b.build_meta(self._connector_step(batch))
        self.metas.append(meta)
        self._on_loads(meta)
        if self.cfg.async_scheduling:
            self._async_after_schedule(batch)
        else:
            # The step runs: computed tokens advance and full blocks get their content; the worker
            # copies this step's stores only after the forward pass (a compute-done event).
            self._forward(batch)
            self._on_stores(meta)
            self._update_from_output(batch)
        self._check()
        return meta

    # -- the schedule loop's hooks (the Mamba world's variation) -------------------------------

    def _lookup(self, r: WorldRequest) -> tuple[Any, int]:
        """The local prefix-cache hit of a new request: (hit blocks, hit tokens)."""
        return self.b.get_computed_blocks(r.req)

    def _clip(self, r: WorldRequest, n: int, n_hit: int) -> int:
        """The tokens ``r`` runs this step out of the ``n`` the budget allows (after ``n_hit`` hit
        tokens): all of them on these pools."""
        return n

    def _connector_step(self, batch: ScheduledBatch) -> SimpleOffloadStep:
        """The connector's view of the step's ``SchedulerOutput``."""
        return self._scheduler_output(SimpleOffloadStep, batch)

    # -- async scheduling ----------------------------------------------------------------------

    def _async_after_schedule(self, batch: ScheduledBatch) -> None:
        """vLLM's ``AsyncScheduler`` after ``schedule()`` built step N's metadata: computed tokens
        advance and a request that will sample gets an output placeholder
        (``_update_after_schedule``); then the engine processes step N-1's output
        (``update_from_output``, one batch in flight). Step N's forward pass writes its blocks'
        content (the tokens sampled by N-1 are known by then) and its stores copy after it."""
        sampled: set[str] = set()
        for r, start, end in batch.advances:
            if end >= r.req.num_tokens + r.req.num_output_placeholders:
                sampled.add(r.rid)  # not a prefill chunk: it samples a token
                r.req.num_output_placeholders += 1
            r.computed = end
            r.req.num_computed_tokens = end
            self._in_flight_tokens[r.rid] = self._in_flight_tokens.get(r.rid, 0) + end - start
        previous, self._in_flight = self._in_flight, (batch, sampled)
        if previous is not None:
            self._async_update_from_output(*previous)
        for r, start, end in batch.advances:
            if r.phase == "running":
                self._write_computed(r, start, end)
        self._on_stores(self.metas[-1])

    def _async_update_from_output(self, batch: ScheduledBatch, sampled: set[str]) -> None:
        """Step N-1's output: each sampling request gets its token, a placeholder resolves and the
        blocks it completed are cached (vLLM's ``cache_blocks(num_computed - num_in_flight)``); a
        stale output (the request was preempted since) is appended without touching the counters.
        Finished requests' outputs are dropped."""
        for r, start, end in batch.advances:
            rid = r.rid
            if r.phase == "done":
                continue
            stale = self._stale.get(rid, 0) > 0
            if stale:
                self._stale[rid] -= 1
            else:
                self._in_flight_tokens[rid] -= end - start
            if rid not in sampled:
                continue
            self.b.append_token(r.req, 7 + r.req.num_tokens % 5)
            if not stale:
                r.req.num_output_placeholders -= 1
                if r.phase == "running":
                    self.b.cache_blocks(r.req, r.computed - self._in_flight_tokens[rid])
            if r.req.num_tokens - r.req.num_prompt_tokens >= r.max_out:
                self._finish_stopped(rid)

    def _on_stores(self, meta: tuple) -> None:
        _, _, _, store_event, sg, sc, _ = meta
        if store_event >= 0:
            pairs = list(zip(sg, sc))
            # Abandoned stores (after a reset) may still read a block: read-read, harmless.
            busy = {g for t in self.stores.values() if not t.abandoned for g, _ in t.pairs}
            seen: set[int] = set()
            for g, _ in pairs:
                if g in busy or g in seen:
                    self.duplicate_stores.append((store_event, g))
                    if self.check_no_double_store and (g in busy or not self.allow_duplicates_within_event):
                        self._fail(f"GPU block {g} is the source of two in-flight stores (event {store_event})")
                seen.add(g)
                if self.gpu_content.get(g) != self.b.gpu_pool.blocks[g].block_hash:
                    self._fail(f"store event {store_event} copies GPU block {g} holding "
                               f"{self.gpu_content.get(g)!r} under key {self.b.gpu_pool.blocks[g].block_hash!r}")
            self.stores[store_event] = _Transfer(pairs, {g: self.gpu_content.get(g) for g, _ in pairs})

    def _on_loads(self, meta: tuple) -> None:
        load_event, lg, lc = meta[:3]
        if load_event >= 0:
            # Each destination block sits at one position of one loading request's table; what it
            # receives must be that position's content.
            where: dict[int, tuple[str, int, int]] = {}
            for rid in self.live("loading"):
                if rid in self.load_event_of:
                    continue
                for g, ids in enumerate(self.b.table(rid)):
                    for pos, bid in enumerate(ids):
                        if bid != 0:
                            where[bid] = (rid, g, pos)
            per_req: dict[str, list[tuple[int, int]]] = {}
            for gid, cid in zip(lg, lc):
                if gid not in where:
                    self._fail(f"load event {load_event} writes GPU block {gid}, no loading request owns it")
                rid, g, pos = where[gid]
                exp = self._expected(self.reqs[rid], g, pos)
                if self.cpu_content.get(cid) is None:
                    self._fail(f"load reads CPU block {cid} whose store has not completed")
                if self.cpu_content[cid] != exp:
                    self._fail(f"load into GPU block {gid}: CPU block {cid} holds {self.cpu_content[cid]!r}, "
                               f"the request needs {exp!r}")
                per_req.setdefault(rid, []).append((gid, cid))
            for rid, pairs in per_req.items():
                self.load_event_of[rid] = load_event
                self.loads[rid] = _Transfer(pairs, {g: self.cpu_content[c] for g, c in pairs})

    def complete_store(self, pick: int, count: int = 1) -> bool:
        if not self.stores:
            return False
        ev = sorted(self.stores)[pick % len(self.stores)]
        t = self.stores[ev]
        count = min(count, self.cfg.world_size - t.reported)
        t.reported += count
        self.b.complete(set(), {ev: count})
        if t.reported >= self.cfg.world_size:
            del self.stores[ev]
            for g, c in t.pairs:
                if t.abandoned:
                    continue
                if self.gpu_content.get(g) != t.content[g]:
                    self._fail(f"GPU block {g} was rewritten while store event {ev} copied it")
                self.cpu_content[c] = t.content[g]
        self._check()
        return True

    def complete_load(self, pick: int) -> bool:
        rids = [rid for rid in self.loads]
        if not rids:
            return False
        rid = rids[pick % len(rids)]
        t = self.loads.pop(rid)
        self.load_event_of.pop(rid, None)
        self.b.complete({rid}, {})
        for g, c in t.pairs:
            self.gpu_content[g] = t.content[g]
        self._update_waiting_for_remote_kv(self.reqs[rid])
        self._check()
        return True

    def finish(self, rid: str) -> None:
        r = self.reqs[rid]
        if r.phase == "done":
            return
        # Stopped or aborted, a finish here is "aborted" (FINISHED_ABORTED in vLLM): SimpleCPU's
        # request_finished does not look at why a request finished.
        self.b.set_status(r.req, "aborted")
        self.b.finished(r.req, self.b.table(rid))
        self.b.free(r.req)
        r.phase = "done"
        self.finished_pending.add(rid)
        self._check()

    def _preempt_request(self, r: WorldRequest) -> None:
        if self.cfg.async_scheduling:
            # vLLM: the output of the step in flight becomes stale, placeholders are dropped.
            in_flight = self._in_flight is not None and any(x.rid == r.rid for x, _, _ in self._in_flight[0].advances)
            self._stale[r.rid] = self._stale.get(r.rid, 0) + int(in_flight)
            self._in_flight_tokens[r.rid] = 0
            r.req.num_output_placeholders = 0
        super()._preempt_request(r)
        self._check()

    def preempt(self, pick: int, furthest: bool = False) -> bool:
        """Preempt a running request: ``pick`` chooses one, or ``furthest`` the one with the most
        computed tokens (the likeliest to have stores done or in flight)."""
        if not furthest:
            return super().preempt(pick)
        rids = self.live("running")
        if not rids:
            return False
        self._preempt_request(self.reqs[max(rids, key=lambda rid: self.reqs[rid].computed)])
        return True

    def readd(self, pick: int, drop_last_block: bool = False) -> str | None:
        """A new request whose prompt is an earlier request's tokens (prompt and outputs so far) cut
        to a block boundary (one block shorter with ``drop_last_block``): its whole prompt may be on
        the GPU, on the CPU or split between them. None when no earlier request has a full block."""
        bs = self.cfg.block_size
        sources = [self.b.tokens(self.reqs[rid].req) for rid in self.order]
        sources = [t for t in sources if len(t) >= bs * (2 if drop_last_block else 1)]
        if not sources:
            return None
        tokens = sources[pick % len(sources)]
        n = (len(tokens) // bs - int(drop_last_block)) * bs
        return self.add_request(tokens[:n])

    def reset(self) -> bool:
        ok = self.b.reset()
        for t in self.stores.values():
            t.abandoned = True
        if ok:
            self.cpu_content.clear()
        self._check()
        return ok

    # -- checks --------------------------------------------------------------------------------

    def _check(self) -> None:
        self.b.check_invariants()
        # A block in a transfer is never back in the free queue (it could be re-allocated).
        pool = self.b.gpu_pool
        for t in list(self.stores.values()) + list(self.loads.values()):
            for g, _ in t.pairs:
                if pool.blocks[g].ref_cnt <= 0:
                    self._fail(f"GPU block {g} is free while a transfer uses it")

    def observe(self) -> dict:
        """What must agree between backends (block ids exactly)."""
        gq = [b.block_id for b in self.b.gpu_pool.free_block_queue.get_all_free_blocks()]
        cq = [b.block_id for b in self.b.cpu_pool.free_block_queue.get_all_free_blocks()]
        cached = sorted((b.block_id, b.block_hash) for b in self.b.cpu_pool.blocks if b.block_hash is not None)
        refs = [b.ref_cnt for b in self.b.gpu_pool.blocks] + [b.ref_cnt for b in self.b.cpu_pool.blocks]
        self.kv_events += self.b.take_kv_events()
        stats, outcomes, pending = self.b.stats()
        self.load_blocks_total += stats.pop("load_blocks")
        return {"kv_events": list(self.kv_events), "stats": (self.load_blocks_total, stats, outcomes, pending),
                "gpu_free": gq, "cpu_free": cq, "cpu_cached": cached, "refs": refs,
                "in_flight": sorted(self.b.in_flight_set()), "phases": {k: v.phase for k, v in self.reqs.items()},
                "connector": self.b.connector_state()}


# --------------------------------------------------------------------------------------------
# Hypothesis state machine


def make_simple_offload_machine(cfg: SimpleOffloadConfig, backend: str = "reference", variant: str = "reference"):
    """A ``RuleBasedStateMachine`` class running :class:`SimpleOffloadWorld` on ``backend``/``variant``.

    Every rule ends in the world's checks (content model + ``check_invariants``); a broken offload
    invariant raises :class:`OffloadInvariantError`.
    """
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

    prefixes = [list(range(100, 140)), list(range(200, 240))]

    class SimpleOffloadMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.world = SimpleOffloadWorld(cfg, backend, variant)

        @rule(fam=st.integers(0, 2), n=st.sampled_from([13, 20, 9, 30, 2]))
        def add_request(self, fam, n):
            w = self.world
            prompt = [1000 + 40 * len(w.order) + i for i in range(n)] if fam == 2 else prefixes[fam][:n]
            w.add_request(prompt)

        @rule(chunk=st.sampled_from([8, 4, 12, 64]))
        def step(self, chunk):
            self.world.step(chunk)

        @precondition(lambda self: self.world.stores)
        @rule(pick=st.integers(0, 99), count=st.integers(1, 2))
        def complete_store(self, pick, count):
            self.world.complete_store(pick, count)

        @precondition(lambda self: self.world.loads)
        @rule(pick=st.integers(0, 99))
        def complete_load(self, pick):
            self.world.complete_load(pick)

        @rule(pick=st.integers(0, 99))
        def abort(self, pick):
            self.world.abort(pick)

        @rule(pick=st.integers(0, 99))
        def preempt(self, pick):
            self.world.preempt(pick)

        @rule()
        def reset(self):
            self.world.reset()

        @invariant()
        def invariants_hold(self):
            self.world._check()

        def teardown(self):
            # Nothing is lost: once every transfer is delivered, no block is still held by one.
            w = self.world
            if w.failed:  # already reported; the world is mid-step
                return
            for rid in w.live():
                w.finish(rid)
            w.step(1)  # a finished request's flush goes out with the next step's metadata
            while w.stores or w.loads:
                w.complete_store(0, cfg.world_size)
                w.complete_load(0)
            w._check()
            gpu_used = [b.block_id for b in w.b.gpu_pool.blocks[1:] if b.ref_cnt]
            cpu_used = [b.block_id for b in w.b.cpu_pool.blocks[1:] if b.ref_cnt]
            if gpu_used or cpu_used:
                raise OffloadInvariantError(f"blocks still held after all transfers completed: GPU {gpu_used}, "
                                            f"CPU {cpu_used}")

    SimpleOffloadMachine.__name__ = f"SimpleOffloadMachine_{backend}_{variant}"
    return SimpleOffloadMachine
