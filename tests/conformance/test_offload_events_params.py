"""conform-offload drives vLLM's OffloadingConnector KV events and kv_transfer_params (#22).

``OffloadingConfig.random`` draws KV cache events (placeholder or self-describing payloads) and
requests' ``kv_transfer_params`` (load tier filters, ``max_load_tokens``, ``max_offload_tokens``);
the world compares every published event, each request's parsed filter and caps, every lookup and
the hit sources, and the connector's stats after every step. On the OffloadingConnector cases ``kvref verify`` draws (fixed seed, the same on
every run and profile) clean vLLM agrees op by op, and faults planted in vLLM's own source
(``offloading/events.py`` and ``offloading/scheduler.py``, compiled in-process) are each flagged.
"""

from __future__ import annotations

import contextlib
import inspect
import random
import sys
import textwrap

import pytest
from kvref.models.offload.offloading_connector_world import OffloadingConfig, OffloadingWorld
from kvref.models.offload.traces import apply_offloading_op

from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


def _cases(want, seed: int = 0, n: int = 80):
    from kvref.verify import _offload_cases

    for cfg, ops in _offload_cases(random.Random(seed), n):
        if isinstance(cfg, OffloadingConfig) and want(cfg):
            yield cfg, ops


def _first_divergence(cases) -> str | None:
    for i, (cfg, ops) in enumerate(cases):
        worlds = [OffloadingWorld(cfg, b, strict=False) for b in ("reference", "vllm")]
        for j, op in enumerate(ops):
            try:
                outs = [apply_offloading_op(w, op) for w in worlds]
            except KeyError:
                break  # vLLM 0.33.0's known KeyError after a connector reset (docs/offload.md)
            except AssertionError as exc:  # conform-offload reports a crash of either side as a failure
                return f"trace {i} op {j} {op}: {exc}"
            if outs[0] != outs[1] or worlds[0].observe() != worlds[1].observe():
                return f"trace {i} op {j} {op} on {cfg}"
    return None


def _directed_evictions():
    """Self-describing events, two blocks per chunk, a CPU pool of two chunks: the second prompt
    evicts the first one's chunks (the generated cases evict with one block per chunk only)."""
    cfg = OffloadingConfig(blocks_per_chunk=2, num_cpu_chunks=2, kv_events="self_describing")
    worlds = [OffloadingWorld(cfg, b) for b in ("reference", "vllm")]
    for w in worlds:
        for p in (list(range(100, 117)), list(range(300, 317))):
            w.add_request(p)
            for _ in range(4):
                w.step(8)
            while w.jobs:
                w.complete(0, 1)
            w.step(8)
    return worlds


def _any(cfg):
    return True


def _events(cfg):
    return cfg.kv_events != "off"


def _params(cfg):
    return bool(cfg.kv_transfer_params)


@contextlib.contextmanager
def _planted(where: str, old: str, new: str):
    import importlib

    modname, qual = where.rsplit(":", 1)
    mod = importlib.import_module(modname)
    owner_name, _, fname = qual.rpartition(".")
    owner = getattr(mod, owner_name) if owner_name else mod
    func = vars(owner)[fname]
    src = inspect.getsource(func)
    assert src.count(old) == 1, old
    ns: dict = {}
    exec(compile(textwrap.dedent(src.replace(old, new)), f"<fault {fname}>", "exec"),  # noqa: S102
         vars(sys.modules[modname]), ns)
    setattr(owner, fname, ns[fname])
    try:
        yield
    finally:
        setattr(owner, fname, func)


_OFF = "vllm.distributed.kv_transfer.kv_connector.v1.offloading"
FAULTS = {
    # a chunk's payload names its own last hash as parent
    "event-parent-off-by-one": (_events, f"{_OFF}.events:OffloadingEventsTracker._build_event_metadata",
                                "parent_block_hash = req.block_hashes[first_hash_idx - 1]",
                                "parent_block_hash = req.block_hashes[first_hash_idx]"),
    # the payload's tokens start one block late
    "event-tokens-shifted": (_events, f"{_OFF}.events:OffloadingEventsTracker._build_event_metadata",
                             "tok_start = chunk_idx * group_config.tokens_per_chunk",
                             "tok_start = chunk_idx * group_config.tokens_per_chunk + group_config.tokens_per_block"),
    # an eviction announces only the chunk's last block hash (the offload key), not the chunk's
    "event-removal-not-fanned-out": (None, f"{_OFF}.events:OffloadingEventsTracker._take_removed_event",
                                     "maybe_convert_block_hash(h) for h in meta.block_hashes",
                                     "maybe_convert_block_hash(h) for h in meta.block_hashes[-1:]"),
    # an explicit [] (no tier) is read as every tier
    "tiers-empty-is-all": (_params, f"{_OFF}.scheduler:_parse_tier_filter",
                           "if not raw:  # input was []", "if raw:  # input was []"),
    # the store cap is ignored
    "max-offload-ignored": (_params, f"{_OFF}.scheduler:OffloadingConnectorScheduler._calc_num_offloadable_tokens",
                            "num = min(num, max_offload_tokens)", "num = num"),
    # a store the manager refuses is not counted
    "allocation-failure-uncounted": (_any, f"{_OFF}.scheduler:OffloadingConnectorScheduler._build_store_jobs",
                                     "self._connector_stats.increase_counter(\n                    _ConnectorMetricName."
                                     "ALLOCATION_FAILURE\n                )\n                logger.warning",
                                     "logger.warning"),
    # the allocation-size histogram records the whole offer, not the new chunks
    "allocation-size-of-offer": (_any, "vllm.v1.kv_offload.cpu.manager:CPUOffloadingManager.prepare_store",
                                 "self.allocation_sizes_in_current_batch.append(len(keys_to_store))",
                                 "self.allocation_sizes_in_current_batch.append(len(keys))"),
    # a capped hit is not rounded down to a chunk boundary
    "max-load-unaligned": (_params, f"{_OFF}.scheduler:OffloadingConnectorScheduler._lookup_complete_chunks",
                           "max_hit_size_tokens = round_down(\n                        max_hit_size_tokens, tokens_per_chunk\n                    )",
                           "max_hit_size_tokens = max_hit_size_tokens"),
}


@pytest.fixture(scope="module")
def V():
    require_vllm()
    import kvref.impl.vllm.offload  # noqa: F401  (imports vLLM once per module)


def test_vllm_agrees_on_events_and_transfer_params(V):
    assert _first_divergence(_cases(lambda c: _events(c) or _params(c))) is None
    ref, vll = _directed_evictions()
    assert ref.kv_events == vll.kv_events and any(
        e["type"] == "BlockRemoved" and len(e["block_hashes"]) == 2 for e in ref.kv_events)


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_planted_fault_is_flagged(V, fault):
    want, where, old, new = FAULTS[fault]
    with _planted(where, old, new):
        if want is None:
            ref, vll = _directed_evictions()
            found = None if ref.kv_events == vll.kv_events else "events differ"
        else:
            found = _first_divergence(_cases(want))
    assert found is not None, f"{fault} not flagged"
