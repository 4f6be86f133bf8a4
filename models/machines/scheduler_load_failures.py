"""Synchronous KV loads that fail in blocks other requests share (#22).

A sync load's blocks are cached when they are allocated (``allocate_slots`` caches every full
block up to the scheduled tokens, loaded ones included), so a request admitted behind the loader
in the same step, or in the next one under async scheduling, with the same prompt hits them
locally before the worker has written them. When the worker then reports one of them invalid,
vLLM's ``_update_requests_with_invalid_blocks`` scans the running requests in order: the loader
marks the block and truncates its computed tokens there; a later request finding the block
already marked keeps it as computed ("only the first will recompute it") and, if none of its
invalid blocks was its own to mark, only takes back the tokens of the settled step. Under
``kv_load_failure_policy="fail"`` every affected request is finished as an error.

``conform-connector``'s machines need a sync load on a single-group pool, a request sharing its
blocks and a report naming one of them in the same settled step: no check's traces reached the
scan's "already marked" branch (vLLM scheduler.py 3651, 3679-3682) in the whole-list ci run of
session 16, and the lifecycle machine at seed 0 (96 traces) had no shared invalid block. This
run builds the situation on purpose and draws the rest: the block size, sync or async
scheduling, the failure policy, the prompts (one or two, each arrival repeating one, with its own
tail or none), which arrivals the store holds (the first of each prompt: the whole prompt, the
others: nothing or a prefix), which of the loaded blocks the worker reports invalid, and whether
a second step is scheduled before the report. The reference scheduler and vLLM's run in lock step
with the same scripted connector (:class:`~kvref.models.machines.scheduler_connector.ConnectorLockstep`:
queues, request states, computed tokens, block tables, free blocks and the connector's calls
compared after every operation), then drain to the end.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import strategies as st

from kvref.impl.interface import PoolConfig
from kvref.impl.reference.scheduler_connector import FAIL, RECOMPUTE, ConnectorConfig, ExternalHit, KVConnectorOutput
from kvref.impl.scheduler_types import SchedulerConfig
from kvref.spec import EngineConfig, plan_kv_cache
from kvref.spec.kv_cache_interface import FullAttentionSpec

from .scheduler import RequestSpec, SchedulerRun, run_generated_histories

COVERAGE: Counter = Counter()
"""Tallies of what the cases reached (tests assert the rare ones occur)."""

MAX_MODEL_LEN = 64


@st.composite
def load_failure_cases(draw):
    """``(pool, config, policy, arrivals, invalid picks, second step first)``: ``arrivals`` are
    ``(RequestSpec, ExternalHit)`` in arrival order; ``invalid picks`` index the first step's
    sync-loaded blocks (taken modulo their number)."""
    bs = draw(st.sampled_from((2, 4, 8)))
    is_async = draw(st.booleans())
    cfg = SchedulerConfig(max_num_batched_tokens=draw(st.sampled_from((32, 64))), max_num_seqs=4,
                          async_scheduling=is_async)
    # a roomy pool, planned as startup plans it (--num-gpu-blocks-override: room for four
    # max-length requests), so only the planted load failures decide what is recomputed
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=8, dtype="float16")
    engine = EngineConfig(block_size=bs, max_model_len=MAX_MODEL_LEN,
                          num_gpu_blocks_override=4 * (MAX_MODEL_LEN // bs) + 4, **cfg.engine_settings())
    pool = PoolConfig.from_plan(plan_kv_cache({"full": spec}, engine, 0))
    policy = draw(st.sampled_from((RECOMPUTE, RECOMPUTE, FAIL)))
    prompts = [tuple(range(100 * (i + 1), 100 * (i + 1) + draw(st.integers(2 * bs, 5 * bs))))
               for i in range(draw(st.integers(1, 2)))]
    arrivals, loaded = [], set()
    for i in range(draw(st.integers(2, 4))):
        p = draw(st.integers(0, len(prompts) - 1))
        tail = tuple(range(1000 + 10 * i, 1000 + 10 * i + draw(st.integers(0, 3))))
        prompt = prompts[p] + tail
        if p not in loaded:  # the first arrival of each prompt: the store holds the whole of it
            loaded.add(p)
            hit = ExternalHit(num_tokens=len(prompt))
        else:
            hit = ExternalHit(num_tokens=draw(st.sampled_from((0, 0, len(prompt) // 2))))
        arrivals.append((RequestSpec(f"r{i}", prompt, max_tokens=draw(st.integers(1, 4)), priority=0,
                                     arrival_time=float(i)), hit))
    picks = draw(st.lists(st.integers(0, 64), min_size=1, max_size=2, unique=True))
    return pool, cfg, policy, arrivals, picks, is_async and draw(st.booleans())


def run_case(factories, case) -> int:
    """One case in lock step; returns the number of operations."""
    from .scheduler_connector import ConnectorLockstep

    pool, cfg, policy, arrivals, picks, second_first = case
    d = ConnectorLockstep(pool, cfg, factories, ConnectorConfig(kv_load_failure_policy=policy))
    for spec, hit in arrivals:
        d.add_with_hit(spec, hit)
    d.schedule()
    bs = pool.scheduler_block_size
    loaded = [b for at, _, block_ids, local, ext in d.script.sync_loads if at == 0
              for b in block_ids[0][local // bs: -(-(local + ext) // bs)]]
    ops = len(arrivals) + 1
    if second_first:  # async: the next step is scheduled before the first one's report
        d.schedule()
        ops += 1
    invalid = tuple(dict.fromkeys(loaded[i % len(loaded)] for i in picks)) if loaded else ()
    held = [b for rid, groups in d.last_snapshot.block_ids.items() for b in set(groups[0])]
    shared = [b for b in invalid if held.count(b) > 1]
    COVERAGE["sync_loads_failing"] += bool(invalid)
    COVERAGE["invalid_block_shared"] += bool(shared)
    COVERAGE[f"invalid_block_shared_{policy}"] += bool(shared)
    d.complete(report=KVConnectorOutput(invalid_block_ids=invalid))
    ops += 1
    return ops + d.drain()


def run_load_failure_cases(examples: int, reproducible: bool = False, shrink: bool = True,
                           seed: int | None = None) -> SchedulerRun:
    """``examples`` generated cases, the reference scheduler in lock step with vLLM 0.33.0's."""
    from hypothesis import HealthCheck, Phase, given, settings

    from .scheduler_connector import reference_factory, vllm_factory

    factories = {"vllm": vllm_factory(), "ref": reference_factory}
    counted = {"traces": 0, "ops": 0}
    COVERAGE.clear()

    @settings(max_examples=examples, deadline=None, database=None, derandomize=reproducible,
              suppress_health_check=list(HealthCheck), phases=list(Phase) if shrink else [Phase.generate])
    @given(load_failure_cases())
    def run(case):
        counted["traces"] += 1
        counted["ops"] += run_case(factories, case)

    return run_generated_histories(run, counted, COVERAGE, seed, reproducible)
