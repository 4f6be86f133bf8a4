"""vLLM 0.33.0's whole OffloadingConnector (scheduler role + worker roles, KV caches registered,
metadata carried between them) against the reference with a byte oracle (#22), and faults planted
in vLLM's worker half (monkeypatched for the test) that the same traces must find."""

from __future__ import annotations

import pytest

from kvref.verify_offload_worker import offload_worker_cases
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


def _run(n: int, seed: int = 0):
    require_vllm()
    from kvref.models.machines.offload_worker import run_traces

    return run_traces(offload_worker_cases(seed, n))


def test_whole_connector_matches_reference_with_bytes():
    """Generated traces: jobs, pools, chunk state agree after every op; every load's blocks hold
    the bytes their request computed; multi-rank and multi-block chunks are among the configs."""
    n = profile_examples(12, 40)
    cases = offload_worker_cases(0, n)
    assert any(cfg.num_workers == 2 for cfg, _ in cases) and any(cfg.blocks_per_chunk == 2 for cfg, _ in cases)
    stats = _run(n)
    assert stats["traces"] == n
    assert stats["jobs_executed"] > 20
    assert stats["loads_checked"] > 0 and stats["blocks_checked"] > 0


def test_configs_with_hashes_finer_than_blocks_run_on_the_worker():
    """conform-offload's partial-tail configs (hash_block_size < block_size, FA + Mamba 'align')
    reach this check too; the worker world drops the Mamba group and with it the finer hashes,
    instead of the reference refusing to start (ci run of conform-offload-worker, session 12)."""
    require_vllm()
    from kvref.models.machines.offload_worker import run_traces

    cases = [(cfg, ops) for cfg, ops in offload_worker_cases(0, 300) if cfg.hash_block_size][:2]
    assert cases, "no draw with finer hashes among 300"
    assert run_traces(cases)["traces"] == len(cases)


def _sync_cases(n: int) -> list:
    """``n`` worker traces, each with a per-step sync-load budget (the draws conform-offload makes
    one config in three), so that hits small enough load before the forward pass."""
    import random
    from dataclasses import replace

    rng = random.Random(7)
    return [(replace(cfg, sync_load_budget_bytes=rng.choice([64, 128, 256, 512, 10**6])), ops)
            for cfg, ops in offload_worker_cases(0, 40) if not cfg.mamba_align][:n]


def test_sync_loads_run_on_the_worker():
    """Synchronous loads through vLLM's whole connector (#22): the workers submit them expedited and
    wait for them before the forward pass, their bytes are checked then, and they are reported
    without a finished_recving. Session 13's divergence was the harness's: vLLM's connector was
    built without the budget (kv_connector_extra_config) and the handover rule expected every
    load's request in finished_recving."""
    require_vllm()
    from kvref.models.machines.offload_worker import run_traces

    stats = run_traces(_sync_cases(profile_examples(6, 12)))
    assert stats["sync_loads"] > 0 and stats["loads_checked"] > 0


@pytest.mark.parametrize("fault", ["not_waited", "reported"])
def test_planted_sync_load_faults_are_found(fault, monkeypatch):
    """A sync load the worker does not wait for (its blocks still hold the scrub pattern at the
    forward pass, even where a connector reset would excuse foreign KV), or one whose request it
    names in finished_recving."""
    require_vllm()
    from kvref.models.machines.offload_worker import run_traces
    from kvref.models.offload.world_common import OffloadInvariantError

    cls = _worker_cls()
    real = cls.start_kv_transfers

    def patched(self, metadata):
        if fault == "not_waited":
            wait, self.worker.wait = self.worker.wait, lambda job_ids: None
            try:
                return real(self, metadata)
            finally:
                self.worker.wait = wait
        real(self, metadata)
        for j, entry in metadata.load_jobs.items():
            self._load_jobs[j] = entry.req_id

    monkeypatch.setattr(cls, "start_kv_transfers", patched)
    with pytest.raises((AssertionError, OffloadInvariantError)):
        run_traces(_sync_cases(profile_examples(6, 12)))


def test_sync_budget_reaches_vllms_connector(monkeypatch):
    """The whole connector is built with the trace's budget: without it every hit loads
    asynchronously on vLLM's side while the reference loads it at once (the traces diverge)."""
    require_vllm()
    from kvref.impl.vllm import offload_worker as ow
    from kvref.models.machines.offload_worker import run_traces

    case = _sync_cases(1)[0]
    captured = {}
    real = ow.offloading_vllm_config

    def spy(*args, **kwargs):
        vc = real(*args, **kwargs)
        captured.update(vc.kv_transfer_config.kv_connector_extra_config)
        return vc

    monkeypatch.setattr(ow, "offloading_vllm_config", spy)
    run_traces([case])
    assert captured.get("sync_load_budget_bytes") == case[0].sync_load_budget_bytes > 0


def _worker_cls():
    require_vllm()
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker

    return OffloadingConnectorWorker


def stores_never_deferred(monkeypatch):
    """``wait_for_save`` drops the step's store jobs instead of queueing them for the next step."""
    monkeypatch.setattr(_worker_cls(), "prepare_store_kv", lambda self, metadata: None)


def loads_not_reported(monkeypatch):
    """Every load is tracked as a sync load: its request never shows in ``finished_recving``."""
    cls = _worker_cls()
    real = cls.start_kv_transfers

    def patched(self, metadata):
        real(self, metadata)
        for j in list(self._load_jobs):
            self._load_jobs[j] = None

    monkeypatch.setattr(cls, "start_kv_transfers", patched)


def loads_into_reversed_blocks(monkeypatch):
    """The worker hands the transfer worker a load's GPU blocks in reverse order."""
    cls = _worker_cls()
    real = cls.start_kv_transfers

    def patched(self, metadata):
        for entry in metadata.load_jobs.values():
            entry.dst_spec.block_ids = entry.dst_spec.block_ids[::-1].copy()
        real(self, metadata)

    monkeypatch.setattr(cls, "start_kv_transfers", patched)


def half_pages_registered(monkeypatch):
    """``register_kv_caches`` records half a page per layer: loads restore only half the bytes."""
    require_vllm()
    from vllm.v1.kv_offload import base

    real = base.CanonicalKVCacheRef.__init__

    def patched(self, tensor_idx, page_size_bytes, mapping=None):
        real(self, tensor_idx, page_size_bytes // 2, mapping)

    monkeypatch.setattr(base.CanonicalKVCacheRef, "__init__", patched)


def evictions_not_announced(monkeypatch):
    """The connector's event tracker drops the CPU tier's evictions (routers keep stale entries)."""
    require_vllm()
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import OffloadingEventsTracker

    monkeypatch.setattr(OffloadingEventsTracker, "_take_removed_event", lambda self, event: iter(()))


def canonical_pages_unwritten(monkeypatch):
    """Under the canonical layout no rank takes its turn writing a shared page (writer election
    broken): the stores leave the CPU pages empty."""
    require_vllm()
    from vllm.v1.kv_offload.base import CanonicalPageMapping

    monkeypatch.setattr(CanonicalPageMapping, "is_writer", lambda self, block_id: False)


@pytest.mark.parametrize("fault", [stores_never_deferred, loads_not_reported, loads_into_reversed_blocks,
                                   half_pages_registered, evictions_not_announced, canonical_pages_unwritten],
                         ids=lambda f: f.__name__)
def test_planted_worker_fault_is_found(fault, monkeypatch):
    from kvref.models.offload.world_common import OffloadInvariantError

    fault(monkeypatch)
    with pytest.raises((AssertionError, OffloadInvariantError)):
        _run(profile_examples(12, 40))


def _layer_cases(n: int, seed: int = 0):
    import random

    from kvref.models.machines.canonical_mapping import layer_cases

    return layer_cases(random.Random(seed), n)


def test_canonical_mappings_match_reference():
    """vLLM's per-rank canonical page mappings equal the reference's byte for byte, over generated
    head counts, TP sizes, page kinds and orders, MLA and uncertifiable layers."""
    require_vllm()
    from kvref.models.machines.canonical_mapping import compare_layer

    cases = _layer_cases(profile_examples(80, 300))
    kinds = {(c.kind, c.mla, c.heads == max(1, c.total_kv_heads // c.tp_size), c.total_kv_heads < c.tp_size)
             for c in cases}
    assert ("split", False, True, True) in kinds and ("packed", False, True, False) in kinds  # replicated, sharded
    assert any(c.kind_of_layer == "mla" for c in cases) and any(c.kind is None for c in cases)
    assert any(not k[2] for k in kinds)
    # context parallelism certified (replicas splitting tokens under DCP, PCP ranks) and the layers and
    # tensors vLLM must refuse (#22)
    from kvref.impl.reference.offload.canonical_mapping import opaque_mapping

    def certified(c) -> bool:  # not the rank-private fallback on some rank
        ref = c.reference()
        return ref[0] is not None and any(m != opaque_mapping(m.local_page_size_bytes, c.ranks, r)
                                          for r, m in enumerate(ref))

    certified_cp = [c for c in cases if c.dcp * c.pcp > 1 and certified(c)]
    assert any(c.dcp > 1 for c in certified_cp) and any(c.pcp > 1 for c in certified_cp)
    assert {"mamba", "other", "mla"} <= {c.kind_of_layer for c in cases}
    assert any(c.aliased for c in cases) and any(c.perm for c in cases) and any(c.per_token_head for c in cases)
    assert {"list", "absent"} <= {c.tensor_form for c in cases} and any(c.uniform for c in cases)
    assert [d for d in map(compare_layer, cases) if d] == []


def test_canonical_mapping_fault_is_found(monkeypatch):
    """A planted fault in vLLM's derivation (each rank's head rows placed as if it held every head)
    is reported."""
    require_vllm()
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import canonical_mapping as cm

    from kvref.models.machines.canonical_mapping import compare_layer

    real = cm._split_kv_regions

    def patched(kv_cache, spec, head_shard, num_head_shards, cp_size):
        return real(kv_cache, spec, 0, num_head_shards, cp_size)

    monkeypatch.setattr(cm, "_split_kv_regions", patched)
    assert any(compare_layer(c) for c in _layer_cases(profile_examples(60, 300)))


def _cp_token_shards_swapped(monkeypatch):
    """Each CP rank's tokens placed at another rank's canonical positions."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import canonical_mapping as cm

    def patched(local_idx, ctx):
        chunk, pos = divmod(local_idx, ctx.interleave)
        return (chunk * ctx.cp_size + (ctx.cp_size - 1 - ctx.total_cp_rank)) * ctx.interleave + pos

    monkeypatch.setattr(cm, "_local_to_canonical_token", patched)


def _dcp_writers_not_divided(monkeypatch):
    """Replicas that split a block's tokens under DCP all elected as that block's writers: the
    writer count ignores DCP (the MLA and attention paths both)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import canonical_mapping as cm

    real = cm._layer_mapping

    def patched(spec, kv_cache, num_blocks, ctx):
        m = real(spec, kv_cache, num_blocks, ctx)
        if m is None or ctx.dcp_size == 1:
            return m
        from dataclasses import replace

        writers = m.num_writers * ctx.dcp_size
        return replace(m, num_writers=writers, writer_index=ctx.tp_rank % writers)

    monkeypatch.setattr(cm, "_layer_mapping", patched)


def _mamba_padded_fallback(monkeypatch):
    """A Mamba layer's fallback sized from its padded page."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import canonical_mapping as cm

    monkeypatch.setattr(cm, "_unpadded_page_size",
                        lambda spec: spec.page_size_bytes if isinstance(spec, cm.MambaSpec) else
                        getattr(spec, "unpadded_page_size_bytes", None))


def _odd_strides_certified(monkeypatch):
    """A split page whose token and head strides match neither layout read as NHD."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import canonical_mapping as cm

    real = cm._split_kv_regions

    def patched(kv_cache, spec, head_shard, num_head_shards, cp_size):
        got = real(kv_cache, spec, head_shard, num_head_shards, cp_size)
        if got is None and kv_cache.stride()[-1] == 1 and kv_cache.element_size() * 2 * spec.block_size \
                * spec.num_kv_heads * spec.head_size == spec.real_page_size_bytes:
            return real(kv_cache.contiguous(), spec, head_shard, num_head_shards, cp_size)
        return got

    monkeypatch.setattr(cm, "_split_kv_regions", patched)


@pytest.mark.parametrize("fault", [_cp_token_shards_swapped, _dcp_writers_not_divided, _mamba_padded_fallback,
                                   _odd_strides_certified], ids=lambda f: f.__name__.strip("_"))
def test_canonical_mapping_cp_and_layout_faults_are_found(fault, monkeypatch):
    """Faults planted in vLLM's context-parallel placement, DCP writer election, Mamba fallback size
    and stride recognition are each reported on the generated layers (#22)."""
    require_vllm()
    from kvref.models.machines.canonical_mapping import compare_layer

    fault(monkeypatch)
    assert any(compare_layer(c) for c in _layer_cases(profile_examples(80, 300)))


def _event_batches(n: int):
    require_vllm()
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    def stored(i):
        return BlockStored(block_hashes=[i, i + 1], parent_block_hash=None, token_ids=[], block_size=0, lora_id=None,
                           medium="CPU", lora_name=None, group_idx=i % 2)

    return [[stored(i)] + ([BlockRemoved(block_hashes=[i], medium="CPU", group_idx=1)] if i % 3 == 1 else [])
            + ([AllBlocksCleared()] if i % 5 == 4 else []) for i in range(n)]


def test_zmq_publisher_round_trip():
    """vLLM's ZmqEventPublisher: the live stream and replays from several sequences (inside, at the
    edge of and past the replay buffer) decode to exactly the published batches; the whole-connector
    traces' own batches go through it in the check."""
    from kvref.impl.vllm.kv_event_publisher import publish_and_subscribe

    batches = _event_batches(10)
    assert publish_and_subscribe(batches, buffer_steps=4, dp_rank=0, replay_from=(0, 7, 9, 12)) == []
    assert publish_and_subscribe(batches[:3], buffer_steps=8, dp_rank=2, replay_from=(1,)) == []


def test_zmq_publisher_replay_fault_is_found(monkeypatch):
    """A replay buffer that serves one batch fewer than ``buffer_steps`` is reported."""
    require_vllm()
    from vllm.distributed.kv_events import ZmqEventPublisher

    from kvref.impl.vllm.kv_event_publisher import publish_and_subscribe

    real = ZmqEventPublisher._service_replay

    def patched(self):
        buffer = self._buffer
        self._buffer = type(buffer)(list(buffer)[1:], maxlen=buffer.maxlen)
        try:
            real(self)
        finally:
            self._buffer = buffer

    monkeypatch.setattr(ZmqEventPublisher, "_service_replay", patched)
    problems = publish_and_subscribe(_event_batches(6), buffer_steps=4, dp_rank=1, replay_from=(0,))
    assert problems and "replay from 0" in problems[0]


def test_whole_simple_cpu_connector_matches_reference():
    """vLLM's SimpleCPUOffloadConnector built from a VllmConfig (SCHEDULER role through the
    connector's calls) agrees with the reference op by op, on both scheduling modes."""
    require_vllm()
    from kvref.models.machines.simple_offload_connector import run_simple_connector_traces
    from kvref.verify_offload_worker import simple_connector_cases

    cases = simple_connector_cases(0, profile_examples(6, 30))
    assert {cfg.async_scheduling for cfg, _ in cases} == {False, True} and any(cfg.lazy for cfg, _ in cases)
    assert run_simple_connector_traces(cases)["ops"] > 100


def test_simple_cpu_connector_fault_is_found(monkeypatch):
    """A connector that reports no CPU hit (its lookup answer dropped) is found by the same traces."""
    require_vllm()
    from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import SimpleCPUOffloadConnector

    from kvref.models.machines.simple_offload_connector import run_simple_connector_traces
    from kvref.models.offload.world_common import OffloadInvariantError
    from kvref.verify_offload_worker import simple_connector_cases

    real = SimpleCPUOffloadConnector.get_num_new_matched_tokens
    monkeypatch.setattr(SimpleCPUOffloadConnector, "get_num_new_matched_tokens",
                        lambda self, request, n: (0, False) if real(self, request, n)[0] else (0, False))
    with pytest.raises((AssertionError, OffloadInvariantError)):
        run_simple_connector_traces(simple_connector_cases(0, profile_examples(6, 30)))


def test_file_mapper_layout():
    """vLLM's FileMapper keeps its layout's promises on generated settings and keys (file per key,
    one folder per configuration shared by the ranks, parallelism-agnostic folders)."""
    import random

    require_vllm()
    from kvref.models.machines.file_mapper import check_file_mapper

    rng = random.Random(0)
    assert [d for d in (check_file_mapper(rng) for _ in range(profile_examples(20, 60))) if d] == []


def test_file_mapper_fault_is_found(monkeypatch):
    """A base path that hashes the rank too (workers would not share config.json) is reported."""
    import random

    require_vllm()
    from vllm.v1.kv_offload.file_mapper import FileMapper

    from kvref.models.machines.file_mapper import check_file_mapper

    real = FileMapper.__init__

    def patched(self, *args, **kwargs):
        real(self, *args, **kwargs)
        self.base_path = FileMapper._compute_base_path(args[0], dict(self.fields, rank=self.rank))

    monkeypatch.setattr(FileMapper, "__init__", patched)
    rng = random.Random(0)
    assert any(check_file_mapper(rng) for _ in range(profile_examples(20, 60)))


def test_event_aggregation_and_endpoint_offsets(monkeypatch):
    """vLLM's KVEventAggregator keeps exactly the events every worker reported, and dp ranks move
    endpoints as documented; an aggregator that keeps events seen by any worker is reported."""
    import random

    from kvref.impl.vllm.kv_event_publisher import check_endpoint_offsets, check_worker_aggregation

    rng = random.Random(0)
    batches = _event_batches(12)
    # connectors' events are BlockStored / BlockRemoved (vLLM's AllBlocksCleared is not hashable)
    per_step = [[[e for e in events if type(e).__name__ != "AllBlocksCleared" and rng.random() < 0.7]
                 for _ in range(3)] for events in batches]
    assert any(set(map(repr, w[0])) != set(map(repr, w[1])) for w in per_step)  # workers do differ
    assert [p for w in per_step for p in check_worker_aggregation(w)] == []
    assert check_endpoint_offsets() == []

    from vllm.distributed.kv_events import KVEventAggregator

    monkeypatch.setattr(KVEventAggregator, "get_common_events", lambda self: list(self._event_counter))
    assert any(check_worker_aggregation(w) for w in per_step)
