"""conform-offload compares the SimpleCPU connector's KV cache events and stats with vLLM's (#22).

With ``kv_events_config.enable_kv_cache_events`` vLLM's ``SimpleCPUOffloadScheduler`` publishes
its CPU cache: a ``BlockStored`` per key a completed store publishes (payload captured when the
block was selected; none for lazy stores), the CPU pool's evictions and clears relabelled to the
CPU medium. ``SimpleOffloadConfig.random`` turns events on in about half the SimpleCPU cases and
the world's ``observe()`` carries every event published so far. On traces drawn as the check draws
them (fixed seeds, so the counts are the same on every run and profile) these tests count that
each kind of event is published, that clean vLLM agrees with the reference after every op, and
that faults planted in vLLM's own methods (source edits compiled in-process, the installed files
untouched) each make the backends differ. The same holds for the connector's interval stats
(``get_stats``: loaded blocks, CPU blocks in use, blocks of pending stores) and
``has_pending_stores``, observed on every SimpleCPU trace.
"""

from __future__ import annotations

import contextlib
import inspect
import random
import sys
import textwrap
from collections import Counter

import pytest
from kvref.models.offload.simple_cpu_world import SimpleOffloadConfig, SimpleOffloadWorld
from kvref.models.offload.traces import apply_op, random_ops

from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

N_TRACES = 40  # the SimpleCPU half of conform-offload's fast budget


def _event_cases(seed: int = 0, n: int = N_TRACES, events_only: bool = True):
    rng = random.Random(seed)
    for _ in range(n):
        cfg = SimpleOffloadConfig.random(rng)
        ops = random_ops(rng, rng.randint(30, 70))
        if cfg.kv_events or not events_only:
            yield cfg, ops


def _first_divergence(cases) -> str | None:
    for i, (cfg, ops) in enumerate(cases):
        worlds = [SimpleOffloadWorld(cfg, b, allow_duplicates_within_event=True) for b in ("reference", "vllm")]
        for j, op in enumerate(ops):
            try:
                outs = [apply_op(w, op) for w in worlds]
            except Exception as exc:  # a planted fault may also crash vLLM's side
                return f"trace {i} op {j}: {type(exc).__name__}: {exc}"
            ref, vl = worlds[0].observe(), worlds[1].observe()
            if outs[0] != outs[1] or ref != vl:
                return f"trace {i} op {j} {op}: {ref['kv_events'][-3:]} {ref['stats']} != " \
                       f"{vl['kv_events'][-3:]} {vl['stats']}"
    return None


@contextlib.contextmanager
def _planted(method: str, old: str, new: str):
    """vLLM's ``SimpleCPUOffloadScheduler.<method>`` with ``old`` replaced by ``new`` (once)."""
    from vllm.v1.simple_kv_offload import manager

    cls = manager.SimpleCPUOffloadScheduler
    func = vars(cls)[method]
    src = inspect.getsource(func)
    assert src.count(old) == 1, (method, old)
    ns: dict = {}
    exec(compile(textwrap.dedent(src.replace(old, new)), f"<fault {method}>", "exec"),  # noqa: S102
         vars(sys.modules[manager.__name__]), ns)
    setattr(cls, method, ns[method])
    try:
        yield
    finally:
        setattr(cls, method, func)


FAULTS = {
    # the parent of a stored block is the block's own hash instead of its predecessor's
    "parent-hash-off-by-one": ("_select_eager_blocks_to_store",
                               "else maybe_convert_block_hash(resolved_hashes[i - 1])",
                               "else maybe_convert_block_hash(resolved_hashes[i])"),
    # one token short: the payload no longer matches the block size and is dropped
    "token-slice-short": ("_select_eager_blocks_to_store",
                          "request.all_token_ids[token_start:token_end]",
                          "request.all_token_ids[token_start:token_end - 1]"),
    # CPU evictions published as GPU ones (the relabelling in take_events lost)
    "removed-not-relabelled": ("take_events", "event.medium = self.kv_event_medium", "event.medium = event.medium"),
}

STATS_FAULTS = {
    # the interval's load count keeps only the last request's blocks
    "load-blocks-overwritten": ("update_connector_output", "self._interval_load_blocks_completed += completed_blocks",
                                "self._interval_load_blocks_completed = completed_blocks"),
    # a store abandoned by reset() is still running but no longer counted as pending
    "abandoned-not-pending": ("get_stats", "*self._abandoned_store_event_to_blocks.values(),", ""),
    "abandoned-not-pending-store": ("has_pending_stores", "or self._abandoned_store_event_to_blocks", ""),
}


@pytest.fixture(scope="module")
def V():
    require_vllm()
    import kvref.impl.vllm.offload  # noqa: F401  (imports vLLM once per module)


def test_generated_traces_publish_every_kind_of_event():
    counts: Counter = Counter()
    for cfg, ops in _event_cases():
        w = SimpleOffloadWorld(cfg, "reference", allow_duplicates_within_event=True)
        for op in ops:
            apply_op(w, op)
        for e in w.observe()["kv_events"]:
            kind = e["type"]
            if kind == "BlockStored":
                kind += " with payload" if e["token_ids"] else " lazy"
                assert e["medium"] == "CPU" and e["locality"] == "LOCAL"
            counts[kind] += 1
    assert counts["BlockStored with payload"] >= 20, counts
    assert counts["BlockStored lazy"] >= 10, counts
    assert counts["BlockRemoved"] >= 10, counts
    assert counts["AllBlocksCleared"] >= 3, counts


def test_generated_traces_move_every_stat():
    seen: Counter = Counter()
    for cfg, ops in _event_cases(events_only=False):
        w = SimpleOffloadWorld(cfg, "reference", allow_duplicates_within_event=True)
        for op in ops:
            apply_op(w, op)
            loaded, stats, outcomes, pending = w.observe()["stats"]
            seen["pending stores"] += pending
            seen["pending blocks"] += stats["pending_store_blocks"] > 0
            seen["abandoned pending"] += bool(w.b.conn._abandoned_store_event_to_blocks)
            assert outcomes == {}
        seen["loaded blocks"] += loaded
    assert seen["loaded blocks"] >= 20 and seen["pending blocks"] >= 50, seen
    assert seen["abandoned pending"] >= 3, seen


def test_vllm_publishes_the_same_events(V):
    assert _first_divergence(_event_cases(events_only=False)) is None


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_planted_event_fault_is_flagged(V, fault):
    with _planted(*FAULTS[fault]):
        found = _first_divergence(_event_cases())
    assert found is not None, f"{fault} not flagged"


@pytest.mark.parametrize("fault", sorted(STATS_FAULTS))
def test_planted_stats_fault_is_flagged(V, fault):
    with _planted(*STATS_FAULTS[fault]):
        found = _first_divergence(_event_cases(events_only=False))
    assert found is not None, f"{fault} not flagged"
