"""A small engine around the OffloadingConnector scheduler + CPU offloading manager.

Same shape as :mod:`kvref.models.offload.simple_cpu_world` (which drives the SimpleCPU connector): a GPU
KV cache manager and the connector are driven like vLLM's ``Scheduler`` does, transfer
completions arrive when the trace says (late, out of order, one worker at a time), and two
backends (``"reference"``, ``"vllm"``) answer the same calls so a trace can be compared. The
engine side both worlds share is in :mod:`kvref.models.offload.world_common`.

Content model: every GPU block carries the (group, block-hash) key of what it holds. It checks

* a store job only reads blocks holding exactly the chunk positions it is keyed by;
* a block that is a source of a running store is not overwritten unless that job completed or
  was flushed in the step that re-allocated it (the fence, vLLM #41228);
* a load job reads only chunks the manager reports ready, keyed by the positions it fills.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any

from kvref.impl.reference.block_hash import make_block_hash_with_group_id
from kvref.impl.reference.offload.offloading_scheduler import OffloadingStep
from kvref.impl.reference.scheduler_mamba_split import MambaSplitConfig, mamba_block_aligned_split
from kvref.spec.kv_cache_interface import ChunkedLocalAttentionSpec, KVCacheGroupSpec, MambaSpec

from kvref.impl.offload_backends import OffloadingReferenceBackend

from kvref.models.offload.world_common import (
    OffloadInvariantError,
    OffloadWorldBase,
    ScheduledBatch,
    WorldRequest,
    kvref_kv_cache_groups,
)


@dataclass(frozen=True)
class OffloadingConfig:
    block_size: int = 4
    blocks_per_chunk: int = 1
    num_gpu_blocks: int = 24
    num_cpu_chunks: int = 16
    sliding_window: int | None = None  # adds an SWA group
    cache_policy: str = "lru"
    num_workers: int = 1
    offload_prompt_only: bool = True
    max_model_len: int = 256
    # Multi-module MTP: vLLM sets ``extra_retained_tokens = num_prefill_lookahead_tokens - 1`` on every
    # sliding-window spec; the offload window and the store mask widen by it (PR 41228).
    extra_retained_tokens: int = 0
    attention_chunk_size: int | None = None  # adds a chunked-local group (Llama 4; PR 51161)
    # The CPU manager's admission filter (kv_connector_extra_config ``store_threshold`` /
    # ``max_tracker_size``): a chunk is stored only once offered that many times, offers counted in
    # an LRU table of at most that many keys; below 2 (vLLM's default 0) no filter.
    store_threshold: int = 0
    max_tracker_size: int = 64_000
    # KV cache events: "off", "placeholder" (vLLM's enable_kv_cache_events alone) or
    # "self_describing" (with the connector's self_describing_kv_events: payloads with tokens).
    kv_events: str = "off"
    # Requests' kv_transfer_params: odd arrivals 2k+1 get entry k % len (() = none, as even arrivals):
    # load tier filters (kv_load_tiers, valid and malformed), max_load_tokens, max_offload_tokens.
    kv_transfer_params: tuple = ()
    # Adds a Mamba group in "align" mode (hybrid models: Jamba, Nemotron-H, Qwen3-Next): prefill
    # chunks stop on its state boundaries (``_mamba_block_aligned_split``), the GPU cache hands each
    # cached boundary state to the connector (``boundary_state_offloads``), which stores the chunk
    # ends among them, and a hit ends on a Mamba chunk and loads the state there.
    mamba_align: bool = False
    # kv_connector_extra_config's sync_load_budget_bytes: hits whose bytes (tokens x 8 bytes per group
    # here) fit the step's budget load before the forward pass and the request runs at once (0: off)
    sync_load_budget_bytes: int = 0
    # A pure Mamba model (Mamba2, Falcon-Mamba): the Mamba "align" group alone, no attention group;
    # only with ``mamba_align`` and no windowed group (hits then align to the Mamba chunk itself).
    mamba_only: bool = False
    # Request hashes finer than the blocks (``hash_block_size`` < ``block_size``; None: the block
    # size). With a Mamba "align" group beside full attention this turns on vLLM's fine-grained
    # Mamba hits and the OffloadingConnector's partial tails: the prompt's last hash boundary inside
    # a block is stored (the COW-ed state + the attention block holding it) and looked up.
    hash_block_size: int | None = None
    # Every k-th arrival (k > 0; 0: none) asks for its prompt's logprobs, so it never reads the prefix
    # cache: no GPU hit, and the connector answers 0 without a lookup (vLLM's
    # ``skip_reading_prefix_cache``); its chunks are still stored for the others.
    prompt_logprobs_every: int = 0
    # vLLM's prefix_cache_retention_interval (CacheConfig; the GPU cache's KVCacheConfig and the
    # connector's SchedulerOffloadConfig both read it): None dense; 0 only the replay boundary and
    # shared-prefix junction tails of sliding-window groups are cached and offloaded; k > 0 those plus
    # one tail per k tokens. Drawn by :mod:`kvref.models.offload.offloading_retention`, not by random().
    prefix_cache_retention_interval: int | None = None
    # EAGLE/MTP drafting: the index (in kvref_groups()) of the group holding the drafter's layers
    # (vLLM's is_eagle_group; None: no drafter). The GPU cache then drops a hit's last block of that
    # group (use_eagle) and the connector pops its trailing chunk and stores it only once stable.
    # Drawn by :mod:`kvref.models.offload.offloading_eagle`, not by random().
    eagle_group: int | None = None
    # Speculative decoding with EAGLE's block drop on although no group is flagged (a drafter owning
    # no KV cache, or a runner that does not tag draft layers): the GPU cache drops a hit's last
    # block in every group, the connector treats every group as non-draft (vLLM #52735's fallback).
    speculative_eagle: bool = False

    def tokens_per_hash(self) -> int:
        """The request hash granularity (vLLM's ``hash_block_size``, the connector's ``tokens_per_hash``)."""
        return self.hash_block_size or self.block_size

    def kvref_groups(self) -> tuple[KVCacheGroupSpec, ...]:
        groups = list(kvref_kv_cache_groups(self.block_size, self.sliding_window))
        if self.sliding_window is not None and self.extra_retained_tokens:
            swa = groups[1]
            groups[1] = replace(swa, kv_cache_spec=replace(swa.kv_cache_spec,
                                                           extra_retained_tokens=self.extra_retained_tokens))
        if self.attention_chunk_size is not None:
            kw = dict(block_size=self.block_size, num_kv_heads=1, head_size=1, dtype="float32")
            groups.append(KVCacheGroupSpec(("local",), ChunkedLocalAttentionSpec(
                attention_chunk_size=self.attention_chunk_size, **kw)))
        if self.mamba_align:
            groups.append(KVCacheGroupSpec(("mamba",), MambaSpec(block_size=self.block_size, shapes=((2, 8),),
                                                                 dtypes=("float16",), mamba_cache_mode="align")))
            if self.mamba_only and len(groups) == 2:  # FA + Mamba: drop the attention group
                groups = groups[1:]
        if self.eagle_group is not None:
            groups[self.eagle_group] = replace(groups[self.eagle_group], is_eagle_group=True)
        return tuple(groups)

    def mamba_split(self) -> MambaSplitConfig | None:
        """Where the world's scheduler clips prefill chunks (None: no Mamba "align" group)."""
        if not self.mamba_align:
            return None
        # with a drafter the engine runs EAGLE's block drop, which moves the prefill checkpoint a
        # hash before the last one (vLLM ``get_mamba_prefill_checkpoint_position``)
        return MambaSplitConfig(block_size=self.block_size, hash_block_size=self.tokens_per_hash(),
                                partial_cache_hit=self.tokens_per_hash() < self.block_size and not self.mamba_only,
                                use_eagle_block_drop=self.eagle_group is not None or self.speculative_eagle)

    @classmethod
    def random(cls, rng: Any) -> OffloadingConfig:
        """A random small configuration for the generated-trace checks (``kvref verify``'s
        conform-offload / machine-offload).

        ``rng`` is advanced exactly as before the extensions below (the SimpleCPU cases that
        ``kvref verify`` alternates with these draw from the same ``rng``, and stay the same
        traces); the extensions draw from a generator seeded by ``rng``'s state:

        * CPU pools from a couple of chunks to roomy, mostly tight (a few prompts' worth), so
          chunks are evicted from inside cached runs and later lookups cross the gap;
        * sliding windows of 1-5 chunks (a miss inside a window-long run matters only from 2 on),
          with MTP's ``extra_retained_tokens`` one time in two;
        * a chunked-local group one time in three (alone beside full attention, or with the SWA
          group);
        * the CPU manager's store threshold (2 or 3 offers) one time in four, its tracker from a
          handful of keys (offers age out) to roomy;
        * KV cache events one time in two, half of them self-describing;
        * requests' ``kv_transfer_params`` one time in three (:func:`random_transfer_params`);
        * a Mamba "align" group one time in three, where requests carry no ``kv_transfer_params``
          (a few GPU blocks more: each request holds one or two states), half of them alone
          (a pure Mamba model: no attention group), a quarter beside full attention alone with
          request hashes finer than the blocks (vLLM's partial tails: 8/4, 8/2 or 4/2 tokens);
        * a synchronous-load budget one time in three (from a chunk or two per step to unlimited);
        * one time in four, every 2nd, 3rd or 5th arrival asks for prompt logprobs (it reads no
          prefix cache, GPU or offloaded).
        """
        base = dict(block_size=4, blocks_per_chunk=rng.choice([1, 1, 2]), num_gpu_blocks=rng.randint(10, 18),
                    num_cpu_chunks=rng.choice([16, 6, 32, 2]), sliding_window=rng.choice([None, 4, 8, 12]),
                    cache_policy=rng.choice(["lru", "arc"]), num_workers=rng.randint(1, 2),
                    offload_prompt_only=rng.random() < 0.5)
        sub = random.Random(hash(rng.getstate()[1]))  # ints only: the same on every run
        gpu_chunks = base["num_gpu_blocks"] // base["blocks_per_chunk"]
        base["num_cpu_chunks"] = sub.choice([base["num_cpu_chunks"], gpu_chunks // 2 + 2, gpu_chunks, gpu_chunks + 4, 2 * gpu_chunks])
        if base["sliding_window"] is not None:
            base["sliding_window"] = sub.choice([base["sliding_window"], 4, 8, 12, 16, 20])
            base["extra_retained_tokens"] = sub.choice([0, 1, 2, 3, 5, 7, 9])
        if sub.random() < 1 / 3:
            base["attention_chunk_size"] = sub.choice([8, 12, 16])
        # Every group draws from the one GPU pool: room for a prompt in each windowed group too.
        windowed = (base["sliding_window"] is not None) + ("attention_chunk_size" in base)
        base["num_gpu_blocks"] += sub.randint(3, 6) * windowed
        if sub.random() < 1 / 4:
            base["store_threshold"] = sub.choice([2, 3])
            base["max_tracker_size"] = sub.choice([3, 6, 64_000])
        base["kv_events"] = sub.choice(["off", "off", "placeholder", "self_describing"])
        if sub.random() < 1 / 3:
            base["kv_transfer_params"] = tuple(random_transfer_params(sub) for _ in range(sub.randint(2, 5)))
        if not base.get("kv_transfer_params") and sub.random() < 1 / 2:  # the capped lookups stay as drawn
            base["mamba_align"] = True
            base["num_gpu_blocks"] += sub.randint(2, 4)
            if sub.random() < 1 / 2:  # a pure Mamba model: the state group alone
                base.update(mamba_only=True, sliding_window=None, extra_retained_tokens=0)
                base.pop("attention_chunk_size", None)
            elif sub.random() < 1 / 2:  # finer hashes: vLLM's partial tails (FA + Mamba, one block a chunk)
                bs, hbs = sub.choice([(8, 4), (8, 2), (4, 2)])
                base.update(block_size=bs, hash_block_size=hbs, blocks_per_chunk=1, sliding_window=None,
                            extra_retained_tokens=0)
                base.pop("attention_chunk_size", None)
        # not with a Mamba group: a synchronous load on FA + SWA + Mamba "align" can make
        # allocate_slots raise (no free block) in vLLM 0.33.0 and the reference alike (not yet
        # understood; docs/offload.md)
        if sub.random() < 1 / 3 and not base.get("mamba_align"):
            base["sync_load_budget_bytes"] = sub.choice([64, 128, 256, 512, 10**6])
        if sub.random() < 1 / 4:  # drawn last: the draws above stay as they were
            base["prompt_logprobs_every"] = sub.choice([2, 3, 5])
        return cls(**base)


# kv_load_tiers values: matchers that parse, entries vLLM skips (unknown or non-string medium /
# locality, non-dict entries), an explicit [], all entries skipped, and a value that is not a list.
TIER_VALUES = ([], [{"medium": "cpu"}], [{"medium": "CPU", "locality": "local"}], [{"locality": "Remote"}], [{}],
               [{"medium": "disk"}], ["cpu"], "cpu", [{"medium": 3}], [{"medium": "storage"}, {"medium": "bogus"}],
               [{"medium": "cpu", "locality": "far"}, {"locality": "LOCAL"}], None)


def random_transfer_params(rng: Any) -> dict | None:
    """One request's ``kv_transfer_params``: None, or some of a tier filter and load / store caps
    (ints of a few chunks, 0, and values vLLM ignores: negative, bool, float, str)."""
    if rng.random() < 0.25:
        return None
    out: dict = {}
    if rng.random() < 0.5:
        out["kv_load_tiers"] = rng.choice(TIER_VALUES)
    if rng.random() < 0.5:
        out["max_load_tokens"] = rng.choice([0, 4, 7, 8, 12, 16, 24, -1, True, 8.0, "8"])
    if rng.random() < 0.5:
        out["max_offload_tokens"] = rng.choice([0, 4, 6, 8, 13, 16, -4, False, None])
    return out


def _vllm_backend(cfg: OffloadingConfig):
    from kvref.impl.vllm.offload import OffloadingVllmBackend

    return OffloadingVllmBackend(cfg)


BACKENDS = {"reference": OffloadingReferenceBackend, "vllm": _vllm_backend}


class OffloadingWorld(OffloadWorldBase):
    """``strict=False`` records content-model violations in ``violations`` instead of raising, so a
    trace that breaks an invariant in vLLM 0.33.0 too can be compared to the end."""

    def __init__(self, cfg: OffloadingConfig, backend: str = "reference", strict: bool = True) -> None:
        self.cfg = cfg
        self.strict = strict
        self.violations: list[str] = []
        try:
            self._b = BACKENDS[backend](cfg)
            self.startup_error: Exception | None = None
        except Exception as exc:  # noqa: BLE001 - reported by the first operation, see ``b``
            self._b, self.startup_error = None, exc
            self._backend_name = backend
        self.reqs: dict[str, WorldRequest] = {}
        self.order: list[str] = []
        self.prompts: dict[str, list[int]] = {}
        self.finished_pending: list[str] = []
        self.preempted_pending: set[str] = set()
        self.jobs: dict[int, dict] = {}  # job -> {"store": bool, "req": rid, "src": [...], "reported": n}
        self.gpu_content: dict[int, Any] = {}
        self.copies: list[tuple[int, list[tuple[int, int]]]] = []  # (step, copy-on-write pairs) per step with any
        self.partial_written: dict[int, int] = {}  # block -> tokens its last writer filled (partial tails)
        self.metas: list[tuple] = []
        self._n = 0
        self.reset_undelivered = False
        self.kv_events: list[dict] = []  # every KV cache event the connector published, in order
        self.hit_sources: list[tuple] = []  # (request, get_external_cache_hit_sources) per load
        self.stats: list[dict] = []  # the connector's get_stats after every step
        self.stats_compared: set[str] | None = None  # None: every metric; else only these names
        # has_pending_push_work after every step and every completion (the engine asks it before each
        # schedule(): a wrong False leaves reported jobs and a reset fence undelivered in an idle engine)
        self.push_work: list[bool] = []
        # (request, tokens, allocated) of every hit the connector answered to load synchronously
        self.sync_loads: list[tuple[str, int, bool]] = []

    @property
    def b(self):
        """The backend. One that failed to start on ``cfg`` (vLLM's connector refusing a configuration
        the reference serves: the chunked-local assert before PR 51161 crashed Llama 4 at startup)
        raises :class:`OffloadInvariantError` on the first operation, so a trace runner that builds
        worlds outside its per-operation error handling still reports it as a finding."""
        if self._b is None:
            raise OffloadInvariantError(f"the {self._backend_name} connector failed to start on {self.cfg}: "
                                        f"{type(self.startup_error).__name__}: {self.startup_error}")
        return self._b

    def check_started(self) -> None:
        """Raise the backend's startup failure, if any (every trace operation starts with it)."""
        self.b  # noqa: B018 - the property raises

    def _fail(self, msg):
        if self.strict:
            raise OffloadInvariantError(msg)
        self.violations.append(msg)

    def add_request(self, prompt, max_out=2):
        k = self.cfg.prompt_logprobs_every
        rid = super().add_request(prompt, max_out, prompt_logprobs=k > 0 and self._n % k == k - 1)
        self.prompts[rid] = list(prompt)
        params, i = self.cfg.kv_transfer_params, self._n - 1
        # every other arrival carries params (the others keep the uncapped lookups other checks need)
        self.b.on_new_request(self.reqs[rid].req, params[(i // 2) % len(params)] if params and i % 2 else None)
        return rid

    def _wait_for_remote_kvs(self, r, n_hit, n_ext):
        super()._wait_for_remote_kvs(r, n_hit, n_ext)
        # where the accepted external hit came from (vLLM's scheduler asks right after allocation)
        self.hit_sources.append((r.rid, tuple(self.b.hit_sources(r.req, n_ext))))

    def _key(self, r, g, pos):
        """The (group, hash) key of block ``pos`` of ``r``: the hash ending at the block's end."""
        per_block = self.cfg.block_size // self.cfg.tokens_per_hash()
        return make_block_hash_with_group_id(self.b.block_hashes(r.req)[(pos + 1) * per_block - 1], g)

    def _clip(self, r, n, n_hit=0):
        """``n`` new tokens after ``r.computed`` (+ a new local hit of ``n_hit``), clipped as vLLM's
        scheduler clips prefill chunks on a Mamba "align" pool (the reference's statement of
        ``_mamba_block_aligned_split``, conformance-checked against vLLM's by conform-scheduler)."""
        split = self.cfg.mamba_split()
        if split is None or n <= 0:
            return n
        return mamba_block_aligned_split(split, r.computed, r.req.num_prompt_tokens, r.req.num_tokens, n, n_hit)

    def step(self, chunk):
        # vLLM's schedule() starts every step so: the GPU cache forgets which blocks it cached in the
        # last step (a Mamba hit on a block cached in the same step waits a step; without this, every
        # later hit on such a block would wait forever)
        self.b.mgr.new_step_starts()
        batch = ScheduledBatch()
        lookups = []
        for rid in self.live("running"):
            r = self.reqs[rid]
            n = self._clip(r, min(chunk, r.req.num_tokens - r.computed))
            if n <= 0:
                continue
            ids = self.b.allocate(r.req, n)
            if ids is None:
                continue
            self.b.after_alloc(r.req, 0)
            batch.add(r, self.b.table(rid) if r.full_table_next else ids, r.full_table_next, n)
        for rid in self.live("waiting"):
            r = self.reqs[rid]
            hits, n_hit, n_ext = None, 0, 0
            load_async = True
            if r.computed == 0:
                hits, n_hit = self.b.get_computed_blocks(r.req)
                # vLLM's scheduler shows the connector a block-aligned local hit: a longer external
                # hit replaces a sub-block (partial-tail) local hit, a shorter one is dropped
                partial = n_hit % self.cfg.block_size
                n_ext, load_async = self.b.match(r.req, n_hit - partial)
                lookups.append((rid, n_hit, n_ext))
                if n_ext is None:
                    continue  # the connector asks to be asked again
                if partial and n_ext > partial:
                    hits, n_hit = self.b.mgr.truncate_computed_blocks(hits, n_hit - partial), n_hit - partial
                elif partial:
                    n_ext, load_async = 0, True
            if n_ext > 0 and not load_async:
                # A synchronous load: the blocks are allocated and hashed now, the worker fills them
                # before this step's forward pass, and the request computes the rest at once.
                n = self._clip(r, min(chunk, r.req.num_tokens - r.computed - n_hit - n_ext), n_hit + n_ext)
                allocated = n > 0 and self.b.allocate(r.req, n, n_hit, hits if n_hit else None, n_ext) is not None
                self.sync_loads.append((rid, n_ext, allocated))
                if not allocated:
                    continue  # the reservation stays spent for the step (vLLM keeps it too)
                self.b.after_alloc(r.req, n_ext)
                self.hit_sources.append((r.rid, tuple(self.b.hit_sources(r.req, n_ext))))
                self._schedule_waiting(batch, r, n_hit + n_ext, n)
                continue
            if n_ext > 0:
                if self.b.allocate(r.req, 0, n_hit, hits, n_ext, True) is None:
                    continue
                self._wait_for_remote_kvs(r, n_hit, n_ext)
                continue
            n = self._clip(r, min(chunk, r.req.num_tokens - r.computed - n_hit), n_hit)
            if n <= 0:
                continue
            if self.b.allocate(r.req, n, n_hit, hits if n_hit else None) is None:
                continue
            self.b.after_alloc(r.req, 0)
            self._schedule_waiting(batch, r, n_hit, n)
        # The step's output: the backend's (load jobs, store jobs, flushed jobs) and every connector
        # lookup of the step as (request, GPU hit tokens, tokens the connector offers to load) - a
        # lookup answer compared even when the allocation after it fails on both backends.
        step = self._scheduler_output(OffloadingStep, batch)
        # vLLM's schedule() drains the GPU cache's Mamba "align" boundary-state hand-offs every step
        step.boundary_state_offloads = self.b.take_boundary_state_offloads()
        self._record_handoffs(step.boundary_state_offloads)
        # ... and releases the blocks its copy-on-write pairs retained (sub-block Mamba hits)
        pairs = self.b.release_kv_cache_block_copies()
        step.kv_cache_block_copies = list(pairs)  # the connector sees them in the SchedulerOutput
        if pairs:  # (step, pairs): no entry on pools without copies (the explorer keys on the world)
            self.copies.append((len(self.metas), pairs))
        meta = (*self.b.build_meta(step), tuple(lookups))
        self._take_kv_events()
        stats = self.b.connector_stats()  # vLLM's engine collects them every step
        if self.stats_compared is not None:
            stats = {k: v for k, v in stats.items() if k in self.stats_compared}
        self.stats.append(stats)
        self.reset_undelivered = False
        self.metas.append(meta)
        loads, stores, flush, _ = meta
        flushed = set(flush)
        # Worker timing (offloading/worker.py): a store job is submitted at the start of the *next*
        # step, so it reads the blocks as this step's forward leaves them - unless it is flushed:
        # flushed jobs are submitted and waited for before the forward pass.
        for j in flushed:
            if j in self.jobs:
                self.jobs[j]["flushed"] = True
        for j, rid, keys, blocks, chunks in loads:
            self.jobs[j] = {"store": False, "req": rid, "src": [], "dst": blocks, "reported": 0}
        new_stores = []
        for j, rid, keys, blocks, chunks in stores:
            self.jobs[j] = {"store": True, "req": rid, "src": list(blocks), "reported": 0, "new": True,
                            "flushed": j in flushed}
            if j in flushed:
                self._check_store_source(j, blocks, rid, keys)
            else:
                new_stores.append((j, blocks, rid, keys))
        # The forward pass writes this step's tokens. A source of an earlier store still running may
        # only be overwritten if the job was flushed (waited for) - the fence, vLLM #41228.
        self._forward(batch)
        for j, blocks, rid, keys in new_stores:
            self._check_store_source(j, blocks, rid, keys)
        for job in self.jobs.values():
            job["new"] = False
        self._update_from_output(batch)
        self.push_work.append(self.b.pending_push_work())
        self.b.check_invariants()
        return meta

    def _check_store_source(self, j, blocks, rid=None, keys=()):
        for b in blocks:
            c = self.gpu_content.get(b)
            if c is not None and c[0] == "partial" and self._partial_tail_source(b, c, keys):
                continue
            if c is not None and c[0] == "state" and c[1] == rid:
                continue
            if c is None or c[0] == "partial":
                self._fail(f"store job {j} reads GPU block {b}, which holds {c!r}, not a full computed block")

    def _partial_tail_source(self, bid, content, keys) -> bool:
        """A partial-tail store (finer hashes) reads the attention block holding a hash boundary
        before the block is full: valid when the job's key of that group names a boundary inside
        the block, and the tokens written in the block reach it (appending past it keeps it)."""
        if self.cfg.tokens_per_hash() == self.cfg.block_size:
            return False
        rid, g, pos = content[1:4]
        written = self.partial_written[bid]
        hashes = [bytes(h) for h in self.b.block_hashes(self.reqs[rid].req)]
        bs = self.cfg.block_size
        for key in keys:
            if bytes(key[-4:]) == g.to_bytes(4, "big") and bytes(key[:-4]) in hashes:
                boundary = (hashes.index(bytes(key[:-4])) + 1) * self.cfg.tokens_per_hash()
                if pos * bs < boundary <= pos * bs + written:
                    return True
        return False

    def _record_handoffs(self, handoffs) -> None:
        """A Mamba state handed over inside a block (a partial tail, COW-ed into a block of its own
        that no table holds) holds the request's state at that boundary."""
        for rid, entries in handoffs.items():
            for g, bid, boundary in entries:
                if bid and boundary % self.cfg.block_size:
                    self.gpu_content[bid] = ("state", rid, g, boundary)

    def _write_computed(self, r, start, end):
        bs = self.cfg.block_size
        table = self.b.table(r.rid)
        for g, ids in enumerate(table):
            for pos in range(start // bs, (end - 1) // bs + 1 if end > start else start // bs):
                if pos < len(ids) and ids[pos] != 0:
                    bid = ids[pos]
                    old = self.gpu_content.get(bid)
                    # appending to the partial block a partial-tail store reads keeps what it reads
                    appends = old is not None and old[0] == "partial" and old[1:4] == (r.rid, g, pos)
                    for j, job in self.jobs.items():
                        if appends:
                            break
                        if job["store"] and bid in job["src"] and not job["new"] and not job.get("flushed"):
                            self._fail(f"GPU block {bid} (request {r.rid}, group {g}, position {pos}) is "
                                       f"overwritten while store job {j} may still read it and was not flushed")
                    full = (pos + 1) * bs <= end
                    hashed = (pos + 1) * bs <= len(self.b.block_hashes(r.req)) * self.cfg.tokens_per_hash()
                    self.gpu_content[bid] = self._key(r, g, pos) if full and hashed else ("partial", r.rid, g, pos)
                    self.partial_written[bid] = min(end, (pos + 1) * bs) - pos * bs

    def complete(self, pick, count=1):
        if not self.jobs:
            return False
        j = sorted(self.jobs)[pick % len(self.jobs)]
        job = self.jobs[j]
        count = min(count, self.cfg.num_workers - job["reported"])
        job["reported"] += count
        self.b.complete({j: count})
        self._take_kv_events()
        if job["reported"] >= self.cfg.num_workers:
            del self.jobs[j]
            if not job["store"]:
                for b in job["dst"]:
                    self.gpu_content[b] = ("loaded", b)
                self._update_waiting_for_remote_kv(self.reqs[job["req"]])
        self.push_work.append(self.b.pending_push_work())
        self.b.check_invariants()
        return True

    def _take_kv_events(self) -> None:
        """Drain the connector's KV cache events (stores and evictions of the step, stores a
        completion made readable) into ``kv_events``, which :meth:`observe` shows."""
        if self.cfg.kv_events != "off":
            self.kv_events.extend(self.b.take_kv_events())

    def finish(self, rid, aborted=True):
        r = self.reqs[rid]
        if r.phase == "done":
            return
        self.b.set_status(r.req, "aborted" if aborted else "finished")
        self.b.finished(r.req, aborted)
        self.b.free(r.req)
        r.phase = "done"
        self.finished_pending.append(rid)

    def _finish_stopped(self, rid):
        self.finish(rid, aborted=False)

    def reset(self):
        if self.reset_undelivered:
            return False  # vLLM forbids a second reset before a step has delivered the first's flush
        self.reset_undelivered = bool(self.jobs)
        self.b.reset()
        for job in self.jobs.values():
            job["flushed"] = True  # a reset flushes every job in flight
        return True

    def reset_gpu_prefix_cache(self) -> bool:
        """vLLM's ``Scheduler.reset_prefix_cache()`` without ``reset_connector``: only the GPU
        prefix cache, and only when no block is in use (a store still reading a block pins it)."""
        return self.b.mgr.reset_prefix_cache()

    def observe(self):
        gq = [b.block_id for b in self.b.gpu_pool.free_block_queue.get_all_free_blocks()]
        return {"gpu_free": gq, "chunks": self.b.chunk_state(), "phases": {k: v.phase for k, v in self.reqs.items()},
                "kv_events": self.kv_events, "hit_sources": self.hit_sources, "stats": self.stats,
                "push_work": self.push_work, "sync_loads": self.sync_loads, "copies": self.copies,
                "transfer_params": {rid: self.b.request_offload_state(rid) for rid in self.reqs}}
