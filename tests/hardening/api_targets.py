"""Public entry points of the API with one valid set of arguments each, for the fuzz tests.

A fuzz case takes one target, replaces one argument by a wrong value (type, sign, size) and
requires a ``ValueError`` subclass or success — never ``TypeError``/``AttributeError``/
``AssertionError``/``OverflowError`` or a hang — and, for a method, the object's state unchanged
and its invariants holding after a rejected call.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
from collections.abc import Callable
from typing import Any

from kvref.spec.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

#: wrong values of every kind a caller gets wrong: None, wrong types, signs, sizes, non-finite floats
JUNK: tuple[Any, ...] = (None, -1, 0, 10**30, 2**63, "x", "", [], {}, (), 1.5, math.nan, math.inf, True, False,
                         object(), [None], ("a",), b"\x00", -(10**30))

FULL = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=4, dtype="bfloat16")
SWA = SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=4, dtype="bfloat16", sliding_window=4)
GROUP = KVCacheGroupSpec(("l0",), FULL)


def pool_config(**kw):
    from kvref.impl.interface import PoolConfig

    args = dict(num_blocks=9, groups=(GROUP, KVCacheGroupSpec(("l1",), SWA)), max_model_len=32,
                scheduler_block_size=4, hash_block_size=4)
    args.update(kw)
    return PoolConfig(**args)


def _cpu_manager():
    from kvref.impl.reference.offload.cpu_offloading_manager import CPUOffloadingManager

    return CPUOffloadingManager(4)


def _simple_cpu_settings():
    from kvref.impl.reference.offload.simple_cpu_connector_config import simple_cpu_connector_settings

    return simple_cpu_connector_settings


def _region_layout():
    from kvref.impl.reference.offload import shared_region_layout

    return shared_region_layout


def _sync_load_budget():
    from kvref.impl.reference.offload.sync_loads import SyncLoadBudget

    return SyncLoadBudget


def _metrics_collector():
    from kvref.impl.reference.kv_cache_metrics import KVCacheMetricsCollector

    return KVCacheMetricsCollector


def constructors() -> dict[str, tuple[Callable[..., Any], dict[str, Any]]]:
    """name -> (callable, valid keyword arguments)."""
    from kvref.impl.interface import PoolConfig
    from kvref.impl.reference.adapter import ReferenceKVCacheManager
    from kvref.impl.reference.block_pool import BlockPool
    from kvref.impl.reference.kv_cache_manager import KVCacheManager
    from kvref.spec import kv_cache_interface as kci_
    from kvref.impl.reference.offload import (
        ARCCachePolicy,
        LRUCachePolicy,
        RequestContext,
    )
    from kvref.impl.reference.offload.cpu_offloading_manager import CPUOffloadingManager
    from kvref.impl.reference.offload.lookup import LookupGroup
    from kvref.impl.reference.offload.offloading_scheduler import (
        OffloadingConnectorScheduler as OffloadingScheduler,
    )
    from kvref.impl.reference.offload.offloading_scheduler import OffloadingStep
    from kvref.impl.reference.offload.offload_event_tracker import EventGroupSpec, OffloadingEventsTracker
    from kvref.impl.reference.offload.tier_filter import TierFilter
    from kvref.impl.reference.offload.simple_cpu_offload_scheduler import (
        SimpleCPUOffloadScheduler,
        SimpleOffloadStep,
    )
    from kvref.impl.reference.scheduler import Scheduler
    from kvref.impl.request import LoRARequest, MultiModalFeatureSpec, PlaceholderRange, Request
    from kvref.impl.run_trace.format import TokenAnonymizer
    from kvref.impl.scheduler_types import DraftTokenIds, ModelOutput, SchedulerConfig
    from kvref.models.conformance.trace import Op, Trace
    from kvref.spec.config import EngineConfig
    from kvref.spec.kv_cache_interface import (
        CrossAttentionSpec,
        EncoderOnlyAttentionSpec,
        UniformTypeKVCacheSpecs,
    )

    pc = pool_config()
    out = {
        "PoolConfig": (PoolConfig, dict(num_blocks=9, groups=(GROUP,), max_model_len=32, scheduler_block_size=4,
                                        hash_block_size=4, max_in_flight_tokens=None, enable_caching=True,
                                        watermark=0.0, use_eagle=False)),
        "BlockPool": (BlockPool, dict(num_gpu_blocks=9, enable_caching=True, hash_block_size=4)),
        "KVCacheMetricsCollector": (_metrics_collector(), dict(sample_rate=0.5)),  # #22
        "KVCacheManager": (KVCacheManager, dict(config=pc)),
        "SchedulerConfig": (SchedulerConfig, dict(max_num_batched_tokens=16, max_num_seqs=4,
                                                  long_prefill_token_threshold=0, enable_chunked_prefill=True,
                                                  policy="fcfs", scheduler_reserve_full_isl=True,
                                                  async_scheduling=False, num_speculative_tokens=0,
                                                  speculative_method="ngram", skip_unused_drafts=False)),
        "DraftTokenIds": (DraftTokenIds, dict(req_ids=("a",), draft_token_ids=((1, 2),))),
        "Scheduler": (lambda pool, config: Scheduler(pool, config),
                      dict(pool=pool_config(max_in_flight_tokens=16), config=SchedulerConfig(max_num_batched_tokens=16))),
        "Request": (Request, dict(request_id="r0", prompt_token_ids=[1, 2, 3], max_tokens=2, cache_salt=None,
                                  priority=0, arrival_time=0.0,
                                  mm_features=(MultiModalFeatureSpec("img", PlaceholderRange(1, 2)),),
                                  lora_request=LoRARequest("a", 1, "/a"), prompt_embeds=(b"ab", b"cd", b"ef"),
                                  session_id="s", skip_reading_prefix_cache=False,
                                  kv_cache_report_mode="full")),
        "SimpleCPUOffloadScheduler": (SimpleCPUOffloadScheduler, dict(
            kv_cache_groups=(GROUP,), num_cpu_blocks=4, max_model_len=32, scheduler_block_size=4, hash_block_size=4,
            lazy_offload=False, world_size=1, max_num_batched_tokens=16, max_in_flight_tokens=None)),
        "CPUOffloadingManager": (CPUOffloadingManager, dict(num_chunks=4, cache_policy="lru", enable_events=False,
                                                            store_threshold=1, max_tracker_size=64)),
        "OffloadingScheduler": (OffloadingScheduler, dict(specs=(FULL,), manager=_cpu_manager(), tokens_per_hash=4,
                                                          blocks_per_chunk=1, num_workers=1,
                                                          offload_prompt_only=True)),
        "FullAttentionSpec": (FullAttentionSpec, dict(block_size=4, num_kv_heads=1, head_size=4, dtype="bfloat16")),
        "MLAAttentionSpec": (MLAAttentionSpec, dict(block_size=4, num_kv_heads=1, head_size=4, dtype="bfloat16")),
        "HiddenStateCacheSpec": (kci_.HiddenStateCacheSpec, dict(block_size=4, num_kv_heads=1, head_size=4,
                                                                 dtype="bfloat16")),
        "SlidingWindowSpec": (SlidingWindowSpec, dict(block_size=4, num_kv_heads=1, head_size=4, dtype="bfloat16",
                                                      sliding_window=4)),
        "ChunkedLocalAttentionSpec": (ChunkedLocalAttentionSpec, dict(block_size=4, num_kv_heads=1, head_size=4,
                                                                      dtype="bfloat16", attention_chunk_size=8)),
        "MambaSpec": (MambaSpec, dict(block_size=4, shapes=((2, 3),), dtypes=("float16",))),
        "RSWASpec": (kci_.RSWASpec, dict(block_size=4, num_kv_heads=1, head_size=4, dtype="bfloat16", rswa_window=8)),
        "SinkFullAttentionSpec": (kci_.SinkFullAttentionSpec, dict(block_size=4, num_kv_heads=1, head_size=4,
                                                                   dtype="bfloat16", sink_len=4)),
        "CircularBufferSpec": (kci_.CircularBufferSpec, dict(block_size=4, num_kv_heads=1, head_size=4,
                                                             dtype="bfloat16")),
        "KVCacheGroupSpec": (KVCacheGroupSpec, dict(layer_names=("l0",), kv_cache_spec=FULL, is_eagle_group=False)),
        "EngineConfig": (EngineConfig, dict(max_model_len=1024, derived_max_model_len=4096)),
        "CrossAttentionSpec": (CrossAttentionSpec, dict(block_size=4, num_kv_heads=1, head_size=4, dtype="bfloat16")),
        "EncoderOnlyAttentionSpec": (EncoderOnlyAttentionSpec, dict(block_size=4, num_kv_heads=1, head_size=4,
                                                                    dtype="bfloat16")),
        "UniformTypeKVCacheSpecs": (UniformTypeKVCacheSpecs, dict(block_size=4, kv_cache_specs={"l0": FULL})),
        "ReferenceKVCacheManager": (ReferenceKVCacheManager, dict(config=pc)),
        # issue #23: a request's block-hash inputs
        "PlaceholderRange": (PlaceholderRange, dict(offset=0, length=2)),
        "MultiModalFeatureSpec": (MultiModalFeatureSpec, dict(identifier="img", mm_position=PlaceholderRange(0, 2),
                                                              modality="image")),
        "LoRARequest": (LoRARequest, dict(lora_name="a", lora_int_id=1, lora_path="/a")),
        "ModelOutput": (ModelOutput, dict(sampled_token_ids={"r0": [1]})),
        "LRUCachePolicy": (LRUCachePolicy, dict(cache_capacity=4)),
        "ARCCachePolicy": (ARCCachePolicy, dict(cache_capacity=4)),
        "RequestContext": (RequestContext, dict(req_id="r0")),
        "LookupGroup": (LookupGroup, dict(tokens_per_chunk=4, window=None, sliding_window=None,
                                          extra_retained_tokens=0)),
        "SyncLoadBudget": (_sync_load_budget(), dict(budget_bytes=64, kv_bytes_per_token=8)),
        "SimpleOffloadStep": (SimpleOffloadStep, dict(scheduled=[], num_scheduled_tokens={}, finished_req_ids=set(),
                                                      preempted_req_ids=set())),
        "TierFilter": (TierFilter, dict(matchers=(("CPU", None),), everything=False)),
        "OffloadingEventsTracker": (OffloadingEventsTracker, dict(
            enable_kv_cache_events=True, self_describing=True, group_specs={0: EventGroupSpec("full_attention", None)},
            use_int=True)),
        "OffloadingStep": (OffloadingStep, dict(scheduled=[], num_scheduled_tokens={}, finished_req_ids=set(),
                                                preempted_req_ids=set())),
        "Op": (Op, dict(name="finish", args={"rid": "r0"})),
        "Trace": (Trace, dict(pool_config=pc, ops=[], note="")),
        "TraceReader": (_trace_reader, dict(validate=True, path=None)),
        "TraceWriter": (_trace_writer, dict(compresslevel=1, chunk_records=4, background=False, flush_seconds=2.0,
                                                    path=None, header=None)),
        "TokenAnonymizer": (TokenAnonymizer, dict()),
        **_connector_constructors(),
    }
    try:
        import torch
        from kvref.impl.torch.manager import TorchKVCacheManager

        out["TorchKVCacheManager"] = (TorchKVCacheManager, dict(pool_config=pc, device="cpu"))

        from kvref.impl.torch.block_pool import TorchBlockPool
        from kvref.impl.torch.kv_cache_tensors import KVCacheTensors
        from kvref.impl.torch.model_runner import DataPathRunner
        from kvref.impl.torch.offload_copy import OffloadCopier

        out["TorchBlockPool"] = (TorchBlockPool, dict(num_blocks=9, enable_caching=True, device=torch.device("cpu")))
        out["KVCacheTensors"] = (KVCacheTensors, dict(groups=(GROUP,), num_blocks=9, num_layers=1, dtype=None,
                                                      device="cpu"))
        out["OffloadCopier"] = (lambda num_cpu_blocks, backend: OffloadCopier(KVCacheTensors((GROUP,), 9),
                                                                              num_cpu_blocks, backend),
                                dict(num_cpu_blocks=4, backend="torch"))
        from kvref.impl.torch.offload_copy import host_buffer

        out["host_buffer"] = (host_buffer, dict(shape=(2, 4), dtype=torch.float32, device="cpu"))
        out["DataPathRunner"] = (lambda num_layers, num_q_heads, seed, attention_backend: DataPathRunner(
            TorchKVCacheManager(pool_config(), device="cpu"), num_layers, num_q_heads, seed=seed,
            attention_backend=attention_backend), dict(num_layers=1, num_q_heads=None, seed=0,
                                                       attention_backend="torch"))
    except ImportError:  # pragma: no cover - torch is a test dependency
        pass
    from kvref.impl.reference.offload.p2p.world import P2PWorld  # the P2P tier's two engines (#22)

    out["P2PWorld"] = (P2PWorld, dict(num_blocks=8, block_len=16))
    from kvref.impl.reference.hisparse_pool import HiSparsePool
    from kvref.spec.hisparse import HiSparsePoolConfig

    out["HiSparsePool"] = (HiSparsePool, dict(config=HiSparsePoolConfig(2, 12, 8, 2, 1, 16, 4)))  # issue #23
    out.update(_tiering_constructors())
    return out


def _tiering_constructors() -> dict[str, tuple[Callable[..., Any], dict[str, Any]]]:
    """The multi-tier offloading reference (#22)."""
    from kvref.impl.reference.offload.tiering.backpressure import EMABackpressureDetector, ThrottledDropPolicy
    from kvref.impl.reference.offload.tiering.clock import VirtualClock
    from kvref.impl.reference.offload.tiering.fs_tier import FileSystemTier
    from kvref.impl.reference.offload.tiering.manager import TieringOffloadingManager
    from kvref.impl.reference.offload.tiering.primary_tier import CPUPrimaryTier

    clock = VirtualClock()
    primary = CPUPrimaryTier(4, 64)
    return {
        "VirtualClock": (VirtualClock, dict(start=1000.0)),
        "CPUPrimaryTier": (CPUPrimaryTier, dict(num_chunks=4, row_bytes=64, cache_policy="lru", enable_events=False)),
        "ThrottledDropPolicy": (ThrottledDropPolicy, dict(ramp_factor=2.0)),
        "EMABackpressureDetector": (EMABackpressureDetector, dict(
            high_water_s=0.01, low_water_s=0.002, alpha=0.15, warmup_completions=2, decay_half_life_s=2.0,
            cooldown_s=1.0, failure_threshold=3, policy=None, clock=clock.monotonic)),
        "TieringOffloadingManager": (TieringOffloadingManager, dict(
            primary=primary, tiers=[FileSystemTier("fs", primary.buffer, clock.monotonic)], clock=clock.monotonic)),
    }


def _tiering_manager():
    """A reference tiering manager (one fs tier, 3 primary chunks) with request r0: key 0 stored
    and cascading, key 1 being written; returns (manager, ctx, keys)."""
    from kvref.impl.reference.offload.keys import RequestContext
    from kvref.impl.reference.offload.tiering.clock import VirtualClock
    from kvref.impl.reference.offload.tiering.fs_tier import FileSystemTier
    from kvref.impl.reference.offload.tiering.manager import TieringOffloadingManager
    from kvref.impl.reference.offload.tiering.primary_tier import CPUPrimaryTier

    clock = VirtualClock()
    primary = CPUPrimaryTier(3, 64)
    m = TieringOffloadingManager(primary, [FileSystemTier("fs", primary.buffer, clock.monotonic)], clock.monotonic)
    ctx = RequestContext("r0")
    m.on_new_request(ctx)
    keys = [bytes([i + 1]) * 8 + b"\0\0\0\0" for i in range(3)]
    m.prepare_store(keys[:1], ctx)
    m.complete_store(keys[:1], ctx)
    m.prepare_store(keys[1:2], ctx)
    return m, ctx, keys


_SCRATCH: list = []


def _scratch(name: str) -> str:
    """A fresh path in one scratch folder per process (removed at exit)."""
    import atexit
    import itertools
    import shutil
    import tempfile

    if not _SCRATCH:
        folder = tempfile.mkdtemp(prefix="kvref-api-")
        atexit.register(shutil.rmtree, folder, True)
        _SCRATCH.extend([folder, itertools.count()])
    return f"{_SCRATCH[0]}/{next(_SCRATCH[1])}-{name}"


def scratch_dir() -> str:
    """The scratch folder: fuzz calls run with it as the working directory, so a relative path
    made from a valid one (``" " + path``, ``"x"``) lands there, not in the repository."""
    _scratch("")
    return _SCRATCH[0]


def _trace_reader(validate=True, path=None):
    """A TraceReader on a small valid trace (``path`` replaced by the fuzz: a wrong path is input)."""
    from kvref.impl.run_trace.reader import TraceReader

    from tests.record.traces import add, write_trace

    if path is None:
        path = write_trace(_scratch("t.kvtrace.gz"), _trace_header(), [add("r0", [1, 2, 3])])
    r = TraceReader(path, validate=validate)
    list(r.records())
    r.close()
    return r


def _trace_writer(compresslevel=1, chunk_records=4, background=False, flush_seconds=2.0, path=None, header=None):
    from kvref.impl.run_trace.writer import TraceWriter

    w = TraceWriter(_scratch("t.kvtrace.gz") if path is None else path, _trace_header() if header is None else header,
                    compresslevel=compresslevel, chunk_records=chunk_records, background=background,
                    flush_seconds=flush_seconds)
    w.close()
    return w


def _connector_constructors() -> dict[str, tuple[Callable[..., Any], dict[str, Any]]]:
    """The KV-connector model's value objects and scripted connector (#22)."""
    from kvref.impl.reference.scheduler_connector import (
        ConnectorConfig,
        ExternalHit,
        KVConnectorOutput,
        ScriptedConnector,
    )
    from kvref.impl.reference.scheduler_connector_multi import MultiScriptedConnector

    return {
        "ConnectorConfig": (ConnectorConfig, dict(kv_role="kv_consumer", kv_load_failure_policy="recompute",
                                                  requires_kv_delivery=None, pending_frees_stop_preemption=False,
                                                  divergent_local_hybrid_hits=False, reset_cache_result=True)),
        "ExternalHit": (ExternalHit, dict(num_tokens=4, load_async=True, num_pending_lookups=0, delay_free=False)),
        "KVConnectorOutput": (KVConnectorOutput, dict(finished_sending=(), finished_recving=("a",),
                                                      failed_recving=(), invalid_block_ids=(1,))),
        "ScriptedConnector": (ScriptedConnector, dict(config=ConnectorConfig())),
        "MultiScriptedConnector": (MultiScriptedConnector, dict(children=[ScriptedConnector(), ScriptedConnector()],
                                                                config=ConnectorConfig())),
        **_multi_worker_constructors(),
    }


def _multi_worker_constructors() -> dict[str, tuple[Callable[..., Any], dict[str, Any]]]:
    """MultiConnector's both-sides reference and its scripted children (#22)."""
    from kvref.impl.reference.connector_worker_child import ScriptedWorkerChild
    from kvref.impl.reference.multi_connector_worker import MultiConnectorModel, RankOutputAggregator

    return {"ScriptedWorkerChild": (ScriptedWorkerChild, dict(index=1, kv_cache_layout="HND", sleep_mode=True,
                                                              piecewise_cudagraph=False)),
            "MultiConnectorModel": (MultiConnectorModel, dict(children=[ScriptedWorkerChild(0), ScriptedWorkerChild(1)])),
            "RankOutputAggregator": (RankOutputAggregator, dict(expected=2))}


#: catalogue entries built through a helper (a lambda or a wrapper): the entry point they call
ALIASES = {
    "Scheduler": "kvref.impl.reference.scheduler.Scheduler",
    "TraceReader": "kvref.impl.run_trace.reader.TraceReader",
    "TraceWriter": "kvref.impl.run_trace.writer.TraceWriter",
    "OffloadCopier": "kvref.impl.torch.offload_copy.OffloadCopier",
    "DataPathRunner": "kvref.impl.torch.model_runner.DataPathRunner",
}


def snapshot(obj: Any) -> bytes:
    """The whole object graph as bytes: equal before and after a rejected call, or it changed state."""
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _manager_with_request():
    """A reference KV cache manager holding one request of 9 tokens (blocks in both groups), and a
    second request waiting; both requests returned."""
    from kvref.impl.reference.kv_cache_manager import KVCacheManager
    from kvref.impl.request import Request

    m = KVCacheManager(pool_config())
    r0 = Request("r0", list(range(9)), max_tokens=4)
    r1 = Request("r1", list(range(9)), max_tokens=4)
    assert m.allocate_slots(r0, 9) is not None
    r0.num_computed_tokens = 9
    return m, r0, r1


def method_cases() -> list[tuple[str, Callable[[], tuple[Any, Callable[[], None], dict[str, Any], Callable]]]]:
    """(name, build) pairs; ``build()`` gives (object whose state is snapshotted, its
    check_invariants, valid keyword arguments, the bound method)."""
    from kvref.impl.reference.block_pool import BlockPool

    def pool():
        p = BlockPool(9, True, 4)
        blocks = p.get_new_blocks(3)
        return p, blocks

    cases = []

    def add(name, build):
        cases.append((name, build))

    def pool_case(method, make_kwargs):
        def build():
            p, blocks = pool()
            return p, p.check_invariants, make_kwargs(p, blocks), getattr(p, method)
        add(f"BlockPool.{method}", build)

    pool_case("get_new_blocks", lambda p, b: dict(num_blocks=2))
    pool_case("touch", lambda p, b: dict(blocks=b[:1]))
    pool_case("free_blocks", lambda p, b: dict(ordered_blocks=b[:2]))
    pool_case("cache_full_blocks", lambda p, b: dict(
        block_hashes=[bytes([i]) * 32 for i in range(3)], blocks=b, num_cached_blocks=0, num_full_blocks=2,
        block_size=4, kv_cache_group_id=0, block_mask=None))
    pool_case("get_cached_block", lambda p, b: dict(block_hash=b"\x01" * 32, kv_cache_group_ids=[0]))
    pool_case("evict_blocks", lambda p, b: dict(block_ids=[1, 2]))
    pool_case("cache_partial_block", lambda p, b: dict(
        block_hashes=[bytes([i]) * 32 for i in range(3)], block=b[0], num_tokens=4, kv_cache_group_id=0,
        block_size=4))

    def manager_case(method, make_kwargs):
        def build():
            m, r0, r1 = _manager_with_request()
            return m, m.check_invariants, make_kwargs(m, r0, r1), getattr(m, method)
        add(f"KVCacheManager.{method}", build)

    manager_case("get_computed_blocks", lambda m, r0, r1: dict(request=r1, max_cache_hit_length=None))
    manager_case("allocate_slots", lambda m, r0, r1: dict(
        request=r1, num_new_tokens=4, num_new_computed_tokens=0, new_computed_blocks=None, num_lookahead_tokens=0,
        num_external_computed_tokens=0, delay_cache_blocks=False, full_sequence_must_fit=False, reserved_blocks=0))
    manager_case("free", lambda m, r0, r1: dict(request=r0))
    manager_case("remove_skipped_blocks", lambda m, r0, r1: dict(request_id="r0", processed_computed_tokens=8))
    manager_case("evict_blocks", lambda m, r0, r1: dict(block_ids={1}))
    manager_case("get_blocks", lambda m, r0, r1: dict(request_id="r0"))
    manager_case("record_blocks_for_zeroing", lambda m, r0, r1: dict(request_id="r0", start_token=4))  # #23
    manager_case("finalize_partial_tail_offloads", lambda m, r0, r1: dict(request=r0))  # #23 Mamba hand-offs

    def offload_case(method, make_kwargs):
        def build():
            from kvref.impl.reference.offload.simple_cpu_offload_scheduler import (
                SimpleCPUOffloadScheduler,
            )
            from kvref.impl.request import Request

            sched = SimpleCPUOffloadScheduler((GROUP,), num_cpu_blocks=4, max_model_len=32, scheduler_block_size=4,
                                              hash_block_size=4)
            gpu = BlockPool(9, True, 4)
            sched.bind_gpu_block_pool(gpu)
            r0 = Request("r0", list(range(9)), max_tokens=4)
            return sched, sched.check_invariants, make_kwargs(sched, gpu, r0), getattr(sched, method)
        add(f"SimpleCPUOffloadScheduler.{method}", build)

    offload_case("get_num_new_matched_tokens", lambda s, g, r: dict(request=r, num_computed_tokens=0))
    offload_case("update_state_after_alloc", lambda s, g, r: dict(request=r, block_ids=[[1, 2, 3]],
                                                                  num_external_tokens=0))
    offload_case("update_connector_output", lambda s, g, r: dict(finished_recving=[], completed_store_events={}))
    offload_case("request_finished", lambda s, g, r: dict(request=r, block_ids=[[1, 2, 3]]))
    offload_case("bind_gpu_block_pool", lambda s, g, r: dict(gpu_block_pool=g))

    def connector_case(method, make_kwargs):
        def build():
            from kvref.impl.reference.offload.offloading_scheduler import (
                OffloadingConnectorScheduler,
            )
            from kvref.impl.request import Request

            sched = OffloadingConnectorScheduler((FULL,), _cpu_manager(), tokens_per_hash=4)
            r0 = Request("r0", list(range(9)), max_tokens=4)
            r1 = Request("r1", list(range(9)), max_tokens=4)
            sched.on_new_request(r0)
            return sched, sched.check_invariants, make_kwargs(sched, r0, r1), getattr(sched, method)
        add(f"OffloadingConnectorScheduler.{method}", build)

    def tracker_case(method, make_kwargs):
        def build():
            from kvref.impl.reference.offload.offload_event_tracker import OffloadingEventsTracker, event_group_specs

            t = OffloadingEventsTracker(True, True, event_group_specs([FULL]))
            return t, t.check_invariants, make_kwargs(t), getattr(t, method)
        add(f"OffloadingEventsTracker.{method}", build)

    def _tracker_snapshot(t):
        return t.snapshot(H, list(range(16)), 0, False, 4, 1, 1)

    tracker_case("snapshot", lambda t: dict(block_hashes=H, token_ids=list(range(16)), group_idx=0, windowed=False,
                                            tokens_per_block=4, blocks_per_chunk=1, chunk_idx=1))
    tracker_case("record_store", lambda t: dict(key=H[1] + bytes(4), meta=_tracker_snapshot(t)))
    tracker_case("record_lookup", lambda t: dict(key=H[1] + bytes(4), meta=_tracker_snapshot(t)))
    tracker_case("take_events", lambda t: dict(events=[]))
    # partial tails (#22): the valid part of a block, at hash granularity
    tracker_case("snapshot_partial_tail", lambda t: dict(block_hashes=H, token_ids=list(range(16)), group_idx=0,
                                                         windowed=False, tokens_per_chunk=8, tokens_per_hash=4,
                                                         boundary_tokens=12))
    tracker_case("record_partial_lookup", lambda t: dict(key=H[2] + bytes(4), meta=t.snapshot_partial_tail(
        H, list(range(16)), 0, False, 8, 4, 12)))
    connector_case("on_new_request", lambda s, r0, r1: dict(req=r1, kv_transfer_params={"max_load_tokens": 4}))
    connector_case("get_external_cache_hit_sources", lambda s, r0, r1: dict(req=r0, num_external_tokens=0))
    connector_case("get_num_new_matched_tokens", lambda s, r0, r1: dict(req=r0, num_computed_tokens=0))
    connector_case("update_state_after_alloc", lambda s, r0, r1: dict(req=r0, blocks=[[(1, False), (2, False)]],
                                                                      num_external_tokens=0))
    connector_case("request_finished", lambda s, r0, r1: dict(req=r0, aborted=False))
    connector_case("update_connector_output", lambda s, r0, r1: dict(completed_jobs={}))
    connector_case("build_connector_meta", lambda s, r0, r1: dict(step=_offloading_step()))
    offload_case("build_connector_meta", lambda s, g, r: dict(step=_simple_step()))

    pool_case("is_block_writable", lambda p, b: dict(block=b[0]))
    pool_case("move_block_hashes", lambda p, b: dict(src_block=b[0], dst_block=b[1]))

    def events_pool_case(method, make_kwargs):
        def build():
            from kvref.impl.request import Request

            p = BlockPool(9, True, 4, enable_kv_cache_events=True)
            b = p.get_new_blocks(3)
            r = Request("r0", list(range(9)), max_tokens=4)
            p.cache_full_blocks(H[:2], b, 0, 2, 4, 0, None, r)
            return p, p.check_invariants, make_kwargs(p, b, r), getattr(p, method)
        add(f"BlockPool.{method}", build)

    events_pool_case("emit_cached_block_events", lambda p, b, r: dict(
        request=r, block_hashes=H[:2], num_cached_blocks=2, block_size=4, kv_cache_group_id=0))

    manager_case("block_hashes", lambda m, r0, r1: dict(request=r1))
    # issue #23: stats and KV-connector views
    manager_case("prefix_cache_lookup_enabled", lambda m, r0, r1: dict(request=r1))
    manager_case("record_prefix_cache_stats", lambda m, r0, r1: dict(request=r1, num_hits=0))
    manager_case("get_block_ids_for_computed_tokens", lambda m, r0, r1: dict(request_id="r0", num_computed_tokens=5))
    manager_case("estimate_cached_tokens", lambda m, r0, r1: dict(request=r0))
    manager_case("truncate_computed_blocks", lambda m, r0, r1: dict(blocks=m.get_computed_blocks(r1)[0],
                                                                      num_computed_tokens=4))
    manager_case("get_computed_blocks_for_connector", lambda m, r0, r1: dict(request=r1, max_cache_hit_length=None))
    manager_case("create_kv_cache_blocks", lambda m, r0, r1: dict(blocks=([], [])))
    manager_case("get_block_ids", lambda m, r0, r1: dict(request_id="r0"))
    manager_case("get_num_common_prefix_blocks", lambda m, r0, r1: dict(running_request_id="r0"))

    def scheduler_case(method, make_kwargs):
        def build():
            from kvref.impl.reference.scheduler import Scheduler
            from kvref.impl.request import Request
            from kvref.impl.scheduler_types import SchedulerConfig

            s = Scheduler(pool_config(max_in_flight_tokens=16), SchedulerConfig(max_num_batched_tokens=16))
            s.add_request(Request("a", list(range(6)), max_tokens=3))
            out = s.schedule()
            return s, s.check_invariants, make_kwargs(s, out), getattr(s, method)
        add(f"Scheduler.{method}", build)

    scheduler_case("add_request", lambda s, out: dict(request=_request("b", 5)))
    scheduler_case("finish_requests", lambda s, out: dict(request_ids=["a"]))
    scheduler_case("update_from_output", lambda s, out: dict(output=out, model_output=_model_output(out)))
    scheduler_case("reset_prefix_cache", lambda s, out: dict(reset_running_requests=False, reset_connector=True))
    scheduler_case("set_pause_state", lambda s, out: dict(pause_state=1))  # issue #22: PAUSED_NEW
    scheduler_case("has_request", lambda s, out: dict(request_id="a"))  # issue #22: polled by the engine

    def connector_scheduler_case(method, make_kwargs):
        def build():
            from kvref.impl.reference.scheduler import Scheduler
            from kvref.impl.reference.scheduler_connector import ExternalHit, ScriptedConnector
            from kvref.impl.request import Request
            from kvref.impl.scheduler_types import SchedulerConfig

            conn = ScriptedConnector()
            s = Scheduler(pool_config(max_in_flight_tokens=16), SchedulerConfig(max_num_batched_tokens=16),
                          connector=conn)
            conn.set_hit("a", ExternalHit(num_tokens=4, load_async=True))
            s.add_request(Request("a", list(range(6)), max_tokens=3))
            out = s.schedule()
            target = conn if method.startswith("ScriptedConnector.") else s
            return s, s.check_invariants, make_kwargs(s, out), getattr(target, method.split(".")[-1])
        add(method if "." in method else f"Scheduler.{method}", build)

    connector_scheduler_case("ScriptedConnector.set_hit", lambda s, out: dict(
        request_id="b", hit=__import__("kvref.impl.reference.scheduler_connector", fromlist=["ExternalHit"])
        .ExternalHit(num_tokens=2)))

    def spec_scheduler_case(method, make_kwargs):
        def build():
            from kvref.impl.reference.scheduler import Scheduler
            from kvref.impl.request import Request
            from kvref.impl.scheduler_types import DraftTokenIds, ModelOutput, SchedulerConfig

            s = Scheduler(pool_config(max_in_flight_tokens=16),
                          SchedulerConfig(max_num_batched_tokens=16, num_speculative_tokens=2))
            s.add_request(Request("a", list(range(6)), max_tokens=3))
            out = s.schedule()
            s.update_from_output(out, ModelOutput({"a": [1]}))
            return s, s.check_invariants, make_kwargs(DraftTokenIds), getattr(s, method)
        add(f"Scheduler.{method}", build)

    spec_scheduler_case("update_draft_token_ids", lambda cls: dict(draft_token_ids=cls(("a",), ((3, 4),))))

    def spec_in_output_case():
        from kvref.impl.reference.scheduler import Scheduler
        from kvref.impl.request import Request
        from kvref.impl.scheduler_types import DraftTokenIds, SchedulerConfig

        s = Scheduler(pool_config(max_in_flight_tokens=32),
                      SchedulerConfig(max_num_batched_tokens=16, num_speculative_tokens=2, async_scheduling=True))
        s.add_request(Request("a", list(range(6)), max_tokens=3))
        s.schedule()
        out = s.schedule()  # verifies two placeholder drafts
        return (s, s.check_invariants, dict(draft_token_ids=DraftTokenIds(("a",), ((3,),)), output=out),
                s.update_draft_token_ids_in_output)
    add("Scheduler.update_draft_token_ids_in_output", spec_in_output_case)

    def cpu_manager_case(method, make_kwargs):
        def build():
            from kvref.impl.reference.offload import RequestContext, make_offload_key

            m = _cpu_manager()
            ctx = RequestContext("r0")
            k = [make_offload_key(h, 0) for h in H]
            m.on_new_request(ctx)
            m.prepare_store(k[:2], ctx)
            m.complete_store(k[:1], ctx)
            return m, m.check_invariants, make_kwargs(m, ctx, k), getattr(m, method)
        add(f"CPUOffloadingManager.{method}", build)

    cpu_manager_case("on_new_request", lambda m, c, k: dict(ctx=_ctx("r1")))
    cpu_manager_case("lookup", lambda m, c, k: dict(key=k[0], ctx=c))
    cpu_manager_case("prepare_load", lambda m, c, k: dict(keys=k[:1], ctx=c))
    cpu_manager_case("touch", lambda m, c, k: dict(keys=k[:2], ctx=c))
    cpu_manager_case("complete_load", lambda m, c, k: dict(keys=[], ctx=c))
    cpu_manager_case("prepare_store", lambda m, c, k: dict(keys=k[2:], ctx=c))
    cpu_manager_case("complete_store", lambda m, c, k: dict(keys=k[1:2], ctx=c, success=True))
    cpu_manager_case("on_request_finished", lambda m, c, k: dict(ctx=c))

    def ref_adapter_case(method, make_kwargs, manager="reference"):
        def build():
            from kvref.impl.interface import make_manager
            from kvref.impl.request import Request

            m = _make(manager)
            r0 = Request("r0", list(range(9)), max_tokens=4)
            r1 = Request("r1", list(range(9)), max_tokens=4)
            assert m.allocate_slots(r0, 9) is not None
            del make_manager
            return m, m.check_invariants, make_kwargs(m, r0, r1), getattr(m, method)
        add(f"{'ReferenceKVCacheManager' if manager == 'reference' else 'TorchKVCacheManager'}.{method}", build)

    # issue #23: hashes, stats and KV-connector views of the reference adapter
    ref_adapter_case("request_block_hashes", lambda m, r0, r1: dict(request=r1))
    ref_adapter_case("record_prefix_cache_stats", lambda m, r0, r1: dict(request=r1, num_hits=0))
    ref_adapter_case("get_block_ids_for_computed_tokens", lambda m, r0, r1: dict(request_id="r0",
                                                                                   num_computed_tokens=5))
    ref_adapter_case("estimate_cached_tokens", lambda m, r0, r1: dict(request=r0))
    ref_adapter_case("truncate_computed_blocks", lambda m, r0, r1: dict(
        block_ids=m.get_computed_blocks(r1)[0], num_computed_tokens=4))
    ref_adapter_case("get_computed_blocks_for_connector", lambda m, r0, r1: dict(request=r1))
    ref_adapter_case("free_holding_view", lambda m, r0, r1: dict(request=r0))
    ref_adapter_case("record_blocks_for_zeroing", lambda m, r0, r1: dict(request_id="r0", start_token=4))  # #23
    ref_adapter_case("finalize_partial_tail_offloads", lambda m, r0, r1: dict(request=r0))  # #23 Mamba hand-offs
    ref_adapter_case("get_computed_blocks_and_boundary", lambda m, r0, r1: dict(request=r1))  # #23 retention
    ref_adapter_case("rejects_prefix_cache_retention_interval", lambda m, r0, r1: dict(retention_interval=8))
    for kind in ("reference", "torch"):
        ref_adapter_case("get_computed_blocks", lambda m, r0, r1: dict(request=r1), kind)
        ref_adapter_case("allocate_slots", lambda m, r0, r1: dict(
            request=r1, num_new_tokens=4, num_new_computed_tokens=0, new_computed_block_ids=None,
            num_lookahead_tokens=0, num_external_computed_tokens=0, delay_cache_blocks=False,
            full_sequence_must_fit=False, reserved_blocks=0, has_scheduled_reqs=True), kind)
        ref_adapter_case("free", lambda m, r0, r1: dict(request=r0), kind)
        ref_adapter_case("cache_blocks", lambda m, r0, r1: dict(request=r0, num_computed_tokens=8), kind)
        ref_adapter_case("get_block_ids", lambda m, r0, r1: dict(request_id="r0"), kind)
        ref_adapter_case("forget", lambda m, r0, r1: dict(request_id="r1"), kind)
    ref_adapter_case("evict_blocks", lambda m, r0, r1: dict(block_ids={1}))

    def torch_pool_case(method, make_kwargs):
        def build():
            import torch
            from kvref.impl.torch.block_pool import TorchBlockPool

            p = TorchBlockPool(9, True, torch.device("cpu"))
            b = p.get_new_blocks(3)
            return p, p.check_invariants, make_kwargs(p, b), getattr(p, method)
        add(f"TorchBlockPool.{method}", build)

    torch_pool_case("get_new_blocks", lambda p, b: dict(n=2))
    torch_pool_case("touch", lambda p, b: dict(block_ids=b[:1]))
    torch_pool_case("free_blocks", lambda p, b: dict(ordered_block_ids=b[:2]))
    torch_pool_case("get_cached_block", lambda p, b: dict(block_hash=H[0], group_ids=[0]))

    def writer_case(method, make_kwargs):
        def build():
            from kvref.impl.run_trace.writer import TraceWriter

            w = TraceWriter(_scratch("w.jsonl"), _trace_header(), background=False)
            return _WriterState(w), w.check_invariants, make_kwargs(w), getattr(w, method)
        add(f"TraceWriter.{method}", build)

    writer_case("write", lambda w: dict(record={"t": "abort", "ids": ["r0"]}))
    writer_case("write_line", lambda w: dict(line='{"t": "abort", "ids": ["r0"]}'))

    def anonymizer_case(method, make_kwargs):
        def build():
            from kvref.impl.run_trace.format import TokenAnonymizer

            a = TokenAnonymizer()
            a.request_id("r0")
            return a, a.check_invariants, make_kwargs(a), getattr(a, method)
        add(f"TokenAnonymizer.{method}", build)

    anonymizer_case("tokens", lambda a: dict(tokens=[1, 2, 3]))
    anonymizer_case("request_id", lambda a: dict(request_id="r1"))
    anonymizer_case("forget", lambda a: dict(request_id="r0"))
    anonymizer_case("salt", lambda a: dict(salt="s"))
    anonymizer_case("embeds_digests", lambda a: dict(data=b"\x01" * 8, row_bytes=4))  # #28 format 6

    def ctx_case(method, make_kwargs):
        def build():
            from kvref.impl.reference.offload import make_offload_key

            c = _ctx("r0")
            return c, (lambda: None), make_kwargs(c, make_offload_key(H[0], 0)), getattr(c, method)
        add(f"RequestContext.{method}", build)

    scheduler_case("snapshot", lambda s, out: dict(all_requests=[_request("gone", 3)]))

    def closing_writer_case():
        def build():
            from kvref.impl.run_trace.writer import TraceWriter

            w = TraceWriter(_scratch("c.jsonl"), _trace_header(), background=False)
            return _WriterState(w), w.check_invariants, dict(end={"t": "end"}), w.close
        add("TraceWriter.close", build)

    closing_writer_case()
    ctx_case("set_offload_key_position", lambda c, k: dict(key=k, end_token=4))
    ctx_case("get_offload_key_position", lambda c, k: dict(key=k))
    ctx_case("set_state", lambda c, k: dict(value=[1]))
    ctx_case("get_state", lambda c, k: dict(cls=list))

    def p2p_case(method, kwargs):  # the P2P tier's two engines, one request shared (#22)
        def build():
            from kvref.impl.reference.offload.p2p.world import P2PWorld

            w = P2PWorld()
            w.new_request("P", "p0", "remote_decoder", "kv0")
            w.new_request("D", "d0", "remote_prefiller", "kv0")
            return _P2PWorldState(w), w.check_invariants, dict(kwargs), getattr(w, method)
        add(f"P2PWorld.{method}", build)

    p2p_case("new_request", dict(node="D", req_id="d1", role="remote_prefiller", kv_request_id="kv1"))
    p2p_case("peer_params", dict(node="D", role="remote_prefiller", kv_request_id="kv1"))
    p2p_case("lookup", dict(node="D", req_id="d0", key=b"k"))
    p2p_case("submit_store", dict(node="P", req_id="p0", job_id=1, keys=[b"k"], chunk_ids=[0]))
    p2p_case("submit_load", dict(node="D", req_id="d0", job_id=2, keys=[b"k"], chunk_ids=[1]))
    p2p_case("finish", dict(node="D", req_id="d0"))
    p2p_case("poll", dict(node="P"))
    p2p_case("drain", dict(node="D"))
    p2p_case("complete_transfers", dict(node="P", count=1, ok=True))
    p2p_case("advance", dict(seconds=1.0))
    p2p_case("fault", dict(node="P"))
    p2p_case("shutdown", dict(node="P"))
    p2p_case("read", dict(node="D", chunk_ids=[0]))
    p2p_case("write", dict(node="P", chunk_ids=[0], blocks=[b"x" * 16]))
    p2p_case("snapshot", dict(node="P"))
    p2p_case("hold", dict(node="P", key=b"k", chunk_id=0, pending=1))
    p2p_case("serve", dict(node="P"))
    p2p_case("schedule_end", dict(node="D"))
    p2p_case("parent_log", dict(node="P"))
    p2p_case("break_transfers", dict(node="P", count=1, error="not_found"))
    p2p_case("fail_submissions", dict(node="P", count=1, kind="post_err"))
    p2p_case("fail_registrations", dict(node="P", count=1))
    p2p_case("reseed", dict(node="D", differs=True))
    p2p_case("stranger_request", dict(node="D", req_id="x0", kv_request_id="odd0"))
    p2p_case("stranger_connects", dict(node="P", kind="block_len"))
    p2p_case("fail_releases", dict(node="P", count=1, kind="agent"))

    def tiering_case(method, make_kwargs, before=None):  # the multi-tier offloading reference (#22)
        def build():
            m, ctx, keys = _tiering_manager()
            if before is not None:
                before(m, ctx, keys)
            return m, m.check_invariants, make_kwargs(ctx, keys), getattr(m, method)
        add(f"TieringOffloadingManager.{method}", build)

    from kvref.impl.reference.offload.keys import RequestContext

    tiering_case("lookup", lambda c, k: dict(key=k[2], ctx=c))
    tiering_case("prepare_store", lambda c, k: dict(keys=[k[2]], ctx=c))
    tiering_case("complete_store", lambda c, k: dict(keys=[k[1]], ctx=c, success=True))
    tiering_case("prepare_load", lambda c, k: dict(keys=[k[0]], ctx=c))
    tiering_case("complete_load", lambda c, k: dict(keys=[k[0]], ctx=c),
                 before=lambda m, c, k: m.prepare_load([k[0]], c))  # a load completes what was prepared
    tiering_case("touch", lambda c, k: dict(keys=[k[0]], ctx=c))
    tiering_case("get_load_source", lambda c, k: dict(key=k[0], ctx=c))
    tiering_case("on_new_request", lambda c, k: dict(ctx=RequestContext("r1")))
    tiering_case("on_request_finished", lambda c, k: dict(ctx=c))
    tiering_case("on_schedule_end", lambda c, k: dict(new_req_ids=["r0"]))
    tiering_case("poll_tiers", lambda c, k: dict())

    def poll_loop_case(method, kwargs):  # the tier-poll thread's loop (#22)
        def build():
            from kvref.impl.reference.offload.tiering.poll_loop import TierPollLoop

            loop = TierPollLoop()
            return loop, loop.check_invariants, dict(kwargs), getattr(loop, method)
        add(f"TierPollLoop.{method}", build)

    poll_loop_case("iteration", dict(now=1000.0, lock_free=True, round_ok=False))
    poll_loop_case("shutdown", dict(now=1000.0, lock_free=True, round_ok=True, stuck=False))

    def primary_read():
        m, ctx, keys = _tiering_manager()
        return m.primary, m.primary.check_invariants, dict(keys=[keys[0]]), m.primary.prepare_read

    def clock_advance():
        from kvref.impl.reference.offload.tiering.clock import VirtualClock

        c = VirtualClock()
        return c, (lambda: None), dict(dt=0.5), c.advance

    def sync_reserve():
        from kvref.impl.reference.offload.sync_loads import SyncLoadBudget

        b = SyncLoadBudget(64, 8)
        return b, b.check_invariants, dict(req_id="r0", num_computed_tokens=0, num_hit_tokens=4, num_tokens=9), \
            b.reserve

    add("SyncLoadBudget.reserve", sync_reserve)
    add("CPUPrimaryTier.prepare_read", primary_read)
    add("VirtualClock.advance", clock_advance)
    return cases


class _P2PWorldState:
    """What a P2P world shows, for the snapshot: both engines' bookkeeping, buffers, the messages
    and the clock (its sessions hold callbacks, which cannot be pickled)."""

    def __init__(self, w) -> None:
        self.w = w

    def __reduce__(self):
        w = self.w
        return (tuple, ((w.snapshot("P"), w.snapshot("D"), bytes(w.planes["P"].buffer), bytes(w.planes["D"].buffer),
                         w.messages(), w.now, dict(w.alive)),))


class _WriterState:
    """What a trace writer holds, for the snapshot: records written and lines buffered (its file
    handle and compressor cannot be pickled)."""

    def __init__(self, w) -> None:
        self.w = w

    def __reduce__(self):
        return (tuple, ((self.w.num_records, self.w.closed, list(self.w._buf)),))


def _request(rid, n):
    from kvref.impl.request import Request

    return Request(rid, list(range(n)), max_tokens=3)


def _ctx(rid):
    from kvref.impl.reference.offload import RequestContext

    return RequestContext(rid)


def _model_output(out):
    from kvref.impl.scheduler_types import ModelOutput

    return ModelOutput({r.request_id: [1] for r in out.scheduled})


def _make(kind):
    from kvref.impl.interface import make_manager

    if kind == "torch":
        from kvref.impl.torch.manager import TorchKVCacheManager

        return TorchKVCacheManager(pool_config(), device="cpu")
    return make_manager(kind, pool_config())


def _simple_step():
    from kvref.impl.reference.offload.simple_cpu_offload_scheduler import (
        SimpleOffloadStep,
    )

    return SimpleOffloadStep(scheduled=[], num_scheduled_tokens={}, finished_req_ids=set(), preempted_req_ids=set())


def _offloading_step():
    from kvref.impl.reference.offload.offloading_scheduler import OffloadingStep

    return OffloadingStep(scheduled=[], num_scheduled_tokens={}, finished_req_ids=set(), preempted_req_ids=set())


# ------------------------------------------------------------------ stateless functions

H = [bytes([i]) * 32 for i in range(4)]  # block hashes
ENGINE = None  # built lazily (EngineConfig import)


def _engine():
    from kvref.spec.config import EngineConfig

    return EngineConfig(block_size=4, max_model_len=64, derived_max_model_len=128, max_num_batched_tokens=16,
                        max_num_seqs=4)


def _trace_header():
    from tests.record.traces import full_setup, header_for

    return header_for(*full_setup())


def _streaming_functions() -> dict[str, tuple[Callable[..., Any], dict[str, Any]]]:
    from collections import deque

    from kvref.impl.reference import scheduler_streaming as ss
    from kvref.impl.request import Request

    upd = ss.StreamingUpdate((4, 5), 2, 1.0)
    return {
        "StreamingUpdate": (ss.StreamingUpdate, dict(prompt_token_ids=(4, 5), max_tokens=2, arrival_time=1.0)),
        "SessionState": (ss.SessionState, dict(queues={"r0": deque()}, waiting_for_input=set())),
        "update_request_as_session": (ss.update_request_as_session,
                                      dict(request=Request("r0", [1, 2], output_token_ids=[3]), update=upd)),
        "handle_stopped_request": (ss.handle_stopped_request,
                                   dict(request=Request("r0", [1, 2]), state=ss.SessionState())),
        "add_update": (ss.add_update, dict(state=ss.SessionState(queues={"r0": deque()}),
                                           request=Request("r0", [1, 2]), update=upd)),
        "forget": (ss.forget, dict(state=ss.SessionState(), request_id="r0")),
    }


def _encoder_functions() -> dict[str, tuple[Callable[..., Any], dict[str, Any]]]:
    """The reference scheduler's encoder budget and cache (#22)."""
    from kvref.impl.reference import scheduler_encoder as se
    from kvref.impl.reference import scheduler_lora as sl
    from kvref.impl.reference import scheduler_stop as stop
    from kvref.impl.request import RepetitionDetectionParams, Request

    return {
        "EncoderBudget": (se.EncoderBudget, dict(encoder_compute_budget=4, encoder_cache_size=8,
                                                 disable_chunked_mm_input=False)),
        "EncoderCacheManager": (se.EncoderCacheManager, dict(cache_size=8)),
        "EncoderState": (se.EncoderState, dict(budget=se.EncoderBudget(4, 8))),
        "check_max_loras": (sl.check_max_loras, dict(max_loras=2)),
        # check_stop's rules (scheduler_stop, #22)
        "RepetitionDetectionParams": (RepetitionDetectionParams, dict(max_pattern_size=2, min_pattern_size=1,
                                                                      min_count=2)),
        "ends_in_repetition": (stop.ends_in_repetition,
                               dict(token_ids=[1, 2, 1, 2], params=RepetitionDetectionParams(2, 1, 2))),
        "stop_reason": (stop.stop_reason, dict(request=Request("r0", [1, 2], output_token_ids=[3]), max_model_len=8)),
    }


def functions() -> dict[str, tuple[Callable[..., Any], dict[str, Any]]]:
    """name -> (callable without state of its own, valid keyword arguments): module functions,
    static/class methods and the methods of frozen spec objects (nothing to snapshot)."""
    from kvref.impl import interface
    from kvref.impl.reference import kv_events, scheduler_liveness
    from kvref.impl.reference.scheduler_pause import as_pause_state
    from kvref.impl.reference import block_hash as bh
    from kvref.impl.reference.offload import boundary_stores, chunk_config, keys, lookup
    from kvref.impl.reference.offload import offload_stats as _offload_stats
    from kvref.impl.reference.offload.tiering.backpressure import default_config
    from kvref.impl.reference.offload.tiering.kvcr_config import kvcr_config_error
    from kvref.impl.reference.offload.tiering.kvcr_config import kvcr_built_tier
    from kvref.spec.tiering_canonical_refs import canonical_refs_verdict
    from kvref.impl.reference.offload.tiering import tier_configs
    from kvref.impl.request import Request
    from kvref.impl.run_trace import format as run_format
    from kvref.impl.run_trace.writer import compression_for
    from kvref.impl.scheduler_types import SchedulerConfig, check_scheduler_pool, engine_config_for
    from kvref.models.conformance import trace as conf_trace
    from kvref.spec import (
        block_sizes,
        config,
        dtypes,
        grouping,
        planning,
        planning_packed,
        planning_per_layer_check,
        pool_sizing,
    )
    from kvref.spec import kv_cache_interface as kci
    from kvref.spec import kv_zeroing
    from kvref.spec import prefix_cache_retention as retention
    from kvref.spec import context_parallel

    from kvref.impl.reference.offload import canonical_mapping as cmap
    from kvref.impl.reference.offload import offload_event_tracker, offload_events, tier_filter
    from kvref.impl.reference.offload.cpu_offloading_manager import OffloadingEvent

    page = cmap.AttentionPage("split", "HND", 2, 1, 2, 2)
    from kvref.impl.reference.offload import parallel_layout as playout

    _ol = playout.OffloadLayer("full", 1, 16, 4)
    _og = playout.OffloadGroup((_ol, _ol))
    _op = playout.OffloadParallel(2, 2)
    eng = _engine()
    groups = (GROUP, KVCacheGroupSpec(("l1",), SWA))
    layers = {"l0": FULL, "l1": SWA}
    pc = pool_config()
    sc = SchedulerConfig(max_num_batched_tokens=16)
    req = Request("r0", list(range(9)), max_tokens=4)
    out: dict[str, tuple[Callable[..., Any], dict[str, Any]]] = {
        # spec: arithmetic, dtypes, configs
        "get_dtype_size": (dtypes.get_dtype_size, dict(name="bfloat16")),
        "canonical_dtype": (dtypes.canonical_dtype, dict(name="half", field="dtype")),
        "max_in_flight_tokens": (config.max_in_flight_tokens, dict(max_num_batched_tokens=16,
                                                                   max_concurrent_batches=2)),
        "EngineConfig.with_max_model_len": (eng.with_max_model_len, dict(max_model_len=32)),
        # spec: block sizes, grouping, sizing, planning
        "cache_block_size": (block_sizes.cache_block_size, dict(groups=groups)),
        "group_block_size": (block_sizes.group_block_size, dict(group=GROUP, dcp_world_size=1)),
        "partial_hash_hits_enabled": (block_sizes.partial_hash_hits_enabled, dict(groups=groups, hash_block_size=4,
                                                                                  dcp_world_size=1)),
        "resolve_cache_hit_alignment_tokens": (block_sizes.resolve_cache_hit_alignment_tokens, dict(
            groups=groups, config=eng, scheduler_block_size=4, hash_block_size=4)),
        "resolve_kv_cache_block_sizes": (block_sizes.resolve_kv_cache_block_sizes, dict(groups=groups, config=eng)),
        "resolve_dcp_kv_cache_spec": (block_sizes.resolve_dcp_kv_cache_spec, dict(spec=FULL, dcp_world_size=2)),
        # spec: DCP/PCP at runtime (issue #23)
        "manager_world_sizes": (context_parallel.manager_world_sizes, dict(spec=FULL, dcp_world_size=2,
                                                                           pcp_world_size=1)),
        "manager_block_size": (context_parallel.manager_block_size, dict(spec=FULL, dcp_world_size=2)),
        "check_context_parallel": (context_parallel.check_context_parallel, dict(
            specs=(FULL, SWA), dcp_world_size=1, pcp_world_size=1, enable_caching=True)),
        "KVCacheMetricsCollector.seeded": (_metrics_collector().seeded, dict(sample_rate=0.5, seed=0)),  # #22
        "simple_cpu_connector_settings": (_simple_cpu_settings(), dict(  # #22
            extra={"cpu_bytes_to_use": 640, "lazy_offload": True}, world_size=2, enable_prefix_caching=True,
            num_gpu_blocks=10, gpu_total_bytes=320, aligned_num_cpu_blocks=None, check_capacity=True)),
        # the CPU offload tier's shared region layout (#22)
        "region_segments": (_region_layout().region_segments, dict(
            mmap_path="/dev/shm/x", num_chunks=4, row_stride=8192, num_segments=2, min_segment_bytes=8192)),
        "worker_slot_ranges": (_region_layout().worker_slot_ranges, dict(
            rank=1, num_chunks=4, row_stride=8192, cpu_page_size=3000, page_size=4096, segmented=True)),
        "worker_view_offsets": (_region_layout().worker_view_offsets, dict(rank=1, cpu_page_size=100, sizes=[40, 60])),
        "canonical_view_offsets": (_region_layout().canonical_view_offsets, dict(row_stride=256, sizes=[200, 56])),
        # spec: KV zeroing (issue #23)
        "kv_zeroing.iter_layer_specs": (kv_zeroing.iter_layer_specs, dict(kv_cache_spec=FULL)),
        "kv_zeroing.has_mamba_layers": (kv_zeroing.has_mamba_layers, dict(groups=groups)),
        "kv_zeroing.has_mixed_precision_kv_cache": (kv_zeroing.has_mixed_precision_kv_cache, dict(groups=groups)),
        "kv_zeroing.needs_kv_cache_zeroing": (kv_zeroing.needs_kv_cache_zeroing, dict(groups=groups)),
        "kv_zeroing.records_new_block_ids": (kv_zeroing.records_new_block_ids, dict(kv_cache_spec=FULL,
                                                                                    needs_zeroing=True)),
        # spec: sparse prefix-cache retention (issue #23)
        "prefix_cache_retention.has_sparse_retention_group": (retention.has_sparse_retention_group,
                                                              dict(groups=groups)),
        "prefix_cache_retention.validate_prefix_cache_retention_interval": (
            retention.validate_prefix_cache_retention_interval,
            dict(retention_interval=8, scheduler_block_size=4, groups=groups)),
        "prefix_cache_retention.replay_boundaries": (retention.replay_boundaries,
                                                     dict(num_prompt_tokens=9, scheduler_block_size=4, use_eagle=True)),
        "get_kv_cache_groups": (grouping.get_kv_cache_groups, dict(layers=layers,
                                                                   disable_hybrid_kv_cache_manager=False)),
        "group_layers_with_uniform_page_size": (grouping.group_layers_with_uniform_page_size, dict(layers=layers)),
        "group_size_for": (grouping.group_size_for, dict(layer_counts=[2, 1])),
        "is_kv_cache_spec_uniform": (grouping.is_kv_cache_spec_uniform, dict(layers=layers)),
        "merge_specs": (grouping.merge_specs, dict(specs=[FULL, FULL])),
        "promote_local_kv_cache_specs": (grouping.promote_local_kv_cache_specs, dict(layers=layers)),
        "unify_hybrid_kv_cache_specs": (grouping.unify_hybrid_kv_cache_specs, dict(layers=layers)),
        "unify_kv_cache_spec_page_size": (grouping.unify_kv_cache_spec_page_size, dict(layers=layers)),
        "validate_layers": (grouping.validate_layers, dict(layers=layers, allow_empty=False)),
        "plan_kv_cache": (planning.plan_kv_cache, dict(layers=layers, config=eng, available_memory=1 << 20)),
        "PoolConfig.from_plan": (interface.PoolConfig.from_plan, dict(
            plan=planning.plan_kv_cache(layers, eng, 1 << 20), watermark=0.0, use_eagle=False,
            enable_kv_cache_events=False)),
        "PoolConfig.off_plan": (interface.PoolConfig.off_plan, dict(
            why="a fuzzed pool", num_blocks=9, groups=groups, max_model_len=32, scheduler_block_size=4,
            hash_block_size=4)),
        "PoolConfig.through_plan": (interface.PoolConfig.through_plan, dict(
            fields=dict(num_blocks=9, groups=groups, max_model_len=32, scheduler_block_size=4, hash_block_size=4),
            engine=eng, why="a fuzzed pool", reasons=[], settings=None)),
        "scheduler_view": (planning.scheduler_view, dict(groups=groups)),
        # spec: block-outermost layouts and packed grouping (#22)
        "planning_packed.check_layout": (planning_packed.check_layout, dict(layout="BLHNC")),
        "planning_packed.is_block_outermost": (planning_packed.is_block_outermost, dict(layout="BLHNC")),
        "planning_packed.is_block_compact": (planning_packed.is_block_compact, dict(layout="BLHNC")),
        "planning_packed.is_layer_compact": (planning_packed.is_layer_compact, dict(layout="BLHNC")),
        "planning_packed.approximate_gcd": (planning_packed.approximate_gcd, dict(values=[4, 6], lower_bound=2)),
        "planning_packed.get_packed_kv_cache_groups": (planning_packed.get_packed_kv_cache_groups,
                                                       dict(layers=layers)),
        "planning_packed.get_kv_cache_groups_for_layout": (planning_packed.get_kv_cache_groups_for_layout, dict(
            layers=layers, disable_hybrid_kv_cache_manager=False, layout="BLHNC")),
        "planning_packed.validate_kv_cache_layout": (planning_packed.validate_kv_cache_layout,
                                                     dict(layout="BLHNC", groups=groups)),
        "planning_per_layer_check.per_layer_memory_bytes": (planning_per_layer_check.per_layer_memory_bytes,
                                                            dict(layers=layers, config=eng, max_model_len=64)),
        "planning_per_layer_check.estimate_max_model_len_per_layer": (
            planning_per_layer_check.estimate_max_model_len_per_layer,
            dict(layers=layers, config=eng, available_memory=1 << 20, max_model_len=64)),
        "planning_per_layer_check.check_enough_kv_cache_memory_per_layer": (
            planning_per_layer_check.check_enough_kv_cache_memory_per_layer,
            dict(layers=layers, config=eng, available_memory=1 << 20, kv_cache_layout="LBNHC")),
        "pool_bytes_per_block": (pool_sizing.pool_bytes_per_block, dict(groups=groups)),
        "auto_fit_max_model_len": (pool_sizing.auto_fit_max_model_len, dict(
            groups=groups, config=eng, check_memory=1 << 20, original_max_model_len=64)),
        "check_enough_kv_cache_memory": (pool_sizing.check_enough_kv_cache_memory, dict(
            groups=groups, config=eng, check_memory=1 << 20, max_model_len=64)),
        "estimate_max_model_len": (pool_sizing.estimate_max_model_len, dict(groups=groups, config=eng,
                                                                             available_memory=1 << 20, upper=64)),
        "format_gib": (pool_sizing.format_gib, dict(num_bytes=1 << 30)),
        "group_blocks_per_request": (pool_sizing.group_blocks_per_request, dict(spec=FULL, config=eng,
                                                                                 max_model_len=64)),
        "layer_spec": (pool_sizing.layer_spec, dict(group=GROUP, layer_name="l0")),
        "max_concurrency": (pool_sizing.max_concurrency, dict(scheduler_groups=groups, config=eng, max_model_len=64,
                                                              num_blocks=40)),
        "needed_bytes_for": (pool_sizing.needed_bytes_for, dict(groups=groups, config=eng, max_model_len=64)),
        "validate_groups": (pool_sizing.validate_groups, dict(groups=groups)),
        "has_admission_cap": (kci.has_admission_cap, dict(spec=SWA)),
        "attention_compare_fields": (kci.attention_compare_fields, dict(spec=FULL)),
        # spec: methods of frozen specs
        "KVCacheSpec.max_memory_usage_bytes": (FULL.max_memory_usage_bytes, dict(config=eng, max_model_len=32)),
        "SlidingWindowSpec.max_memory_usage_bytes": (SWA.max_memory_usage_bytes, dict(config=eng, max_model_len=32)),
        "KVCacheSpec.max_memory_usage_blocks": (FULL.max_memory_usage_blocks, dict(config=eng, max_model_len=32)),
        "KVCacheSpec.max_num_blocks_per_req": (FULL.max_num_blocks_per_req, dict(config=eng, max_len=32)),
        "SlidingWindowSpec.admission_cap": (SWA.admission_cap, dict(max_in_flight_tokens=16, max_model_len=32)),
        "SlidingWindowSpec.max_admission_blocks_per_request": (SWA.max_admission_blocks_per_request, dict(
            max_in_flight_tokens=16, max_model_len=32)),
        "KVCacheSpec.admission_cap": (FULL.admission_cap, dict(max_in_flight_tokens=16, max_model_len=32)),
        "KVCacheSpec.effective_block_size": (FULL.effective_block_size, dict(dcp_world_size=1)),
        "KVCacheSpec.copy_with_new_block_size": (FULL.copy_with_new_block_size, dict(block_size=8)),
        "FullAttentionSpec.merge": (FullAttentionSpec.merge, dict(specs=[FULL, FULL])),
        "MLAAttentionSpec.merge": (MLAAttentionSpec.merge, dict(specs=[MLAAttentionSpec(
            block_size=4, num_kv_heads=1, head_size=4, dtype="bfloat16")] * 2)),
        "SlidingWindowSpec.is_uniform_with_collection": (SWA.is_uniform_with_collection, dict(specs=layers)),
        "UniformTypeKVCacheSpecs.from_specs": (kci.UniformTypeKVCacheSpecs.from_specs, dict(specs={"l0": FULL})),
        "UniformTypeKVCacheSpecs.is_uniform_type": (kci.UniformTypeKVCacheSpecs.is_uniform_type,
                                                    dict(specs={"l0": FULL})),
        # reference: hashing, events, liveness bounds
        "to_external_block_hash": (kv_events.to_external_block_hash, dict(hash_bytes=H[0], use_int=False)),
        "event_extra_keys": (kv_events.event_extra_keys, dict(salt="s", block_start=0)),
        # issue #23: block-hash extra keys and hash functions
        "get_hash_fn_by_name": (bh.get_hash_fn_by_name, dict(hash_fn_name="sha256_cbor")),
        "generate_block_hash_extra_keys": (bh.generate_block_hash_extra_keys, dict(
            request=req, start_token_idx=0, end_token_idx=4)),
        "block_hash_extra_keys": (bh.block_hash_extra_keys, dict(request=req, start_token_idx=0, end_token_idx=4,
                                                                 num_hash_lookahead_tokens=1)),
        "kv_cache_spec_kind": (kv_events.kv_cache_spec_kind, dict(spec=SWA)),
        "drain_bound": (scheduler_liveness.drain_bound, dict(requests=[req], pool=pc, config=sc)),
        "max_blocks_per_request": (scheduler_liveness.max_blocks_per_request, dict(pool=pc, config=sc)),
        "startup_consistent": (scheduler_liveness.startup_consistent, dict(pool=pc, config=sc)),
        "liveness_guaranteed": (scheduler_liveness.liveness_guaranteed, dict(pool=pc, config=sc)),
        "liveness_hazard": (scheduler_liveness.liveness_hazard, dict(pool=pc, config=sc)),
        "align_split_stalls": (scheduler_liveness.align_split_stalls, dict(pool=pc, config=sc)),
        "partial_hit_groups": (scheduler_liveness.partial_hit_groups, dict(pool=pc)),
        "steps_alone": (scheduler_liveness.steps_alone, dict(request=req, pool=pc, config=sc)),
        # #26: the one pool <-> scheduler rule set and the one road back to startup's arguments
        "check_scheduler_pool": (check_scheduler_pool, dict(pool=dataclasses.replace(pc, max_in_flight_tokens=16),
                                                            config=sc)),
        "engine_config_for": (engine_config_for, dict(config=sc, groups=pc.groups, max_model_len=pc.max_model_len,
                                                      scheduler_block_size=pc.scheduler_block_size,
                                                      hash_block_size=pc.hash_block_size, enable_caching=True,
                                                      num_blocks=pc.num_blocks)),
        "as_pause_state": (as_pause_state, dict(value=2)),  # issue #22: the scheduler's pause states
        "kvcr_config_error": (kvcr_config_error, dict(  # issue #22: KVCR tier configs vLLM refuses
            cfg={"type": "kvcr", "control_ports": [5555], "router_capabilities": ["router_hint"],
                 "secondary_g2_slots": 2, "policy": "lru"}, events=True, self_describing=True)),
        "canonical_refs_verdict": (canonical_refs_verdict, dict(  # issue #22: tiering worker's canonical refs
            canonical_layout=True, is_parallelism_agnostic=False, portable=[[True, False], [None]])),
        "kvcr_built_tier": (kvcr_built_tier, dict(  # issue #22: what vLLM hands kvcr for an accepted config
            cfg={"type": "kvcr", "control_ports": [5555], "router_capabilities": ["router_hint"],
                 "secondary_g2_slots": 2, "policy": "lru"}, events=True, block_size_bytes=64, dp_local_rank=None)),
        # issue #22: streaming-input sessions
        **_streaming_functions(),
        **_encoder_functions(),
        "make_manager": (interface.make_manager, dict(kind="reference", pool_config=pc)),
        # offload keys and lookups
        "make_offload_key": (keys.make_offload_key, dict(block_hash=H[0], group_idx=0)),
        # canonical page mappings of the offloading worker (reference of vLLM's canonical_mapping.py)
        "AttentionPage": (cmap.AttentionPage, dict(kind="split", order="HND", block_size=2, num_kv_heads=1,
                                                   head_size=2, elem_size=2)),
        "AttentionPage.element_offset": (page.element_offset, dict(part=1, token=1, head=0, x=1)),
        "AttentionPage.with_heads": (page.with_heads, dict(heads=2)),
        "attention_mapping": (cmap.attention_mapping, dict(page=page, total_kv_heads=2, tp_size=2, rank=1)),
        "mla_mapping": (cmap.mla_mapping, dict(page_size_bytes=8, tp_size=2, rank=1)),
        "opaque_mapping": (cmap.opaque_mapping, dict(page_size_bytes=8, num_ranks=2, rank=1)),
        "shard_plan": (cmap.shard_plan, dict(total_kv_heads=2, tp_size=4, num_kv_heads=1)),
        "ContextParallel": (cmap.ContextParallel, dict(dcp=2, pcp=1, interleave=2)),  # #22: CP in the mapping
        "ContextParallel.cp_rank": (cmap.ContextParallel(2, 2, 1).cp_rank, dict(rank=3, tp_size=2)),
        "ContextParallel.canonical_token": (cmap.ContextParallel(2, 1, 2).canonical_token, dict(token=3, cp_rank=1)),
        "ContextParallel.tiles": (cmap.ContextParallel(2, 1, 2).tiles, dict(block_size=4)),
        "recognized_order": (cmap.recognized_order, dict(kind="split", block_size=2, heads=1, head_size=2,
                                                         strides=(4, 2, 4, 1))),
        # build_offloading_config's parallelism gate (#22)
        "OffloadLayer": (playout.OffloadLayer, dict(kind="full", num_kv_heads=1, page_size_bytes=16, block_size=4)),
        "OffloadGroup": (playout.OffloadGroup, dict(layers=(_ol,), uniform=True)),
        "OffloadParallel": (playout.OffloadParallel, dict(tp=2, total_kv_heads=2, use_mla=True, kv_tp_replicas=2)),
        "offloaded_groups": (playout.offloaded_groups, dict(groups=[_og])),
        "worker_kv_bytes_per_block": (playout.worker_kv_bytes_per_block, dict(groups=[_og], num_blocks=4,
                                                                              tensor_bytes=None)),
        "layer_certifiable": (playout.layer_certifiable, dict(layer=_ol, total_kv_heads=2, tp=2)),
        "parallelism_agnostic": (playout.parallelism_agnostic, dict(groups=[_og], par=_op, canonical=True)),
        "replicated_layout": (playout.replicated_layout, dict(groups=[_og], par=_op, canonical=False,
                                                              worker_bytes=16)),
        "required_kv_cache_layout": (playout.required_kv_cache_layout, dict(hisparse=True)),
        "event_group_specs": (offload_event_tracker.event_group_specs, dict(specs=[FULL, SWA])),
        "parse_tier_filter": (tier_filter.parse_tier_filter, dict(raw=[{"medium": "cpu"}])),
        "request_tier_filter": (tier_filter.request_tier_filter, dict(kv_transfer_params={"kv_load_tiers": []})),
        "token_cap": (tier_filter.token_cap, dict(kv_transfer_params={"max_load_tokens": 8}, name="max_load_tokens")),
        "TierFilter.allows": (tier_filter.ALL.allows, dict(medium="CPU", locality=None)),
        "offloading_kv_events": (offload_events.offloading_kv_events, dict(
            events=[OffloadingEvent([keys.make_offload_key(H[0], 0)], removed=True)], use_int=True)),
        "get_sliding_window_size_in_chunks": (keys.get_sliding_window_size_in_chunks, dict(spec=SWA,
                                                                                           tokens_per_chunk=4)),
        "get_offload_group_idx": (keys.get_offload_group_idx, dict(key=keys.make_offload_key(H[0], 0))),
        "get_offload_block_hash": (keys.get_offload_block_hash, dict(key=keys.make_offload_key(H[0], 0))),
        "chunk_offload_keys": (keys.chunk_offload_keys, dict(block_hashes=H, group_idx=0, hashes_per_chunk=2)),
        "order_request_keys": (keys.order_request_keys, dict(key_groups=[[keys.make_offload_key(H[0], 0)]],
                                                             ctx=keys.RequestContext("r0"))),
        "maximal_prefix_lookup": (lookup.maximal_prefix_lookup, dict(keys=[keys.make_offload_key(H[0], 0)],
                                                                     lookup=_hit)),
        "sliding_window_lookup": (lookup.sliding_window_lookup, dict(keys=[keys.make_offload_key(H[0], 0)], window=1,
                                                                     lookup=_hit, initial_window=None)),
        "lookup_complete_chunks": (lookup.lookup_complete_chunks, dict(
            groups=[lookup.LookupGroup(4)], group_keys=[[keys.make_offload_key(H[0], 0)]], num_tokens=8,
            num_computed_tokens=0, lookup=_hit, chunks_being_loaded=None, max_num_new_tokens=None)),
        "lookup_order": (lookup.lookup_order, dict(groups=[lookup.LookupGroup(4)])),
        "reduce_steps": (_offload_stats.reduce_steps, dict(steps=[{"allocation_failure": 1,
                                                                  "cpu_allocation_size": [2]}])),
        "blocks_per_chunk": (chunk_config.blocks_per_chunk, dict(extra_config={"block_size": 8},
                                                                 group_tokens_per_block=[4])),
        # Mamba "align" boundary-state stores of the OffloadingConnector (#22)
        "check_handoffs": (boundary_stores.check_handoffs, dict(handoffs={"r0": [(1, 3, 8)]})),
        "aligned_boundary_stores": (boundary_stores.aligned_boundary_stores, dict(
            handoffs={"r0": [(1, 3, 8)]}, tokens_per_chunk={1: 4}, max_boundary=lambda rid: 8)),
        "make_boundary_key": (boundary_stores.make_boundary_key, dict(
            block_hashes=H, group_idx=1, boundary_tokens=4, tokens_per_hash=4, ctx=keys.RequestContext("r0"))),
        "LookupGroup.load_window": (lookup.LookupGroup(4, 1, 4).load_window, dict(num_tokens=6)),
        # run traces and conformance traces (data read from files: every field checked)
        "decode_tokens": (run_format.decode_tokens, dict(text=run_format.encode_tokens([1, 2, 3]))),
        "encode_tokens": (run_format.encode_tokens, dict(tokens=[1, 2, 3])),
        # prompt-embeds digests (#28, format 6)
        "embeds_digests": (run_format.embeds_digests, dict(data=b"\x00" * 8, row_bytes=4, key=b"k")),
        "decode_embeds": (run_format.decode_embeds, dict(text=run_format.encode_tokens([1, 2, 3, 4]))),
        "validate_header": (run_format.validate_header, dict(header=_trace_header(), where="t:1")),
        "validate_record": (run_format.validate_record, dict(rec={"t": "abort", "ids": ["r0"]}, where="t:2")),
        "compression_for": (compression_for, dict(path="run.kvtrace.gz")),
        "spec_from_json": (conf_trace.spec_from_json, dict(obj=conf_trace.spec_to_json(SWA))),
        "spec_to_json": (conf_trace.spec_to_json, dict(spec=SWA)),
        "pool_config_from_json": (conf_trace.pool_config_from_json, dict(obj=conf_trace.pool_config_to_json(pc))),
        "pool_config_to_json": (conf_trace.pool_config_to_json, dict(pc=pc)),
        "Trace.from_json": (conf_trace.Trace.from_json, dict(obj=conf_trace.Trace(pc).to_json())),
        "Trace.loads": (conf_trace.Trace.loads, dict(text=conf_trace.Trace(pc).dumps())),
        "Op.from_json": (conf_trace.Op.from_json, dict(obj={"op": "finish", "rid": "r0"})),
        "tiering.default_config": (default_config, dict(tier_type="fs", locality=None)),  # #22
        # #22: what vLLM's TieringOffloadingSpec builds from its extra config, or why it refuses
        "resolve_secondary_tiers": (tier_configs.resolve_secondary_tiers, dict(extra_config={"secondary_tiers": [
            {"type": "fs", "backpressure": {"backpressure_cls": "EMABackpressureDetector"}}]},
            resolve_class=lambda module_path, name: None)),
        "resolve_backpressure": (tier_configs.resolve_backpressure, dict(
            tier_cfg={"type": "fs", "backpressure": {"alpha": 0.5}}, top_level={"backpressure_cls": "EMABackpressureDetector"})),
    }
    out["SlidingWindowSpec.merge"] = (SlidingWindowSpec.merge, dict(specs=[SWA, SWA]))
    rswa = kci.RSWASpec(block_size=4, num_kv_heads=1, head_size=4, dtype="bfloat16", rswa_window=8)
    out["RSWASpec.merge"] = (kci.RSWASpec.merge, dict(specs=[rswa, rswa]))
    # issue #22: DeepSeek-V4.1 SWA bounded replay
    swa_mla = kci.SlidingWindowMLASpec(block_size=4, num_kv_heads=1, head_size=4, dtype="bfloat16", sliding_window=4,
                                       bounded_replay=True)
    out["SlidingWindowMLASpec"] = (kci.SlidingWindowMLASpec, dict(block_size=4, num_kv_heads=1, head_size=4,
                                                                  dtype="bfloat16", sliding_window=4,
                                                                  bounded_replay=True, alignment=16))
    out["SlidingWindowMLASpec.merge"] = (kci.SlidingWindowMLASpec.merge, dict(specs=[swa_mla, swa_mla]))
    out["SlidingWindowMLASpec.is_uniform_with_collection"] = (swa_mla.is_uniform_with_collection,
                                                              dict(specs={"l0": swa_mla}))
    from kvref.impl.reference import scheduler_prefix_replay as replay

    out["ReplayAdmission"] = (replay.ReplayAdmission, dict(hit_tokens=8, hit_kept=True, num_computed_tokens=4,
                                                           num_replay_tokens=4, replay_start=4))
    out["drop_short_hit"] = (replay.drop_short_hit, dict(window=4, num_hit=3))
    out["replay_admission"] = (replay.replay_admission, dict(window=4, num_hit=9))
    out["slots_past_hit"] = (replay.slots_past_hit, dict(num_new_tokens=6, num_replay_tokens=4))
    out["mark_prefix_replay"] = (replay.mark_prefix_replay, dict(window=4, num_hit=9, window_loaded=False))
    out["load_restores_window"] = (replay.load_restores_window, dict(replay_group_ids=(1,), loaded_group_ids=(0, 1)))
    out["trim_external_hit"] = (replay.trim_external_hit, dict(block_size=4, num_external=9, load_async=True,
                                                               window_loaded=False))
    out["prefix_replay_tokens"] = (replay.prefix_replay_tokens, dict(pool=pool_config(groups=(
        GROUP, KVCacheGroupSpec(("l1",), swa_mla)))))
    out["check_config"] = (pool_sizing.check_config, dict(config=eng))
    saved = conf_trace.Trace(pc).save(_scratch("t.json"))
    out["Trace.load"] = (conf_trace.Trace.load, dict(path=str(saved)))
    out["Trace.save"] = (conf_trace.Trace(pc).save, dict(path=_scratch("s.json")))
    uniform = kci.UniformTypeKVCacheSpecs(block_size=4, kv_cache_specs={"l0": FULL, "l1": FULL})
    out["UniformTypeKVCacheSpecs.layer_spec"] = (uniform.layer_spec, dict(layer_name="l0"))
    # the sizing methods of every concrete spec type (each overrides some of them)
    every_spec = [FULL, SWA, uniform, MambaSpec(block_size=4, shapes=((2, 3),), dtypes=("float16",)),
                  ChunkedLocalAttentionSpec(block_size=4, num_kv_heads=1, head_size=4, dtype="bfloat16",
                                            attention_chunk_size=8),
                  MLAAttentionSpec(block_size=4, num_kv_heads=1, head_size=4, dtype="bfloat16"),
                  kci.CrossAttentionSpec(block_size=4, num_kv_heads=1, head_size=4, dtype="bfloat16"),
                  kci.EncoderOnlyAttentionSpec(block_size=4, num_kv_heads=1, head_size=4, dtype="bfloat16"),
                  kci.CircularBufferSpec(block_size=4, num_kv_heads=1, head_size=4, dtype="bfloat16")]
    for spec in every_spec:
        name = type(spec).__name__
        for method, kwargs in (("max_memory_usage_bytes", dict(config=eng, max_model_len=32)),
                               ("max_memory_usage_blocks", dict(config=eng, max_model_len=32)),
                               ("max_memory_usage_pages", dict(config=eng, max_model_len=32)),
                               ("max_num_blocks_per_req", dict(config=eng, max_len=32)),
                               ("admission_cap", dict(max_in_flight_tokens=16, max_model_len=32)),
                               ("max_admission_blocks_per_request", dict(max_in_flight_tokens=16, max_model_len=32)),
                               ("is_uniform_with_collection", dict(specs={"x": spec}))):
            if hasattr(spec, method) and not (method == "max_num_blocks_per_req" and name == "EncoderOnlyAttentionSpec"):
                out[f"{name}.{method}"] = (getattr(spec, method), kwargs)
    try:
        from kvref.impl.vllm import kv_events as vllm_events

        out["decode_batch"] = (vllm_events.decode_batch, dict(payload=_event_payload(), kind="generic"))
        out["make_decoder"] = (vllm_events.make_decoder, dict(kind="generic"))
        out["parse_seq"] = (vllm_events.parse_seq, dict(frame=(7).to_bytes(8, "big")))
    except ImportError:  # pragma: no cover
        pass
    try:
        import torch  # noqa: F401
        from kvref.impl.torch import make_manager as torch_make_manager
        from kvref.impl.torch.manager import resolve_device

        out["torch.make_manager"] = (torch_make_manager, dict(pool_config=pc, device="cpu"))
        out["resolve_device"] = (resolve_device, dict(device="cpu"))
    except ImportError:  # pragma: no cover
        pass
    # spec: a model's config.json (the mapping arguments; every config field is fuzzed by
    # tests/hardening/cli_flag_fuzz.py through `kvref size --hf-config`)
    from kvref.spec import hf_config

    llama = _hf_example("llama-3.1-8b")
    out["layout_from_hf_config"] = (hf_config.layout_from_hf_config, dict(data=llama, block_size=16,
                                                                          tensor_parallel_size=1))
    out["derived_max_model_len"] = (hf_config.derived_max_model_len, dict(data=llama))
    out["model_dtype"] = (hf_config.model_dtype, dict(data=llama))
    out["mamba_state_bytes"] = (hf_config.mamba_state_bytes, dict(shapes=((3, 64), (4, 16)),
                                                                  dtypes=("float16", "float32")))
    out["hybrid_attention_block_size"] = (hf_config.hybrid_attention_block_size, dict(
        attention_page_per_token=512, mamba_page=100_000, block_size=16, kernel_block_size=16,
        checkpoint_alignment=None))
    # which group layouts the HiSparse coordinator accepts (issue #22)
    from kvref.impl.reference.hisparse_group_layout import check_group_layout, hisparse_coordinator_for_layout

    out["check_group_layout"] = (check_group_layout, dict(layout=[("source", 2), ("indexer", 2)]))
    out["hisparse_coordinator_for_layout"] = (hisparse_coordinator_for_layout, dict(
        layout=[("source", 2), ("indexer", 2), ("resident", 2), ("hot", 2)], host_num_blocks=8, num_gpu_blocks=12,
        max_model_len=16, blocks_per_request=1))
    # Mamba "align" prefill checkpoints and the scheduler's chunk split (issue #23)
    from kvref.impl.reference.scheduler_mamba_split import MambaSplitConfig, mamba_block_aligned_split

    out["get_mamba_prefill_checkpoint_position"] = (kci.get_mamba_prefill_checkpoint_position, dict(
        num_tokens=21, hash_block_size=2, drop_eagle_block=False, num_hash_lookahead_tokens=0))
    out["is_mamba_prefill_checkpoint_valid"] = (kci.is_mamba_prefill_checkpoint_valid, dict(
        query_start=0, query_end=21, checkpoint_position=20, hash_block_size=2, mamba_block_size=8,
        checkpoint_alignment=1))
    out["MambaSplitConfig"] = (MambaSplitConfig, dict(block_size=8, hash_block_size=2, partial_cache_hit=True,
                                                      checkpoint_alignment=1, max_prefill_tokens=16))
    out["MambaSplitConfig.from_specs"] = (MambaSplitConfig.from_specs, dict(
        specs=(FULL, MambaSpec(block_size=4, shapes=((2,),), dtypes=("float16",), mamba_cache_mode="align")),
        hash_block_size=2, scheduler_block_size=4, partial_cache_hit=True))
    out["mamba_block_aligned_split"] = (mamba_block_aligned_split, dict(
        config=MambaSplitConfig(block_size=8, hash_block_size=2, partial_cache_hit=True), num_computed_tokens=0,
        num_prompt_tokens=21, num_tokens=21, num_new_tokens=21, num_new_local_computed_tokens=0,
        num_external_computed_tokens=0, shared_prefix_boundary=0))
    # multi-module MTP's prefill runway in the scheduler (issue #28)
    from kvref.impl.reference.scheduler_prefill_lookahead import reserve_prefill_lookahead

    out["reserve_prefill_lookahead"] = (reserve_prefill_lookahead, dict(
        num_prefill_lookahead=3, request=_request("mtp", 21), num_computed_tokens=8, num_new_tokens=11))
    from kvref.impl.reference.offload.p2p import manager as p2p_manager
    from kvref.impl.reference.offload.p2p import messages as p2p_messages

    out["parse_request"] = (p2p_manager.parse_request, dict(params={"remote_decoder": {"kv_request_id": "kv0"}}))
    out["summarize"] = (p2p_messages.summarize, dict(msg={"type": "fetch", "kv_request_id": "kv0"}))
    from kvref.impl.reference.offload.p2p.world import malformed_params

    out["malformed_params"] = (malformed_params, dict(role="no_params", kv_request_id="kv0", host="P", port=1))
    from kvref.impl.reference.offload.p2p.world import stranger_hello  # the third engine's handshake (#22)

    out["stranger_hello"] = (stranger_hello, dict(kind="seed", peer_id="X:1", num_blocks=8, block_len=16))
    out["unbound_store_timeout"] = (p2p_manager.unbound_store_timeout, dict(value=60.0, backpressure=False))
    # HiSparse specs and admission rules (issue #23)
    from kvref.spec import hisparse as hs

    hot, res = hs.HiSparseHotSpec(block_size=2, page_size=8, blocks_per_request=2), hs.HiSparseResidentSpec(
        block_size=2, page_size=8)
    out["HiSparseHotSpec"] = (hs.HiSparseHotSpec, dict(block_size=2, page_size=8, blocks_per_request=2))
    out["HiSparseResidentSpec"] = (hs.HiSparseResidentSpec, dict(block_size=2, page_size=8))
    out["HiSparseHotSpec.max_memory_usage_bytes"] = (hot.max_memory_usage_bytes, dict(config=eng, max_model_len=16))
    out["HiSparseHotSpec.max_num_blocks_per_req"] = (hot.max_num_blocks_per_req, dict(config=eng, max_len=16))
    out["HiSparseResidentSpec.max_memory_usage_bytes"] = (res.max_memory_usage_bytes, dict(config=eng,
                                                                                            max_model_len=16))
    out["HiSparseResidentSpec.max_admission_blocks_per_request"] = (res.max_admission_blocks_per_request, dict(
        max_in_flight_tokens=4, max_model_len=16))
    out["HiSparsePoolConfig"] = (hs.HiSparsePoolConfig, dict(block_size=2, num_gpu_blocks=12, host_num_blocks=8,
                                                             blocks_per_request=2, num_resident_groups=1,
                                                             max_model_len=16, max_in_flight_tokens=4))
    out["resident_max_admission_blocks"] = (hs.resident_max_admission_blocks, dict(
        block_size=2, max_in_flight_tokens=4, max_model_len=16))
    out["hot_needs_region"] = (hs.hot_needs_region, dict(total_computed_tokens=4, num_local_computed_tokens=4,
                                                         is_running=False, hot_required=False))
    out["hot_blocks_to_allocate"] = (hs.hot_blocks_to_allocate, dict(blocks_per_request=2, num_held=1))
    out["resident_blocks_to_allocate"] = (hs.resident_blocks_to_allocate, dict(
        block_size=2, num_tokens=12, total_computed_tokens=7, num_local_computed_tokens=0, num_held=0,
        tail_resident=False, apply_admission_cap=True, max_admission_blocks=2))
    out["source_admission_count"] = (hs.source_admission_count, dict(num_required=4, num_host_free=3,
                                                                     num_gpu_blocks=10))
    out["transition_watermark"] = (hs.transition_watermark, dict(hot_blocks_per_request=[2], num_blocks=40))
    out["needs_hot_transition"] = (hs.needs_hot_transition, dict(num_gpu_free=1, watermark=2,
                                                                 fills_admission_window=False))
    # HiSparse startup layout rules (#22/#23)
    from kvref.spec import hisparse_layout as hl

    src = [("a", 8, True), ("b", 8, False)]
    out["hot_group_layers"] = (hl.hot_group_layers, dict(source_layers=src, indexer_page=16))
    out["lay_out_hisparse_groups"] = (hl.lay_out_hisparse_groups, dict(source_layers=src, indexer_page=16,
                                                                       block_size=2, blocks_per_request=2))
    out["hisparse_device_buffer_size"] = (hl.hisparse_device_buffer_size, dict(max_query_len=1, top_k=4,
                                                                               configured=None))
    out["hisparse_hot_blocks_per_request"] = (hl.hisparse_hot_blocks_per_request, dict(device_buffer_size=8,
                                                                                       block_size=2))
    out["hisparse_host_num_blocks"] = (hl.hisparse_host_num_blocks, dict(host_budget=4096, source_page=16,
                                                                         shared_host_pool=False, max_model_len=16,
                                                                         block_size=2))
    # HiSparse startup sizing: pools, tensors, both concurrency figures (#22/#23)
    from kvref.spec import planning_hisparse as ph

    out["plan_hisparse_kv_cache"] = (ph.plan_hisparse_kv_cache, dict(
        source=[("a", 128, True)], indexer=[("i", 256)], block_size=2, top_k=4, device_buffer_size=None,
        host_budget=4096, max_model_len=16, available_memory=1 << 16, max_in_flight_tokens=8))
    out["hisparse_max_concurrency"] = (ph.hisparse_max_concurrency, dict(num_blocks=10, device_blocks=3,
                                                                         host_num_blocks=20, host_blocks=4))
    out["hisparse_steady_state_concurrency"] = (ph.hisparse_steady_state_concurrency, dict(
        num_blocks=10, admission_blocks=3, steady_blocks=2, host_num_blocks=20, host_blocks=4))
    # the planned KV tensors' layout: strides, offsets (#22)
    from kvref.spec import kv_cache_tensors as kt

    out["page_shape"] = (kt.page_shape, dict(spec=FULL))
    out["layout_strides"] = (kt.layout_strides, dict(spec=FULL, num_blocks=4, num_layers=2, kv_cache_layout="BLHNC",
                                                     block_stride=64))
    out["kv_cache_tensors"] = (kt.kv_cache_tensors, dict(groups=[GROUP, KVCacheGroupSpec(("l1",), SWA)],
                                                         num_blocks=4, kv_cache_layout="LBNHC"))
    # pipeline/tensor-parallel planning over several workers (#22)
    from kvref.spec import planning_parallel as pp

    stages = [{"l0": FULL}, {"l1": SWA}]
    out["plan_kv_cache_workers"] = (pp.plan_kv_cache_workers, dict(
        kv_cache_specs=stages, config=_engine(), available_memory=[1 << 20, 1 << 20], kv_cache_layout="LBNHC",
        tensor_parallel_size=2, max_tp_shards={"l0": 1}, draft_layers=["l1"]))
    out["mark_eagle_groups"] = (pp.mark_eagle_groups, dict(groups=(GROUP,), draft_layers=["l0"]))
    out["check_hisparse_first_group"] = (hl.check_hisparse_first_group, dict(
        block_sizes=[2, 2], model_versions=[None, None], non_mla_layers=[]))
    out["merge_worker_kv_cache_specs"] = (pp.merge_worker_kv_cache_specs, dict(kv_cache_specs=stages))
    out["project_kv_cache_groups_to_worker"] = (pp.project_kv_cache_groups_to_worker, dict(
        global_groups=(GROUP, KVCacheGroupSpec(("l1",), SWA)), worker_layers={"l0": FULL}))
    out["kv_cache_groups_tp_replicas"] = (pp.kv_cache_groups_tp_replicas, dict(
        groups=(GROUP,), tensor_parallel_size=4, dcp_world_size=1, max_tp_shards={"l0": 1}, global_groups=(GROUP,)))
    return out


def _hf_example(name: str) -> dict:
    import json
    from importlib import resources

    return json.loads((resources.files("kvref") / "examples" / "hf_configs" / f"{name}.json").read_text())


def _hit(key):
    from kvref.impl.reference.offload.keys import LookupResult

    return LookupResult.HIT


def _event_payload() -> bytes:
    import msgspec

    return msgspec.msgpack.encode([0.0, [], None])


# ------------------------------------------------------------------ wrong values of the right type

def _foreign_block():
    """A block of another pool (same id range: only its identity says it is not ours)."""
    from kvref.impl.reference.block_pool import BlockPool

    return BlockPool(9, True, 4).get_new_blocks(2)[1]


def _other_request(rid: str = "r0"):
    """Same id as a live request, different content (vLLM: a request id is used once)."""
    from kvref.impl.request import Request, RequestStatus

    r = Request(rid, [7] * 5, max_tokens=1)
    r.status = RequestStatus.FINISHED
    return r


def near_misses(value: Any) -> list[Any]:
    """Values shaped like ``value`` but wrong in content: a bool for an int, a wrong element type
    in a list of the right length, too short/long lists, a tuple where a list is mutated, a huge
    list, blocks of another pool or the null block, a spec of another kind or block size, bytes of
    the wrong length, a finished request reusing an id. Some may be valid: a call then has to work."""
    from kvref.impl.reference.kv_cache_block import KVCacheBlock
    from kvref.impl.request import Request
    from kvref.spec.kv_cache_interface import KVCacheSpec

    out: list[Any] = []
    if type(value) is int:
        out += [value == 0, value + 10**6, -value - 1, float(value)]
    elif type(value) is float:
        out += [int(value) + 10**9, -1.0]
    elif isinstance(value, bool):
        out += [int(value), "true"]
    elif isinstance(value, bytes):
        out += [value[:-1], value + b"\x00", value.hex(), bytearray(value)]
    elif isinstance(value, str):
        out += [value + "?" * 1000, value.encode(), " " + value]
    elif isinstance(value, KVCacheBlock):
        out += [_foreign_block(), value.block_id]
    elif isinstance(value, Request):
        out += [_other_request(value.request_id), value.request_id]
    elif isinstance(value, KVCacheSpec):
        from dataclasses import replace

        out += [SWA if type(value) is not SlidingWindowSpec else FULL, replace(value, block_size=8)]
        out += [MambaSpec(block_size=4, shapes=((2, 3),), dtypes=("float16",))]
    elif isinstance(value, (list, tuple)):
        items = list(value)
        out += [tuple(items) if isinstance(value, list) else items, items[:-1], items + items[-1:],
                [None] * len(items), ["x"] * len(items), (items or [0]) * 4096]
        if items and isinstance(items[0], KVCacheBlock):
            out += [[_foreign_block()] * len(items), items[:1] * 2]
        if items and isinstance(items[0], (list, tuple)):
            out += [[list(i) + [None] for i in items], [tuple(i) for i in items]]
    elif isinstance(value, dict):
        out += [{k: None for k in value}, dict.fromkeys([None], next(iter(value.values()), None)), list(value.items())]
    elif isinstance(value, (set, frozenset)):
        out += [list(value), {None}, set(range(10**4))]
    return out
