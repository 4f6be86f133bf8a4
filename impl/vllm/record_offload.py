"""A recorded run of vLLM's scheduler with vLLM's own ``OffloadingConnector`` (CPU offload), on CPU.

Not kvref's scripted connector: the connector vLLM ships, built by its ``KVConnectorFactory`` from a
``KVTransferConfig(kv_connector="OffloadingConnector")`` inside the recording scheduler, with its
real scheduler side (``OffloadingConnectorScheduler`` over a ``CPUOffloadingManager``): it decides
what to store to the CPU tier, which prefix it can load back and whether finished requests must
keep their blocks until their stores land. No model runs: a fake worker completes every transfer
job the connector scheduled one step later (``OffloadingWorkerMetadata``), reports the async loads
as received and the finished requests whose stores landed as sent, as vLLM's worker-side connector
would. The workload shares long prefixes on a pool too small to keep them, so requests come back
for prefixes the GPU cache evicted and the CPU tier still holds.

The trace (format 4) holds the connector's answers; ``kvref check-run`` replays it with the
reference scheduler (tests/record/test_record_connector.py). In impl/vllm: it imports vLLM.
"""

from __future__ import annotations

import os
import random
from collections import deque
from pathlib import Path

from kvref.spec.errors import InvalidFieldError


def _setup():
    from kvref.impl.interface import PoolConfig
    from kvref.impl.scheduler_types import SchedulerConfig
    from kvref.spec import EngineConfig, plan_kv_cache
    from kvref.spec.kv_cache_interface import FullAttentionSpec

    def build(async_scheduling: bool):
        cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, async_scheduling=async_scheduling)
        spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype="float16")
        # a small GPU pool that cannot keep the shared prefixes (the CPU tier must), planned as
        # startup plans it with --num-gpu-blocks-override 24
        engine = EngineConfig(block_size=16, max_model_len=256, num_gpu_blocks_override=24, **cfg.engine_settings())
        pool = PoolConfig.from_plan(plan_kv_cache({"full": spec}, engine, 0))
        return pool, cfg

    return build


def record_offloading_run(path: str | os.PathLike, seed: int = 0, steps: int = 120,
                          async_scheduling: bool = False, env=None) -> Path:
    """Record one run of vLLM's scheduler with its ``OffloadingConnector`` to ``path``; returns it."""
    if type(steps) is not int or steps < 1:
        raise InvalidFieldError("steps", steps, "an int >= 1")
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
    from vllm.v1.outputs import KVConnectorOutput

    from kvref.impl.vllm.record import recorded_vllm_scheduler
    from kvref.impl.vllm.scheduler import VllmEnv
    from kvref.impl.vllm.vrequest import vllm_request, vllm_sampling_params

    pool, cfg = _setup()(async_scheduling)
    env = env or VllmEnv()
    vc = env.vllm_config
    saved = vc.kv_transfer_config, os.environ.get("KVREF_RECORD")
    # vLLM's own connector, by name: the recording scheduler's vLLM builds it from the config
    vc.kv_transfer_config = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                             kv_connector_extra_config={"cpu_bytes_to_use": 1 << 22,
                                                                        "block_size": 16})
    os.environ["KVREF_RECORD"] = str(path)
    try:
        driver = recorded_vllm_scheduler(pool, cfg, env)
    finally:
        vc.kv_transfer_config = saved[0]
        if saved[1] is None:
            os.environ.pop("KVREF_RECORD", None)
        else:
            os.environ["KVREF_RECORD"] = saved[1]
    s = driver.scheduler
    v = driver._v
    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(1, 900) for _ in range(rng.choice((64, 96, 128)))) for _ in range(6)]
    depth = 2 if async_scheduling else 1
    queue: deque = deque()
    done_jobs: dict[int, int] = {}
    stats = driver.offload_jobs = {"loads": 0, "stores": 0}
    n = 0
    try:
        for step in range(steps):
            if step < steps - 40 and rng.random() < 0.45:
                prompt = rng.choice(prefixes) + tuple(rng.randrange(1, 900) for _ in range(rng.randint(1, 40)))
                # one request in six skips the prefix cache (prompt logprobs): vLLM ignores both hits
                sp = vllm_sampling_params(max_tokens=rng.randint(1, 12), ignore_eos=True,
                                          skip_reading_prefix_cache=rng.random() < 1 / 6)
                req = vllm_request(f"r{n}", list(prompt), sp, arrival_time=float(n), block_hasher=driver._hasher)
                n += 1
                s.add_request(req)
            if rng.random() < 0.03 and s.requests:
                s.finish_requests([rng.choice(sorted(s.requests))], v["VStatus"].FINISHED_ABORTED)
            so = s.schedule()
            meta = so.kv_connector_metadata
            jobs = dict(getattr(meta, "load_jobs", {}) or {}), dict(getattr(meta, "store_jobs", {}) or {})
            queue.append((so, jobs))
            stats["loads"] += len(jobs[0])
            stats["stores"] += len(jobs[1])
            if len(queue) < depth:
                continue
            so, (loads, stores) = queue.popleft()
            # the worker: every job of that step completed; its loads received
            for j in list(loads) + list(stores):
                done_jobs[j] = 1
            recving = {t.req_id for t in loads.values()}
            sending = {rid for rid, r in s.requests.items() if r.is_finished()
                       and rid not in {t.req_id for t in stores.values()}}
            rids = list(so.num_scheduled_tokens)
            sampled = [[rng.randrange(1, 900)] if r in s.requests and not s.requests[r].is_prefill_chunk else []
                       for r in rids]
            mro = v["ModelRunnerOutput"](req_ids=rids, req_id_to_index={r: i for i, r in enumerate(rids)},
                                         sampled_token_ids=sampled)
            mro.kv_connector_output = KVConnectorOutput(
                finished_sending=sending or None, finished_recving=recving or None,
                kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs=dict(done_jobs)))
            done_jobs.clear()
            s.update_from_output(so, mro)
    finally:
        driver.close()
    return Path(path)


__all__ = ["record_offloading_run"]
