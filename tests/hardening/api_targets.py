"""Public entry points of the API with one valid set of arguments each, for the fuzz tests.

A fuzz case takes one target, replaces one argument by a wrong value (type, sign, size) and
requires a ``ValueError`` subclass or success — never ``TypeError``/``AttributeError``/
``AssertionError``/``OverflowError`` or a hang — and, for a method, the object's state unchanged
and its invariants holding after a rejected call.
"""

from __future__ import annotations

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


def constructors() -> dict[str, tuple[Callable[..., Any], dict[str, Any]]]:
    """name -> (callable, valid keyword arguments)."""
    from kvref.impl.interface import PoolConfig
    from kvref.impl.reference.block_pool import BlockPool
    from kvref.impl.reference.kv_cache_manager import KVCacheManager
    from kvref.impl.reference.offload.cpu_offloading_manager import CPUOffloadingManager
    from kvref.impl.reference.offload.offloading_scheduler import (
        OffloadingConnectorScheduler as OffloadingScheduler,
    )
    from kvref.impl.reference.offload.simple_cpu_offload_scheduler import (
        SimpleCPUOffloadScheduler,
    )
    from kvref.impl.reference.scheduler import Scheduler
    from kvref.impl.scheduler_types import SchedulerConfig
    from kvref.impl.request import Request
    from kvref.spec.config import EngineConfig

    pc = pool_config()
    out = {
        "PoolConfig": (PoolConfig, dict(num_blocks=9, groups=(GROUP,), max_model_len=32, scheduler_block_size=4,
                                        hash_block_size=4, max_in_flight_tokens=None, enable_caching=True,
                                        watermark=0.0, use_eagle=False)),
        "BlockPool": (BlockPool, dict(num_gpu_blocks=9, enable_caching=True, hash_block_size=4)),
        "KVCacheManager": (KVCacheManager, dict(config=pc)),
        "SchedulerConfig": (SchedulerConfig, dict(max_num_batched_tokens=16, max_num_seqs=4,
                                                  long_prefill_token_threshold=0, enable_chunked_prefill=True,
                                                  policy="fcfs", scheduler_reserve_full_isl=True,
                                                  async_scheduling=False)),
        "Scheduler": (lambda pool, config: Scheduler(pool, config),
                      dict(pool=pool_config(max_in_flight_tokens=16), config=SchedulerConfig(max_num_batched_tokens=16))),
        "Request": (Request, dict(request_id="r0", prompt_token_ids=[1, 2, 3], max_tokens=2, cache_salt=None,
                                  priority=0, arrival_time=0.0)),
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
        "SlidingWindowSpec": (SlidingWindowSpec, dict(block_size=4, num_kv_heads=1, head_size=4, dtype="bfloat16",
                                                      sliding_window=4)),
        "ChunkedLocalAttentionSpec": (ChunkedLocalAttentionSpec, dict(block_size=4, num_kv_heads=1, head_size=4,
                                                                      dtype="bfloat16", attention_chunk_size=8)),
        "MambaSpec": (MambaSpec, dict(block_size=4, shapes=((2, 3),), dtypes=("float16",))),
        "KVCacheGroupSpec": (KVCacheGroupSpec, dict(layer_names=("l0",), kv_cache_spec=FULL, is_eagle_group=False)),
        "EngineConfig": (EngineConfig, dict(max_model_len=1024, derived_max_model_len=4096)),
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
        out["DataPathRunner"] = (lambda num_layers, num_q_heads, seed, attention_backend: DataPathRunner(
            TorchKVCacheManager(pool_config(), device="cpu"), num_layers, num_q_heads, seed=seed,
            attention_backend=attention_backend), dict(num_layers=1, num_q_heads=None, seed=0,
                                                       attention_backend="torch"))
    except ImportError:  # pragma: no cover - torch is a test dependency
        pass
    return out


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

    connector_case("on_new_request", lambda s, r0, r1: dict(req=r1))
    connector_case("get_num_new_matched_tokens", lambda s, r0, r1: dict(req=r0, num_computed_tokens=0))
    connector_case("update_state_after_alloc", lambda s, r0, r1: dict(req=r0, blocks=[[(1, False), (2, False)]],
                                                                      num_external_tokens=0))
    connector_case("request_finished", lambda s, r0, r1: dict(req=r0, aborted=False))
    connector_case("update_connector_output", lambda s, r0, r1: dict(completed_jobs={}))
    return cases
