"""The SimpleCPU connector's look-up and allocation hand-off at its edges, reference vs vLLM on
generated traces (issue #22).

The engine world (:mod:`kvref.models.offload.simple_cpu_world`) asks the connector only what
vLLM's ``Scheduler`` asks on the common path. Between the trace's operations this module probes a
waiting request, on every backend alike, with what the scheduler also does
(``vllm/v1/core/sched/scheduler.py``, ``SimpleCPUOffloadScheduler.get_num_new_matched_tokens`` /
``update_state_after_alloc``):

* a CPU hit is offered and pinned, then the scheduler takes none of it (a local partial tail that
  the remote hit does not exceed, a replay window): ``update_state_after_alloc(.., 0)`` must
  release the pin (the CPU block's ref count goes back);
* a local prefix that ends inside a block: no external look-up (loads copy whole blocks);
* a local prefix that already covers every full block: nothing left to look up;
* with a chunked-local attention group, a local prefix of whole blocks ending inside a chunk: no
  external look-up (chunk boundaries must be absolute positions);
* a request that does not read the prefix cache (prompt logprobs, pooling): no CPU hit either;
* external tokens reported with no pending hit: the load is skipped, nothing is pinned;
* a second look-up of the same request drops the first one's pin (a retry after a failed
  allocation);
* a CPU hit allocated as an async load that the connector has not yet sent to the worker, then a
  reset or an abort: the load is dropped at once, its pins released (half the time after the
  engine went idle and the GPU forgot its prefix cache, so that the prefix is on the CPU only).

Every answer, and then the whole observed state (pools, ref counts, pins, store cursors, KV
events, stats), must be the same on both backends.
"""

from __future__ import annotations

import contextlib
import logging
import random
from typing import Any

from kvref.models.offload.simple_cpu_world import SimpleOffloadConfig, SimpleOffloadWorld
from kvref.models.offload.traces import apply_op, random_ops
from kvref.models.offload.world_common import OffloadInvariantError

_VLLM_LOGGERS = ("vllm.v1.simple_kv_offload.manager", "vllm.v1.core.block_pool")


@contextlib.contextmanager
def _quiet():
    """vLLM's warnings for the probes (and a refused GPU prefix-cache reset) held back: they are
    provoked on purpose."""
    loggers = [logging.getLogger(name) for name in _VLLM_LOGGERS]
    was = [lg.disabled for lg in loggers]
    for lg in loggers:
        lg.disabled = True
    try:
        yield
    finally:
        for lg, w in zip(loggers, was):
            lg.disabled = w


def _waiting_new(w: SimpleOffloadWorld) -> list[str]:
    """Requests the scheduler has not looked up yet (waiting, nothing computed, no load)."""
    return [rid for rid in w.live("waiting") if w.reqs[rid].computed == 0 and rid not in w.loads]


def probe(w: SimpleOffloadWorld, rid: str, mid_block: int, retry: bool) -> tuple:
    """The edge calls on request ``rid`` of world ``w``; returns every answer."""
    b, bs = w.b, w.cfg.block_size
    req = w.reqs[rid].req
    out: list[Any] = []
    with _quiet():
        out.append(b.match(req, 0))  # may pin a CPU hit
        if retry:
            out.append(b.match(req, 0))  # the retry drops the first pin, pins again
        b.after_alloc(req, 0)  # the scheduler takes none of it: the pin is released
        out.append(b.match(req, bs * (req.num_tokens // bs)))  # every full block local already
        req.skip_reading_prefix_cache = True
        try:
            out.append(b.match(req, 0))  # reads no cache: no CPU hit
        finally:
            req.skip_reading_prefix_cache = False
        if w.cfg.local_chunk is not None and w.cfg.local_chunk > bs:
            # a chunked-local group: a local prefix of whole blocks ending inside a chunk looks
            # nothing up (an external suffix must start on a chunk boundary)
            out.append(b.match(req, bs))
        out.append(b.match(req, mid_block))  # a local prefix ending inside a block (drops any pin)
        b.after_alloc(req, bs)  # external tokens without a pending hit: the load is skipped
    return tuple(out)


def probe_unissued_load(w: SimpleOffloadWorld, rid: str, then_reset: bool, abort_pinned: bool = False) -> tuple:
    """Request ``rid`` of world ``w`` gets its CPU hit allocated as an async load, and before the
    next step issues it the connector is reset (``then_reset``) and the request is aborted (with
    ``abort_pinned`` it is aborted right after the look-up pinned the hit, before any allocation).
    Returns every answer. (A completion reported afterwards for that load is ignored by vLLM and
    refused by the reference, which takes it for a worker's bad report: not probed.)"""
    b, r = w.b, w.reqs[rid]
    req = r.req
    hits, n_local = b.get_computed_blocks(req)
    with _quiet():
        n_ext, is_async = b.match(req, n_local)
    if n_ext == 0:
        return n_local, n_ext, is_async
    if abort_pinned:  # aborted between the look-up and the allocation: the pin goes with it
        w.finish(rid)
        return n_local, n_ext, is_async, "aborted while pinned"
    ids = b.allocate(req, 0, n_local, hits if n_local else None, n_ext, True)
    if ids is None:  # no room: the pin stays until the next look-up drops it
        return n_local, n_ext, is_async, None
    b.after_alloc(req, n_ext)  # the load is planned; no load event yet
    reset = None
    if then_reset:  # a load never sent to the worker is dropped at once, its pins released
        reset = (w.reset(), w.b.connector_state(), [blk.ref_cnt for blk in w.b.cpu_pool.blocks],
                 [blk.ref_cnt for blk in w.b.gpu_pool.blocks])
    w.finish(rid)  # an un-issued load is released with the request
    return n_local, n_ext, is_async, len(ids[0]) if ids else 0, reset


def idle_and_forget_gpu(w: SimpleOffloadWorld, keep: str) -> bool:
    """Every live request but ``keep`` aborted, every transfer completed, then vLLM's
    ``reset_prefix_cache()`` without ``reset_connector``: the GPU forgets its prefix cache, the CPU
    keeps its blocks, so ``keep``'s look-up finds its prefix on the CPU only."""
    for rid in w.live():
        if rid != keep:
            w.finish(rid)
    while w.stores or w.loads:
        w.complete_store(0, 2)
        w.complete_load(0)
    with _quiet():
        return w.b.mgr.reset_prefix_cache()


def _answers(w: SimpleOffloadWorld, rid: str, mid_block: int, retry: bool, unissued: bool, then_reset: bool,
             forget_gpu: bool, abort_pinned: bool) -> tuple:
    """:func:`probe`'s (or :func:`probe_unissued_load`'s) answers, or the exception it raised."""
    try:
        if unissued:
            forgot = idle_and_forget_gpu(w, rid) if forget_gpu else None
            return forgot, *probe_unissued_load(w, rid, then_reset, abort_pinned)
        return probe(w, rid, mid_block, retry)
    except Exception as exc:  # noqa: BLE001 - either side may crash where the other does not
        return ("raised", type(exc).__name__, str(exc)[:200])


def run_lookup_edges(cfg: SimpleOffloadConfig, ops: list, seed: int, backends=("reference", "vllm")) -> dict:
    """``ops`` on one world per backend, a probe of a random new request after about every third
    operation; raises :class:`OffloadInvariantError` at the first difference. Returns counts."""
    rng = random.Random(f"simple-lookup-edges-{seed}")
    worlds = [SimpleOffloadWorld(cfg, be, allow_duplicates_within_event=True) for be in backends]
    stats = {"ops": 0, "probes": 0, "hits_declined": 0, "unissued_loads": 0, "dropped_by_reset": 0,
             "aborted_while_pinned": 0}
    for j, op in enumerate(ops):
        outs = [apply_op(w, op) for w in worlds]
        stats["ops"] += 1
        if outs[0] != outs[-1] or worlds[0].observe() != worlds[-1].observe():
            return stats  # the plain trace differs: conform-offload's own loop reports that
        if rng.random() < 0.5:
            continue
        if rng.random() < 0.7:  # an earlier request's tokens again: its blocks may be on the CPU
            pick, shorter = rng.randrange(100), rng.random() < 0.3
            for w in worlds:
                w.readd(pick, drop_last_block=shorter)
        candidates = _waiting_new(worlds[0])
        if not candidates or candidates != _waiting_new(worlds[-1]):
            continue
        rid = candidates[-1] if rng.random() < 0.7 else rng.choice(candidates)
        mid_block, retry = rng.randrange(1, cfg.block_size), rng.random() < 0.5
        unissued, then_reset, forget_gpu = rng.random() < 0.5, rng.random() < 0.5, rng.random() < 0.5
        abort_pinned = rng.random() < 0.25
        answers = [_answers(w, rid, mid_block, retry, unissued, then_reset, forget_gpu, abort_pinned) for w in worlds]
        stats["probes"] += 1
        if answers[0] != answers[-1] or answers[0][0] == "raised":
            raise OffloadInvariantError(f"op {j} {op}, {'un-issued load ' if unissued else ''}probe of {rid} "
                                        f"(mid-block {mid_block}, retry {retry}, reset {then_reset}): reference "
                                        f"answered {answers[0]}, vLLM {answers[-1]}")
        if unissued:
            stats["unissued_loads"] += len(answers[0]) > 5
            stats["dropped_by_reset"] += len(answers[0]) > 5 and then_reset
            stats["aborted_while_pinned"] += answers[0][-1] == "aborted while pinned"
        else:
            stats["hits_declined"] += answers[0][0][0] > 0
        seen = [w.observe() for w in worlds]
        if seen[0] != seen[-1]:
            diff = sorted(k for k in seen[0] if seen[0][k] != seen[-1].get(k))
            raise OffloadInvariantError(f"op {j} {op}, after the probe of {rid} (mid-block {mid_block}, retry "
                                        f"{retry}): {diff} differ: reference "
                                        f"{[seen[0][k] for k in diff]!r:.400}, vLLM {[seen[-1][k] for k in diff]!r:.400}")
        for w in worlds:
            w.b.check_invariants()
    return stats


def lookup_edge_cases(seed: int, n: int) -> list[tuple[SimpleOffloadConfig, list]]:
    """``n`` random SimpleCPU configurations with traces."""
    rng = random.Random(f"simple-lookup-edge-cases-{seed}")
    return [(SimpleOffloadConfig.random(rng), random_ops(rng, rng.randint(20, 40))) for _ in range(n)]


def run_lookup_edge_cases(seed: int, n: int) -> dict:
    """Every case of :func:`lookup_edge_cases`; raises naming the case at the first difference."""
    total = {"traces": 0, "ops": 0, "probes": 0, "hits_declined": 0, "unissued_loads": 0, "dropped_by_reset": 0,
             "aborted_while_pinned": 0}
    for i, (cfg, ops) in enumerate(lookup_edge_cases(seed, n)):
        try:
            got = run_lookup_edges(cfg, ops, seed * 1000 + i)
        except OffloadInvariantError as exc:
            raise OffloadInvariantError(f"SimpleCPU look-up edges, case {i} {cfg}: {exc}") from exc
        total["traces"] += 1
        for k, v in got.items():
            total[k] += v
    return total
