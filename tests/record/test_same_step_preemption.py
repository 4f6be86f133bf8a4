"""A vLLM 0.33.0 finding, reproduced on its own with vLLM's own ``Scheduler`` (issue #28; the
recorded connector run in ``data/same_step_preemption_hit.kvtrace.gz`` first showed it).

Under the PRIORITY policy ``schedule()`` may preempt a running request it already scheduled in the
same step (``preempted_req in scheduled_running_reqs``, vllm/v1/core/sched/scheduler.py). The
request's ``allocate_slots`` had already cached its new blocks under the hashes of the step's
tokens (``KVCacheManager.allocate_slots``: ``cache_blocks(request, min(total_computed_tokens +
num_new_tokens, request.num_tokens))``, before the step runs); ``_preempt_request`` frees them
with their hashes, and the step that would have written their KV never runs. A later lookup of
the same prefix — here the request itself, resumed — takes them as a hit: the model would attend
over KV that was never computed for those tokens. docs/record.md ("Findings") has the path.

Minimal case: a low-priority request A prefills in chunks ahead of a high-priority request B in
``running``; in step 2 A's chunk (tokens 20..27) gets the last two free blocks, then B's decode
needs one, so A — the lowest priority — is preempted after it was scheduled. B takes the tail
block; the block holding tokens 20..23 keeps its hash. When B finishes, A resumes with 24 computed
tokens although at most 20 were ever computed. The reference models vLLM as it is (same
decisions), which is why check-run's replay agrees and its hit-content property reports it.
"""

from __future__ import annotations

import pytest
from kvref.impl.interface import PoolConfig
from kvref.impl.reference.scheduler import Scheduler
from kvref.impl.request import Request
from kvref.impl.scheduler_types import PRIORITY, ModelOutput, SchedulerConfig
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

PROMPT_A = list(range(100, 132))


def _setup():
    groups = (KVCacheGroupSpec(("full",), FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8,
                                                            dtype="float16")),)
    cfg = SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=4, long_prefill_token_threshold=8,
                          policy=PRIORITY, scheduler_reserve_full_isl=False)
    pool = PoolConfig.off_plan("the smallest pool where the preempted request's cached block survives",
                               num_blocks=9, groups=groups, max_model_len=40, scheduler_block_size=4,
                               hash_block_size=4, max_in_flight_tokens=cfg.max_in_flight_tokens)
    return pool, cfg


def _run(s) -> list[tuple]:
    """Five steps; a fake model samples token 7 for every request whose step reached its end."""
    s.add_request(Request("A", PROMPT_A, max_tokens=4, priority=1, arrival_time=0.0))
    steps = []
    for i in range(5):
        if i == 1:
            s.add_request(Request("B", [1, 2, 3, 4], max_tokens=3, priority=0, arrival_time=1.0))
        out = s.schedule()
        steps.append(([(x.request_id, x.kind, x.num_computed_tokens, x.num_scheduled_tokens) for x in out.scheduled],
                      sorted(out.preempted_req_ids)))
        known = {"A": len(PROMPT_A), "B": 4}
        s.update_from_output(out, ModelOutput({x.request_id: [7] for x in out.scheduled
                                               if x.num_computed_tokens + x.num_scheduled_tokens >= known[x.request_id]}))
    return steps


def _computed_before_preemption(steps) -> int:
    """What A's steps computed before it was first preempted (their ends)."""
    done = 0
    for rows, pre in steps:
        if "A" in pre:
            return done
        done = max([done] + [c + n for rid, _k, c, n in rows if rid == "A"])
    raise AssertionError("A was never preempted")


def test_vllm_resumes_a_request_over_blocks_its_preempted_step_never_computed():
    require_vllm()
    from kvref.impl.vllm.scheduler import VllmEnv, VllmScheduler

    pool, cfg = _setup()
    steps = _run(VllmScheduler(pool, cfg, VllmEnv()))
    # step 2: A was given its chunk (its rows would show it) and then preempted for B
    assert steps[2] == ([("B", "running", 4, 1)], ["A"])
    resumed = [(c, n) for rows, _ in steps for rid, kind, c, n in rows if rid == "A" and kind == "resumed"]
    computed = _computed_before_preemption(steps)
    assert computed == 20 and resumed, steps
    # the hit covers the 4 tokens of the chunk that never ran
    assert resumed[0][0] == 24 > computed, steps


def test_the_reference_makes_the_same_decisions():
    """The reference mirrors vLLM here (kvref models vLLM as it is): same steps, same resume."""
    require_vllm()
    from kvref.impl.vllm.scheduler import VllmEnv, VllmScheduler

    pool, cfg = _setup()
    assert _run(Scheduler(pool, cfg)) == _run(VllmScheduler(pool, cfg, VllmEnv()))


def test_check_run_reports_the_minimal_case_recorded_from_vllm(tmp_path, monkeypatch):
    """The same five steps recorded through ``scheduler_cls`` (as a server would): the replay agrees
    (the reference does what vLLM does) and the hit-content property names the resumed request's
    hit over a block that was never filled, and why."""
    require_vllm()
    from kvref.impl.vllm.record import recorded_vllm_scheduler
    from kvref.impl.vllm.scheduler import VllmEnv
    from kvref.models.run_check import check_trace

    path = tmp_path / "same-step.kvtrace.gz"
    monkeypatch.setenv("KVREF_RECORD", str(path))
    pool, cfg = _setup()
    s = recorded_vllm_scheduler(pool, cfg, VllmEnv())
    try:
        _run(s)
    finally:
        s.close()
    r = check_trace(path, check_invariants_every=1)
    assert r.followed and r.divergence is None
    hits = [f for f in r.findings if f.kind == "wrong_hit"]
    assert hits and all(f.message.startswith("A's prefix-cache hit of 24 tokens") for f in hits), r.findings
    assert "already scheduled in the same step" in hits[0].message
    assert {f.kind for f in r.findings} == {"wrong_hit"}
