"""The OffloadingConnector world with real bytes: vLLM's whole connector (scheduler and worker
roles, :class:`kvref.impl.vllm.offload_worker.OffloadingConnectorVllmBackend`) against the
reference backend, trace by trace, with a byte oracle.

:class:`OffloadingWorkerWorld` is :class:`~kvref.models.offload.offloading_connector_world.OffloadingWorld`
plus two facts of vLLM's worker (``offloading/worker.py``):

* a store job is handed to the transfer worker at the *next* step's ``start_load_kv`` (or at once
  when the step's ``jobs_to_flush`` names it), a load job in its own step; a transfer can only
  finish once handed over, so :meth:`OffloadingWorkerWorld.complete` picks among those
  (:meth:`completable`), on every backend alike;
* the forward pass writes bytes: every computed GPU block holds, on rank ``r``, a digest of the
  (group, block hash) it was computed for and of ``r`` (:func:`block_content`), partial blocks a
  digest of where they are. When a load finishes on a rank, each GPU block it filled must hold the
  digest of the block the loading request has at that place — what computing it would have
  written. The bytes travel GPU → host chunk → GPU through vLLM's registered views, specs and
  chunk ids, so a wrong block, chunk, sub-page, group, rank or a chunk overwritten before the load
  shows up as a wrong digest.

The worker half must also report what it ran: the aggregated ``completed_jobs`` equal the
completions the trace delivered, no ``finished_sending``, and ``finished_recving`` names a request
exactly when the last rank finishes an asynchronous load (a synchronous one, waited for before the
forward pass of the step that scheduled its request, names none).
"""

from __future__ import annotations

import hashlib
from typing import Any

from kvref.models.machines.file_mapper import check_spec_file_mappers
from kvref.models.offload.offloading_connector_world import BACKENDS, OffloadingWorld
from kvref.models.offload.traces import apply_offloading_op
from kvref.models.offload.world_common import OffloadInvariantError


def block_content(content: Any, rank: int, size: int) -> bytes:
    """The bytes rank ``rank``'s forward pass writes into a block holding ``content``."""
    return hashlib.blake2b(repr((content, rank)).encode(), digest_size=64).digest()[:size].ljust(size, b"\0")


def _connector_backend(cfg):
    from kvref.impl.vllm.offload_worker import OffloadingConnectorVllmBackend

    return OffloadingConnectorVllmBackend(cfg)


def _canonical_connector_backend(cfg):
    from kvref.impl.vllm.offload_worker import OffloadingConnectorVllmBackend

    return OffloadingConnectorVllmBackend(cfg, canonical_layout=True)


BACKENDS.setdefault("vllm-connector", _connector_backend)
BACKENDS.setdefault("vllm-connector-canonical", _canonical_connector_backend)


class OffloadingWorkerWorld(OffloadingWorld):
    """``backend="vllm-connector"``: vLLM's whole connector with bytes (``"vllm-connector-canonical"``:
    with ``canonical_layout``, the host pages in the parallelism-free canonical layout every rank
    writes its share of); ``"reference"``: kvref's reference backend under the same handover rule."""

    def __init__(self, cfg, backend: str = "reference", strict: bool = True) -> None:
        # This machine publishes and compares the CPU tier's events itself (placeholders, through
        # vLLM's KV-event aggregation); the events and per-request params conform-offload draws on
        # the scheduler alone stay off here, so its traces are the ones it was written for.
        from dataclasses import replace

        # A Mamba "align" group stays with conform-offload too: the worker's byte layout here is
        # attention pages only (the recurrent state's page is another shape).
        # Hashes finer than the blocks come only with the Mamba group (vLLM's partial tails): they go too.
        # Synchronous loads run here (#22): the worker waits for them before the forward pass and
        # reports them without a finished_recving (their request already runs).
        cfg = replace(cfg, kv_events="off", kv_transfer_params=(), mamba_align=False, hash_block_size=None)
        super().__init__(cfg, backend, strict)
        # vLLM's whole connector also reports the workers' transfer metrics (bytes, times) and its
        # CPU cache's byte size (info), which depend on the worker's page layout: only the
        # scheduler's and the CPU manager's metrics are compared here.
        self.stats_compared = {"lookup_sync_delay_seconds", "lookup_async_delay_seconds", "allocation_failure",
                               "cpu_cache_usage_perc", "cpu_cache_write_usage_perc", "cpu_cache_read_usage_perc",
                               "cpu_allocation_size", "stores_skipped"}
        self.steps = 0
        self.sync_jobs: set[int] = set()  # load jobs of synchronous loads (no finished_recving)
        self.created: dict[int, int] = {}  # store job -> step that created it
        self.flushed_by_meta: set[int] = set()
        self.loads_checked = 0
        self.blocks_checked = 0
        self.had_reset = False
        self.known_corruption: str | None = None
        self.published: list[list] = []  # vLLM's KV-event batches (its event objects), one per op that had any
        if self._b is not None and not hasattr(self._b, "workers"):
            self._b.manager.events = []  # the reference manager records its events (vLLM's: kv_events_config)

    def take_kv_events(self) -> list[dict]:
        """The CPU tier's KV cache events since the last call, as plain dicts: vLLM's connector's
        ``take_events``, or the reference's (:func:`offloading_kv_events` of its manager's events)."""
        if self._b is None:
            return []
        if hasattr(self._b, "workers"):
            from kvref.impl.vllm.kv_events import vllm_event_to_plain

            raw = self._b.take_kv_events()
            if raw:
                self.published.append(raw)
            return [vllm_event_to_plain(e) for e in raw]
        from kvref.impl.reference.kv_events import event_to_plain, use_int_block_hashes
        from kvref.impl.reference.offload.offload_events import offloading_kv_events

        return [event_to_plain(e) for e in offloading_kv_events(self._b.manager.take_events(), use_int_block_hashes())]

    @property
    def _bytes(self):
        return self._b if hasattr(self._b, "workers") else None

    def step(self, chunk):
        seen = len(self.sync_loads)
        meta = super().step(chunk)
        self.steps += 1
        loads, stores, flush, _ = meta
        sync_reqs = {rid for rid, _, allocated in self.sync_loads[seen:] if allocated}
        for j, rid, *_ in loads:
            if rid in sync_reqs:
                # every rank waited for it before this step's forward pass: its bytes are in place
                # now (the driver reports it later, when the request may have let its blocks go)
                self.sync_jobs.add(j)
                if self._bytes is not None:
                    self._check_loaded(j, self.jobs[j], range(self.cfg.num_workers))
        for j, *_ in stores:
            self.created[j] = self.steps
        self.flushed_by_meta |= set(flush)
        return meta

    def _forward(self, batch) -> None:
        before = dict(self.gpu_content)
        super()._forward(batch)
        b = self._bytes
        if b is None:
            return
        for block, content in self.gpu_content.items():
            if before.get(block) != content:
                for rank in range(len(b.workers)):
                    b.write_block(rank, block, block_content(content, rank, b.page))
        b.after_forward()

    def reset(self):
        done = super().reset()
        self.had_reset = self.had_reset or bool(done)
        return done

    def completable(self) -> list[int]:
        """Jobs the worker has been handed: loads at once, stores from the next step or a flush."""
        return [j for j in sorted(self.jobs)
                if not self.jobs[j]["store"] or self.created.get(j, self.steps) < self.steps
                or j in self.flushed_by_meta]

    def complete(self, pick, count=1):
        ready = self.completable()
        if not ready:
            return False
        j = ready[pick % len(ready)]
        job = dict(self.jobs[j])
        sync = j in self.sync_jobs
        rank0 = job["reported"]
        b = self._bytes
        if b is not None:
            # a load for a request the trace aborted: this world freed its blocks at once (vLLM defers
            # the free until the load ends), so the late load must not write into their new owners
            b.write_next = job["store"] or self.reqs[job["req"]].phase != "done"
        done = super().complete(sorted(self.jobs).index(j), count)
        if b is not None:
            ranks = range(rank0, min(rank0 + count, self.cfg.num_workers))
            last = rank0 + len(ranks) >= self.cfg.num_workers
            recv = b.finished_recving[-1]
            want = {job["req"]} if (not job["store"] and last and not sync) else set()
            if recv != want:
                raise OffloadInvariantError(
                    f"job {j}: the workers' finished_recving is {sorted(recv)}, expected {sorted(want)}")
            if not job["store"] and not sync:
                self._check_loaded(j, job, ranks)
        if j not in self.jobs:
            self.created.pop(j, None)
            self.flushed_by_meta.discard(j)
            self.sync_jobs.discard(j)
        return done

    def _check_loaded(self, j, job, ranks) -> None:
        b = self._bytes
        r = self.reqs[job["req"]]
        if r.phase == "done":
            return  # aborted while loading: the world frees its blocks at once (vLLM defers it), no bytes to own
        table = b.table(r.rid)
        self.loads_checked += 1
        for block in job["dst"]:
            where = [(g, pos) for g, ids in enumerate(table) for pos, x in enumerate(ids) if x == block]
            if not where:
                raise OffloadInvariantError(
                    f"load job {j} filled GPU block {block}, which request {r.rid} does not hold")
            g, pos = where[0]
            for rank in ranks:
                want = block_content(self._key(r, g, pos), rank, b.page)
                self.blocks_checked += 1
                got = b.block_bytes(rank, block)
                if got != want:
                    # foreign KV, not KV never loaded (the scrubbed block: a load that did not run)
                    if self.had_reset and self.cfg.sliding_window is not None and got != b.unloaded:
                        # vLLM 0.33.0 after a connector reset stores stale sliding-window ids under a
                        # request's chunk keys (docs/offload.md "Found"): foreign KV comes back
                        self.known_corruption = f"load job {j}, GPU block {block}, after a connector reset"
                        return
                    raise OffloadInvariantError(
                        f"load job {j} (request {r.rid}) left GPU block {block} (group {g}, position {pos}) on rank "
                        f"{rank} with other bytes than that block's computed KV")


def stored_runs_sorted(events: list[dict]) -> list[dict]:
    """``events`` with every maximal run of consecutive ``BlockStored`` events in a canonical order.

    vLLM 0.33.0's scheduler keeps a store job's keys in a ``set`` (``TransferJobStatus.keys``), so
    the manager completes them, and the tracker announces them, in set iteration order: an order
    of the hash values, not of the request (docs/differences.md). Removals and the position of
    every removal relative to the stores stay as emitted."""
    out: list[dict] = []
    run: list[dict] = []
    for e in events + [None]:
        if e is not None and e["type"] == "BlockStored":
            run.append(e)
            continue
        out.extend(sorted(run, key=repr))
        run = []
        if e is not None:
            out.append(e)
    return out


def apply_worker_op(w: OffloadingWorkerWorld, op):
    """:func:`~kvref.models.offload.traces.apply_offloading_op`, with ``drain`` completing what the
    workers have been handed (a store queued this step waits for the next)."""
    if op[0] == "drain":
        w.check_started()
        out = []
        while w.completable():
            out.append(w.complete(-1 if op[-1] else 0, 2))
        return out
    return apply_offloading_op(w, op)


#: chunk-size option values: ints, multiples and non-multiples of the block, values int() reads
#: (numeric strings, floats), zero and negative counts, and values int() refuses
CHUNK_VALUES = (1, 2, 3, 4, 8, 12, 6, "2", "8", 2.7, 0, -1, "x", "")


def run_chunk_configs(rng, n: int) -> dict:
    """``n`` chunk-size options (``blocks_per_chunk`` and/or ``block_size`` in
    ``kv_connector_extra_config``) through vLLM's ``build_offloading_config`` and the reference's
    :func:`~kvref.impl.reference.offload.chunk_config.blocks_per_chunk`: both refuse, or both give the
    same blocks per chunk and every group the same sliding-window size in chunks. A ``block_size``
    of 0 or less is left out of the draw (vLLM 0.33.0 accepts it; kvref refuses: docs/differences.md).
    Raises :class:`OffloadInvariantError` at the first difference."""
    from kvref.impl.reference.offload.chunk_config import blocks_per_chunk
    from kvref.impl.reference.offload.keys import get_sliding_window_size_in_chunks
    from kvref.impl.vllm.offload import vllm_kv_cache_manager
    from kvref.impl.vllm.offload_worker import vllm_offloading_chunk_config
    from kvref.models.offload.offloading_connector_world import OffloadingConfig
    from kvref.spec.errors import InvalidFieldError

    out = {"chunk_configs": 0, "chunk_configs_refused": 0}
    for i in range(n):
        cfg = OffloadingConfig.random(rng)
        groups = cfg.kvref_groups()
        opts: dict = {}
        # every value within len(CHUNK_VALUES) draws, every value in every form within 5 times that
        form = ("blocks", "tokens", "both", "tokens", "neither")[i % 5]
        if form in ("blocks", "both"):
            opts["blocks_per_chunk"] = CHUNK_VALUES[i % len(CHUNK_VALUES)]
        if form in ("tokens", "both"):
            value = CHUNK_VALUES[i % len(CHUNK_VALUES)] if form == "tokens" else rng.choice(CHUNK_VALUES)
            opts["block_size"] = value * cfg.block_size if type(value) is int and rng.random() < 0.5 else value
            if type(opts["block_size"]) is int and opts["block_size"] <= 0:
                opts["block_size"] = cfg.block_size  # vLLM's finding, not drawn (see above)
        try:
            ref = blocks_per_chunk(opts, [g.kv_cache_spec.block_size for g in groups])
            ref_windows = tuple(get_sliding_window_size_in_chunks(g.kv_cache_spec, cfg.block_size * ref)
                                for g in groups)
        except InvalidFieldError as exc:
            ref, ref_windows = None, str(exc)
        _, kcfg, _ = vllm_kv_cache_manager(cfg)
        try:
            got, windows = vllm_offloading_chunk_config(cfg, kcfg, opts)
        except (ValueError, AssertionError, TypeError) as exc:  # vLLM's refusals (int() of a non-number: TypeError)
            got, windows = None, f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # noqa: BLE001 - a crash where vLLM should refuse or answer is a finding
            raise OffloadInvariantError(f"chunk options {opts} on {cfg}: vLLM build_offloading_config crashed "
                                        f"({type(exc).__name__}: {exc}); reference {ref} {ref_windows}") from exc
        out["chunk_configs"] += 1
        out["chunk_configs_refused"] += ref is None
        if (ref is None) != (got is None) or (ref is not None and (ref, ref_windows) != (got, windows)):
            raise OffloadInvariantError(f"chunk options {opts} on {cfg}: reference {ref} {ref_windows}, "
                                        f"vLLM build_offloading_config {got} {windows}")
    return out


#: the KV-event batches run_traces keeps for the publisher round trip
MAX_BATCHES = 24


def run_traces(cases, on_difference=None) -> dict:
    """Run ``cases`` (``(OffloadingConfig, ops)``) on the reference and on vLLM's whole connector,
    comparing the CPU tier's KV events after every op too (``stats["batches"]``: the first
    :data:`MAX_BATCHES` batches vLLM's connector produced, its event objects).

    Returns counts, or raises :class:`OffloadInvariantError` (content model, worker reports) /
    ``AssertionError`` (vLLM's own asserts, the driver's handover checks) with the trace position,
    or reports the first observable difference through ``on_difference(i, j, cfg, op, outs)`` (which
    returns True to stop the trace)."""
    stats = {"traces": 0, "ops": 0, "loads_checked": 0, "blocks_checked": 0, "jobs_executed": 0, "events": 0,
             "stopped_at_shared_breach": 0,
             "stopped_at_known_corruption": 0, "batches": []}
    from dataclasses import replace
    import random

    cases = list(cases)
    stats.update(run_chunk_configs(random.Random(f"chunk-configs-{len(cases)}"), max(16, 2 * len(cases))))
    for i, (cfg, ops) in enumerate(cases):
        cfg = replace(cfg, mamba_align=False, hash_block_size=None)  # as OffloadingWorkerWorld
        if i % 3 == 2 and not cfg.sync_load_budget_bytes:  # every third trace loads small hits at once (#22)
            cfg = replace(cfg, sync_load_budget_bytes=(128, 512, 10**6)[i // 3 % 3])
        # content-model breaches are recorded (strict=False), compared, and end the trace: vLLM 0.33.0
        # has one the reference shares (docs/offload.md "Found": stale sliding-window stores after a
        # connector reset), after which loaded bytes may rightly differ from computed ones
        worlds = [OffloadingWorkerWorld(cfg, "reference", strict=False),
                  OffloadingWorkerWorld(cfg, "vllm-connector-canonical" if i % 2 == 1 else "vllm-connector",
                                        strict=False)]
        stats["traces"] += 1
        if worlds[1]._b is not None:  # where a file tier would keep this engine's chunks
            asked = i % 2 == 1
            groups = [(cfg.block_size, g.layer_names) for g in cfg.kvref_groups()]
            # parallelism-agnostic folders only for what is (build_offloading_config's certification):
            # the ranks' heads (1 each) make up the model's 2 KV heads, and one full-attention group
            # or, with the canonical layout, only full-attention and sliding-window groups
            canonical = i % 2 == 1
            agnostic = asked and cfg.num_workers == 2 and (
                cfg.attention_chunk_size is None if canonical else len(groups) == 1)
            bad = check_spec_file_mappers(worlds[1]._b.file_mappers("/kvref-files", 1 + i % 3, asked), cfg,
                                          groups, 1 + i % 3, agnostic, canonical)
            if bad:
                worlds[1]._b.shutdown()
                raise OffloadInvariantError(f"trace {i}: {bad}")
        both_stepped = True  # every op ran on both worlds: their per-step stats line up (offload_stats)
        try:
            for j, op in enumerate(ops):
                try:
                    outs = [apply_worker_op(w, op) for w in worlds]
                except KeyError:
                    both_stepped = False
                    break  # vLLM 0.33.0's KeyError after a connector reset (docs/offload.md); reference survives
                except (AssertionError, OffloadInvariantError) as exc:
                    raise type(exc)(f"trace {i} op {j} {op} on {cfg}: {exc}") from exc
                stats["ops"] += 1
                if worlds[0].violations != worlds[1].violations:
                    raise OffloadInvariantError(
                        f"trace {i} op {j} {op} on {cfg}: content-model breaches differ: reference "
                        f"{worlds[0].violations} / vLLM {worlds[1].violations}")
                events = [w.take_kv_events() for w in worlds]
                if stored_runs_sorted(events[0]) != stored_runs_sorted(events[1]):
                    raise OffloadInvariantError(
                        f"trace {i} op {j} {op} on {cfg}: the CPU tier's KV events differ: reference "
                        f"{events[0]!r}"[:700] + f" / vLLM {events[1]!r}"[:700])
                stats["events"] += len(events[1])
                if outs[0] != outs[1] or worlds[0].observe() != worlds[1].observe():
                    if on_difference is None or on_difference(i, j, cfg, op, outs):
                        raise OffloadInvariantError(
                            f"trace {i} op {j} {op} on {cfg}: reference and vLLM's connector differ: "
                            f"{outs[0]!r}"[:600] + f" / {outs[1]!r}"[:600])
                    break
                if worlds[1].violations:
                    stats["stopped_at_shared_breach"] += 1
                    break
                if worlds[1].known_corruption:
                    stats["stopped_at_known_corruption"] += 1
                    break
            payloads = getattr(worlds[1]._b, "stats_payloads", None)
            if both_stepped and payloads:  # what the metrics endpoint reports over the trace (#22)
                from kvref.models.machines.offload_stats import compare_interval

                bad = compare_interval(worlds[0].stats, payloads, worlds[0].stats_compared,
                                       random.Random(f"offload-stats-{i}"))
                if bad:
                    raise OffloadInvariantError(f"trace {i} on {cfg}: {bad}")
                stats["stats_intervals"] = stats.get("stats_intervals", 0) + 1
        finally:
            v = worlds[1]
            stats["loads_checked"] += v.loads_checked
            stats["blocks_checked"] += v.blocks_checked
            stats["batches"] += v.published[:max(0, MAX_BATCHES - len(stats["batches"]))]
            if v._b is not None:
                stats["jobs_executed"] += sum(len(h.log.executed) for h in v._b.host)
                stats["sync_loads"] = stats.get("sync_loads", 0) + sum(len(h.log.expedited) for h in v._b.host)
                v._b.shutdown()
    return stats
