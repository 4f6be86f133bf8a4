"""conform-offload's OffloadingConnector generators reach the behaviour classes issue #13 found escaping.

Four vLLM source faults in the OffloadingConnector survived ``kvref verify --against vllm`` because
the generated configurations and traces never took their paths: a CPU chunk evicted inside a run
of cached chunks and a lookup across the gap (full-attention prefix scan, sliding-window scan),
windows widened by multi-module MTP's ``extra_retained_tokens`` (PR 41228), chunked-local groups
(PR 51161). These tests run exactly the OffloadingConnector cases ``kvref verify`` draws at the
``fast`` profile (seed 0) on the *reference* and count, with counters that can stay zero, that
each path is taken *and decides something*: the answer of a scan that ignored a miss would differ.
No vLLM needed; ``tests/conformance/test_offload_fault_classes.py`` shows the planted faults die.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from kvref.impl.reference.offload import lookup as lookup_mod
from kvref.impl.reference.offload.keys import LookupResult, get_offload_group_idx
from kvref.models.offload.offloading_connector_world import (
    OffloadingConfig,
    OffloadingWorld,
)
from kvref.models.offload.traces import apply_offloading_op
from kvref.spec.mathutil import cdiv

HIT = (LookupResult.HIT, LookupResult.HIT_PENDING)


def _cases(n=80, seed=0):
    from kvref.verify import _offload_cases

    return [(cfg, ops) for cfg, ops in _offload_cases(random.Random(seed), n) if isinstance(cfg, OffloadingConfig)]


def _window_ignoring_misses(res, window, initial):
    """The sliding-window scan with its streak kept across a miss (the class of
    ``offl.window_lookup_miss_keeps_streak``)."""
    run, need = 0, initial or window
    for idx in range(len(res) - 1, -1, -1):
        if res[idx] in HIT:
            run += 1
        else:
            need = window
        if run == need:
            return idx + need
    return run


@pytest.fixture(scope="module")
def reach():
    counts: Counter = Counter()
    prefix, window = lookup_mod.maximal_prefix_lookup, lookup_mod.sliding_window_lookup

    def counting_prefix(keys, lookup):
        res = [lookup(k) for k in keys]
        got = prefix(keys, lookup)
        if got is not None and sum(r in HIT for r in res) != got:
            counts["prefix_hits_after_a_miss"] += 1
        return got

    def counting_window(keys, w, lookup, initial_window=None):
        res = [lookup(k) for k in keys]
        got = window(keys, w, lookup, initial_window)
        if LookupResult.MISS in res:
            counts["window_scans_with_a_miss"] += 1
            if got is not None and _window_ignoring_misses(res, w, initial_window) != got:
                counts["window_streak_decides"] += 1
        return got

    mp = pytest.MonkeyPatch()
    mp.setattr(lookup_mod, "maximal_prefix_lookup", counting_prefix)
    mp.setattr(lookup_mod, "sliding_window_lookup", counting_window)
    try:
        for cfg, ops in _cases():
            w = OffloadingWorld(cfg, "reference")
            for op in ops:
                apply_offloading_op(w, op)
            tpc = cfg.block_size * cfg.blocks_per_chunk
            loads = [job for meta in w.metas for job in meta[0]]
            counts["loads"] += len(loads)
            if cfg.sliding_window is not None and cdiv(cfg.sliding_window, tpc) < cdiv(
                    cfg.sliding_window - 1 + cfg.extra_retained_tokens, tpc):
                counts["widened_window_configs"] += 1
                # PR 41228: a load restoring more sliding-window chunks than cdiv(sw, chunk)
                counts["widened_window_loads"] += sum(
                    sum(get_offload_group_idx(k) == 1 for k in keys) > cdiv(cfg.sliding_window, tpc)
                    for _, _, keys, _, _ in loads)
            if cfg.attention_chunk_size is not None:
                local = len(w.b.conn.groups) - 1
                counts["chunked_local_configs"] += 1
                counts["chunked_local_stores"] += sum(get_offload_group_idx(k) == local for meta in w.metas
                                                      for _, _, keys, _, _ in meta[1] for k in keys)
                counts["chunked_local_loads"] += sum(get_offload_group_idx(k) == local for _, _, keys, _, _ in loads
                                                     for k in keys)
            counts["lookups_compared"] += sum(len(meta[3]) for meta in w.metas)
            if cfg.kv_transfer_params:
                counts["transfer_params_configs"] += 1
                capped = {rid for rid in w.reqs if (cap := w.b.request_offload_state(rid)) and cap[1] is not None}
                capped |= {rid for rid in w.reqs if int(rid[1:]) % 2 and (p := cfg.kv_transfer_params[
                    int(rid[1:]) // 2 % len(cfg.kv_transfer_params)]) and type(p.get("max_load_tokens")) is int
                    and p["max_load_tokens"] >= 0}
                counts["capped_lookups"] += sum(rid in capped and bool(n_ext) for meta in w.metas
                                                for rid, _, n_ext in meta[3])
                tiers = {repr(p.get("kv_load_tiers")) for p in cfg.kv_transfer_params if p and "kv_load_tiers" in p}
                counts["tier_values"] += len(tiers)
            counts["hit_sources"] += len(w.hit_sources)
            if cfg.kv_events != "off":
                counts[f"{cfg.kv_events}_configs"] += 1
                stored = [e for e in w.kv_events if e["type"] == "BlockStored"]
                counts[f"{cfg.kv_events}_payloads"] += sum(e["token_ids"] != [] for e in stored)
                counts[f"{cfg.kv_events}_placeholders"] += sum(e["token_ids"] == [] for e in stored)
                counts[f"{cfg.kv_events}_removals"] += sum(e["type"] == "BlockRemoved" for e in w.kv_events)
    finally:
        mp.undo()
    return counts


def test_lookups_cross_evicted_chunks(reach):
    """CPU chunks are evicted inside cached runs and later lookups cross the gap: a prefix scan
    that counted hits after a miss, or a window scan that kept its streak, would answer otherwise."""
    assert reach["loads"] >= 20, reach  # 32 when written
    assert reach["prefix_hits_after_a_miss"] >= 5, reach  # 8
    assert reach["window_scans_with_a_miss"] >= 50 and reach["window_streak_decides"] >= 1, reach  # 82, 8


def test_mtp_windows_and_chunked_local_groups_are_generated(reach):
    """Sliding windows widened by extra retained tokens restore more chunks than cdiv(sw, chunk);
    chunked-local groups store and load through the connector."""
    assert reach["widened_window_configs"] >= 5 and reach["widened_window_loads"] >= 2, reach  # 16, 3
    assert reach["chunked_local_configs"] >= 5, reach  # 12
    assert reach["chunked_local_stores"] > 0 and reach["chunked_local_loads"] > 0, reach


def test_kv_events_are_generated_in_both_modes(reach):
    """conform-offload compares the connector's KV cache events: placeholders (events on) and
    self-describing payloads (tokens, parent, every block hash of a chunk), stores and evictions."""
    assert reach["placeholder_configs"] >= 3 and reach["self_describing_configs"] >= 3, reach
    assert reach["placeholder_payloads"] == 0 and reach["placeholder_removals"] > 0, reach
    assert reach["self_describing_payloads"] >= 20 and reach["self_describing_removals"] > 0, reach
    assert reach["self_describing_placeholders"] > 0, reach  # windowed groups, or keys without a snapshot


def test_transfer_params_and_hit_sources_are_generated(reach):
    """Requests carry kv_transfer_params (tier filters valid and malformed, load caps) and loads
    split their hit by source (sliding-window history no key covers: test_offload_hit_sources)."""
    assert reach["transfer_params_configs"] >= 5 and reach["tier_values"] >= 5, reach
    assert reach["capped_lookups"] >= 2, reach  # 4 when written
    assert reach["hit_sources"] >= 20, reach


def test_every_lookup_answer_is_an_output():
    """A lookup answer is part of the step output (compared even when the allocation after it fails),
    and a configuration a backend refuses at startup fails the first operation, not the world's
    constructor (which conform-offload builds outside its per-operation checks)."""
    w = OffloadingWorld(OffloadingConfig(num_cpu_chunks=8), "reference")
    w.add_request(list(range(100, 120)))
    *_, lookups = w.step(8)
    assert lookups == (("r0", 0, 0),)

    class Refused(OffloadingConfig):
        def kvref_groups(self):
            raise AssertionError("refused at startup")

    broken = OffloadingWorld(Refused(), "reference")
    with pytest.raises(AssertionError, match="failed to start.*refused at startup"):
        apply_offloading_op(broken, ("abort", 0, 0, 0, 0, 1, 0, 1, False))
