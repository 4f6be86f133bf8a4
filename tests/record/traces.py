"""Helpers for run-trace tests: setups, hand-written traces, record editing."""

from __future__ import annotations

import gzip
import json

from kvref.impl.interface import PoolConfig
from kvref.impl.reference.scheduler_liveness import max_blocks_per_request
from kvref.impl.scheduler_types import SchedulerConfig
from kvref.impl.run_trace.format import encode_tokens, sched_record, sched_rows
from kvref.impl.run_trace.writer import TraceWriter
from kvref.models.run_check.generate import header_for
from kvref.spec.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

ATTN = dict(num_kv_heads=1, head_size=8, dtype="float16")


def hybrid_setup(num_blocks: int | None = 40, async_scheduling: bool = False, window: int = 8, block_size: int = 4,
                 max_model_len: int = 64, budget: int = 32, max_num_seqs: int = 4, caching: bool = True):
    groups = (KVCacheGroupSpec(("full",), FullAttentionSpec(block_size=block_size, **ATTN)),
              KVCacheGroupSpec(("swa",), SlidingWindowSpec(block_size=block_size, sliding_window=window, **ATTN)))
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, async_scheduling=async_scheduling)
    if num_blocks is None:  # the smallest pool startup accepts: one max_model_len request (preemption storms)
        probe = PoolConfig(num_blocks=1, groups=groups, max_model_len=max_model_len, scheduler_block_size=block_size,
                           hash_block_size=block_size, max_in_flight_tokens=cfg.max_in_flight_tokens)
        num_blocks = max_blocks_per_request(probe, cfg) + 1
    pool = PoolConfig(num_blocks=num_blocks, groups=groups, max_model_len=max_model_len,
                      scheduler_block_size=block_size, hash_block_size=block_size,
                      max_in_flight_tokens=cfg.max_in_flight_tokens, enable_caching=caching)
    return pool, cfg


def full_setup(num_blocks: int = 20, budget: int = 16, max_model_len: int = 32):
    groups = (KVCacheGroupSpec(("full",), FullAttentionSpec(block_size=4, **ATTN)),)
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=4)
    pool = PoolConfig(num_blocks=num_blocks, groups=groups, max_model_len=max_model_len, scheduler_block_size=4,
                      hash_block_size=4, max_in_flight_tokens=cfg.max_in_flight_tokens)
    return pool, cfg


def add(rid: str, prompt, max_tokens: int = 4, arrival: float = 0.0, x=None) -> dict:
    rec = {"t": "add", "id": rid, "prompt": encode_tokens(prompt), "max_tokens": max_tokens, "stop": [],
           "salt": None, "priority": 0, "arrival": arrival}
    if x:
        rec["x"] = x
    return rec


def sched(step: int, rows, pre=(), fin=()) -> dict:
    """A ``sched`` record from rows ``[id, kind (n/r/c), tokens, computed, block ids or None]``."""
    return sched_record(step, rows, pre, fin)


def update(step: int, sampled: dict, fin=()) -> dict:
    """An ``update`` record: ``sampled`` maps id -> tokens (every id the step scheduled)."""
    return {"t": "update", "step": step, "ids": list(sampled), "sampled": list(sampled.values()),
            "fin": [list(f) for f in fin]}


def write_trace(path, header: dict, records: list[dict], end: bool = True) -> str:
    w = TraceWriter(str(path), header, background=False)
    for r in records:
        w.write(r)
    steps = sum(r["t"] == "sched" for r in records)
    w.close({"t": "end", "steps": steps, "records": len(records) + 1} if end else None)
    return str(path)


def read_lines(path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f]


def rewrite(path, out, edit, version: int | None = None) -> str:
    """Copy a trace, calling ``edit(record)`` on each record (header excluded); returns ``out``
    (``version``: the copy's header says this format version)."""
    lines = read_lines(path)
    header, records = lines[0], lines[1:]
    if version is not None:
        header = {**header, "version": version}
    records = [edit(r) or r for r in records]
    end = records and records[-1]["t"] == "end"
    w = TraceWriter(str(out), header, background=False)
    for r in records[:-1] if end else records:
        w.write(r)
    w.close(records[-1] if end else None)
    return str(out)


def without(path, out, kind: str) -> str:
    """Copy a gzipped trace leaving out every record of type ``kind`` (the header kept verbatim);
    returns ``out``: a replay of the copy shows what those records carried."""
    with gzip.open(path, "rt") as f:
        header, *lines = f.readlines()
    with gzip.open(out, "wt") as f:
        f.write(header)
        f.writelines(line for line in lines if json.loads(line)["t"] != kind)
    return str(out)


__all__ = ["add", "full_setup", "header_for", "hybrid_setup", "read_lines", "rewrite", "sched", "sched_rows", "update",
           "without", "write_trace"]


def assert_agrees_and_holds(path, result) -> None:
    """A recorded run ``check_trace`` followed to the end, agreeing at every step, whose run
    properties hold on their own too (``--properties-only``)."""
    from kvref.models.run_check import check_trace

    r = result
    assert r.followed and r.verdict == "agrees", (path, r.stopped_because, r.findings[:2],
                                                  r.divergence and r.divergence.table())
    assert r.steps_compared == r.summary["steps"]
    p = check_trace(path, properties_only=True)
    assert p.verdict == "properties hold", (path, p.findings[:3])


def followed_runs(runs, header_check=None) -> list:
    """The non-empty ones of ``runs`` (recorded pristine), each asserted followed to the end,
    agreeing at every step (the checker's own invariants asserted after every record) and holding
    every property alone; ``header_check(header)`` asserts what each header must say."""
    from kvref.models.run_check import check_trace

    out = []
    for run in runs:
        if header_check is not None:
            header_check(read_lines(run.path)[0])
        r = check_trace(run.path, check_invariants_every=1)
        if r.empty:
            continue
        assert_agrees_and_holds(run.path, r)
        out.append(run)
    return out


def flagged_runs(runs, kinds=frozenset(), on_divergence=None) -> tuple[int, int]:
    """Over ``runs`` recorded from a vLLM with a fault planted: ``(flagged, flagged by the properties
    too)``. Every run check-run flags must diverge (not only a property); ``on_divergence(d)``
    asserts more about each divergence; with ``kinds``, ``--properties-only`` must report one of
    those property kinds on every flagged run it flags."""
    from kvref.models.run_check import check_trace

    flagged = props = 0
    for run in runs:
        r = check_trace(run.path)
        if r.empty or r.verdict == "agrees":
            continue
        flagged += 1
        assert r.divergence is not None, (run.path, r.findings[:2])
        if on_divergence is not None:
            on_divergence(r.divergence)
        p = check_trace(run.path, properties_only=True)
        props += p.verdict != "properties hold"
        if kinds:
            assert {f.kind for f in p.findings} & set(kinds), p.findings[:3]
    return flagged, props


def pristine_and_faulty_runs(tmp_path_factory, draws: dict, faults: dict, steps: int):
    """A module fixture's getter: feature -> (its pristine recorded runs, the same draws recorded on a
    vLLM with the feature's fault planted), recorded once per feature. ``draws``: feature -> (seed,
    runs); ``faults``: feature -> the fault's name in kvref/impl/vllm/record_faults.py."""
    from kvref.impl.vllm.record_faults import plant_feature_fault
    from kvref.models.run_check.feature_runs import record_feature_runs

    from tests.vllm_env import require_vllm

    cache: dict = {}

    def get(feature: str):
        require_vllm()
        if feature not in cache:
            seed, n = draws[feature]
            d = tmp_path_factory.mktemp(feature)
            pristine = record_feature_runs(d / "pristine", feature, n, seed=seed, steps=steps)
            with plant_feature_fault(faults[feature]):
                faulty = record_feature_runs(d / "faulty", feature, n, seed=seed, steps=steps, strict=False)
            cache[feature] = (pristine, faulty)
        return cache[feature]

    return get
