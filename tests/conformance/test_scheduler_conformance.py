"""Conformance of kvref's scheduler subset with vLLM 0.33.0's ``Scheduler`` / ``AsyncScheduler``.

One Hypothesis machine drives three targets with identical operations (arrivals with shared
prefixes, scheduling steps, fake model outputs fed back through ``update_from_output``, aborts),
sync and async (two batches in flight), FCFS and PRIORITY, FA / FA+SWA / FA+chunked-local /
FA+Mamba pools, tight pools (preemption, exhaustion) and startup-inconsistent ones (head-of-line):

* ``vllm``: vLLM's own scheduler and KV cache manager;
* ``ref``: the reference scheduler on the reference KVCacheManager;
* ``ref+vllmkv``: the reference scheduler on vLLM's KVCacheManager (isolates scheduling rules).

After every operation it compares scheduled ids in batch order with kinds, token counts, computed
tokens and new block ids per group (exactly), preempted and finished ids, waiting/running contents
and order, every request's state, block tables and free-block counts. At teardown, on
startup-consistent setups, it drains the engine and checks liveness against ``drain_bound``.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

from kvref.impl.interface import PoolConfig
from kvref.impl.reference.scheduler_liveness import liveness_guaranteed, startup_consistent
from kvref.impl.scheduler_types import SchedulerConfig
from kvref.impl.request import Request
from kvref.models.machines.scheduler import COVERAGE, Lockstep, RequestSpec, machine_with, scheduler_setups
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec, SlidingWindowSpec
from tests.conftest import profile_examples
from tests.conformance.scheduler_targets import scheduler_targets as _targets
from tests.conformance.scheduler_targets import vllm_env  # noqa: F401 - the module-scoped fixture

pytestmark = pytest.mark.vllm

MIN_STEPS = 30
STEP_COUNT = 45


def test_generated_traces_match_vllm(vllm_env):
    """>= 200 traces of >= 30 steps under the ci profile (each step compared on all targets)."""
    machine = machine_with(_targets(vllm_env), name="SchedulerConformance")
    COVERAGE.clear()
    run_state_machine_as_test(machine, _min_steps=MIN_STEPS + 1,  # the initialize step counts as one
                              settings=settings(max_examples=profile_examples(40, 200),
                                                stateful_step_count=STEP_COUNT))
    # the generator must keep reaching the rare paths, or the comparison above proves little
    rare = ("preemptions", "scheduled_resumed", "prefix_hits", "prefill_chunks", "finished_stop", "finished_length", "idle_with_waiting", "steps_async", "steps_sync")
    print("scheduler conformance coverage:", dict(COVERAGE))
    if not profile_examples(False, True):
        return  # the fast profile's 40 traces are too few to promise every rare path
    missing = [k for k in rare if COVERAGE[k] == 0]
    assert not missing, f"paths never exercised: {missing} (coverage {dict(COVERAGE)})"


def test_generated_async_priority_traces_match_vllm(vllm_env):
    """Extra weight on the two rarest paths: async in-flight tokens and PRIORITY preemption."""
    machine = machine_with(_targets(vllm_env, shim=False),
                           setups=scheduler_setups(async_scheduling=True, policy="priority", tight=True),
                           name="AsyncPriorityConformance")
    COVERAGE.clear()
    run_state_machine_as_test(machine, _min_steps=MIN_STEPS + 1,
                              settings=settings(max_examples=profile_examples(15, 100),
                                                stateful_step_count=STEP_COUNT))
    print("async/priority coverage:", dict(COVERAGE))
    if profile_examples(False, True):
        assert COVERAGE["preemptions"] and COVERAGE["stale_outputs"], dict(COVERAGE)


def test_generated_large_traces_match_vllm(vllm_env):
    """vLLM-like sizes: blocks of 16/32 tokens, contexts up to 1024, budgets up to 512."""
    machine = machine_with(_targets(vllm_env, shim=False), setups=scheduler_setups(large=True),
                           name="LargeSchedulerConformance")
    run_state_machine_as_test(machine, _min_steps=MIN_STEPS + 1,
                              settings=settings(max_examples=profile_examples(10, 100),
                                                stateful_step_count=STEP_COUNT))


def _fa_swa_pool(num_blocks: int, max_model_len: int, cfg: SchedulerConfig) -> PoolConfig:
    fa = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16")
    swa = SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16", sliding_window=8)
    return PoolConfig(num_blocks=num_blocks, groups=(KVCacheGroupSpec(("full",), fa), KVCacheGroupSpec(("swa",), swa)),
                      max_model_len=max_model_len, scheduler_block_size=4, hash_block_size=4,
                      max_in_flight_tokens=cfg.max_in_flight_tokens)


@pytest.mark.parametrize("is_async", [False, True])
def test_head_of_line_hang_on_vllm_and_reference(vllm_env, is_async):
    """vLLM #39734 / #35541: a waiting request whose full-sequence gate can never pass (the pool
    is smaller than max_model_len needs) sits at the head forever and blocks the small request
    behind it; nothing is ever scheduled. Both vLLM and the reference do exactly this."""
    cfg = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4, async_scheduling=is_async)
    pool = _fa_swa_pool(num_blocks=12, max_model_len=128, cfg=cfg)  # full group alone needs 32 + 1
    assert not startup_consistent(pool, cfg)
    d = Lockstep(pool, cfg, _targets(vllm_env))
    d.add(RequestSpec("big", tuple(range(100)), max_tokens=4, priority=0, arrival_time=0.0))
    d.add(RequestSpec("small", (1, 2, 3), max_tokens=2, priority=0, arrival_time=1.0))
    for _ in range(40):
        d.engine_step()  # compares every target after each call
    snap = d.snapshots()["vllm"]
    assert snap.waiting == ("big", "small") and snap.running == ()
    assert d.num_schedules >= 20
    assert all(s.status == "waiting" and s.num_computed_tokens == 0 for s in snap.requests.values())


def test_startup_consistent_pool_serves_the_same_requests(vllm_env):
    """The same two requests with a startup-consistent pool: both finish on every target."""
    cfg = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4)
    pool = _fa_swa_pool(num_blocks=40, max_model_len=128, cfg=cfg)
    assert startup_consistent(pool, cfg)
    d = Lockstep(pool, cfg, _targets(vllm_env))
    d.add(RequestSpec("big", tuple(range(100)), max_tokens=4, priority=0, arrival_time=0.0))
    d.add(RequestSpec("small", (1, 2, 3), max_tokens=2, priority=0, arrival_time=1.0))
    d.drain()
    snap = d.snapshots()["vllm"]
    assert {s.finish_reason for s in snap.requests.values()} == {"length"}
    assert len(snap.requests["big"].output_token_ids) == 4


@settings(max_examples=profile_examples(10, 40))
@given(setup=scheduler_setups(consistent=True), prompt_len=st.integers(1, 200), max_tokens=st.integers(1, 8))
def test_lone_request_is_served_when_startup_consistent(vllm_env, setup, prompt_len, max_tokens):
    """Liveness, the second half: a request that passes the startup check is scheduled and
    finishes when it is alone — on vLLM and on the reference, with identical steps."""
    pool, cfg = setup
    prompt = tuple(range(min(prompt_len, pool.max_model_len - 1)))
    d = Lockstep(pool, cfg, _targets(vllm_env, shim=False))
    d.add(RequestSpec("solo", prompt, max_tokens=max_tokens, priority=0, arrival_time=0.0))
    d.schedule()
    assert d.snapshots()["vllm"].running == ("solo",)
    d.drain()
    assert d.snapshots()["vllm"].requests["solo"].status == "finished"


def test_vllm_async_scheduler_keeps_tokens_in_flight(vllm_env):
    """How async is exercised on CPU: CpuPlatform forces async_scheduling=False while building
    the config; the adapter re-enables the flag and builds vLLM's AsyncScheduler. Two schedules
    before any output leave two steps' tokens in flight and one output placeholder per step."""
    mod, env = vllm_env
    cfg = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=2, async_scheduling=True)
    pool = _fa_swa_pool(num_blocks=40, max_model_len=64, cfg=cfg)
    s = mod.VllmScheduler(pool, cfg, env)
    assert type(s.scheduler).__name__ == "AsyncScheduler"
    assert env.vllm_config.max_in_flight_tokens == 32
    s.add_request(Request("a", list(range(10)), max_tokens=5))
    o1 = s.schedule()
    o2 = s.schedule()
    st_a = s.snapshot().requests["a"]
    assert [x.num_scheduled_tokens for x in o1.scheduled + o2.scheduled] == [10, 1]
    assert (st_a.num_in_flight_tokens, st_a.num_output_placeholders, st_a.num_computed_tokens) == (11, 2, 11)


@pytest.mark.parametrize("is_async", [False, True])
def test_priority_ties_livelock_without_the_full_sequence_gate(vllm_env, is_async):
    """Found by kvref's liveness search, reproduced on vLLM 0.33.0: under PRIORITY the victim is
    ``max(running, key=(priority, arrival_time))`` — the *first* maximal one, i.e. the oldest
    running request when keys tie (the waiting queue breaks ties by request id, the victim choice
    does not). With ``scheduler_reserve_full_isl=False`` preempted requests are re-admitted chunk by
    chunk at the end of ``running`` and the requests take turns preempting each other: no token is
    ever sampled. Distinct arrival times (what vLLM's clock normally gives) drain in ~25 steps."""

    def run(arrivals):
        cfg = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=3, long_prefill_token_threshold=4,
                              policy="priority", scheduler_reserve_full_isl=False, async_scheduling=is_async)
        fa = KVCacheGroupSpec(("full",), FullAttentionSpec(block_size=8, num_kv_heads=1, head_size=8, dtype="float16"))
        pool = PoolConfig(num_blocks=5, groups=(fa,), max_model_len=32, scheduler_block_size=8, hash_block_size=8,
                          max_in_flight_tokens=cfg.max_in_flight_tokens, enable_caching=False)
        assert startup_consistent(pool, cfg)
        d = Lockstep(pool, cfg, _targets(vllm_env, shim=False))
        for i, (n, max_tokens) in enumerate([(26, 4), (28, 10), (27, 10)]):
            d.add(RequestSpec(f"r{i}", tuple(range(100 * i, 100 * i + n)), max_tokens, 0, arrivals[i]))
        for _ in range(300):
            if not (d.unfinished() or d.num_in_flight()):
                break
            d.engine_step()
        return d.snapshots()["vllm"]

    tied = run([0.0, 0.0, 0.0])
    assert all(not s.output_token_ids for s in tied.requests.values())
    assert sum(s.num_preemptions for s in tied.requests.values()) > 50
    distinct = run([0.0, 1.0, 2.0])
    assert all(s.status == "finished" for s in distinct.requests.values())


# One-line faults of the scheduling rules (the wrong victim, no head-of-line blocking, the
# long-prefill threshold when alone, ...) are catalogue mutants now
# (kvref.models.mutants.catalogue_scheduler): tests/models/test_mutants_scheduler.py asserts that
# the campaign's scheduler-vllm check, this machine against vLLM, kills every one of them.


def _fa_mamba_fine_pool(num_blocks: int, cfg: SchedulerConfig) -> PoolConfig:
    """FA + align-mode Mamba, both with 4-token blocks hashed per 2 tokens (fine-grained hits)."""
    fa = KVCacheGroupSpec(("full",), FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16"))
    mamba = KVCacheGroupSpec(("mamba",), MambaSpec(block_size=4, shapes=((2, 8),), dtypes=("float16",),
                                                   mamba_cache_mode="align"))
    return PoolConfig(num_blocks=num_blocks, groups=(fa, mamba), max_model_len=32, scheduler_block_size=4,
                      hash_block_size=2, max_in_flight_tokens=cfg.max_in_flight_tokens, enable_caching=True)


@pytest.mark.parametrize("is_async", [False, True])
def test_partial_hit_copy_on_write_hangs_a_startup_consistent_pool(vllm_env, is_async):
    """Found by the Mamba-align scheduler machine's liveness check (CI, 2026-11, a request
    preempted mid-prefill), reproduced on vLLM 0.33.0 (docs/proofs.md Findings 3). A 31-token
    prompt is served and its blocks stay cached; the same prompt arrives again. Its cached prefix
    ends inside a 4-token block (hits are per 2 tokens, the last token is never a hit), and the
    full-sequence gate counts every touched hit that sits in the free queue plus a copy-on-write
    block for the shared tail: 11 blocks, one more than the 10 the startup check charges for a
    ``max_model_len`` request. It waits forever with the whole pool free. One block more and the
    same trace drains; :func:`liveness_guaranteed` asks one per group that can take a partial hit
    (the Mamba group's gate can also count a new state block, its copy and a touched hit: one over
    its startup two)."""
    cfg = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=2, async_scheduling=is_async)
    prompt = (24, 48, 26, 2, 16, 32, 31, 25, 19, 30, 22, 37, 13, 32, 8, 18, 8, 48, 6, 39, 16, 34, 45, 38,
              9, 19, 6, 46, 4, 43, 21)

    def steps(d, n):
        for _ in range(n):
            if not (d.unfinished() or d.num_in_flight()):
                return
            d.engine_step()

    def run(num_blocks):
        pool = _fa_mamba_fine_pool(num_blocks, cfg)
        d = Lockstep(pool, cfg, _targets(vllm_env, shim=False))
        d.add(RequestSpec("first", prompt, max_tokens=1, priority=0, arrival_time=0.0))
        steps(d, 20)
        if d.snapshots()["vllm"].requests["first"].status == "finished":
            d.add(RequestSpec("again", prompt, max_tokens=1, priority=0, arrival_time=1.0))
            steps(d, 40)
        return pool, d.snapshots()["vllm"]

    pool, hung = run(11)
    assert startup_consistent(pool, cfg) and not liveness_guaranteed(pool, cfg)
    if is_async:
        # Findings 2 first: with a batch in flight the align-mode Mamba group holds one state
        # more than startup charges, so the lone request preempts itself at 30 of 31 tokens;
        # its own cached blocks then end inside a block and the gate never lets it back
        assert hung.requests["first"].num_preemptions == 1
        assert (hung.waiting, hung.running, hung.num_free_blocks) == (("first",), (), 10)
    else:
        assert hung.requests["first"].status == "finished"
        assert (hung.waiting, hung.running, hung.num_free_blocks) == (("again",), (), 10)
    pool, drained = run(12)
    assert all(s.status == "finished" for s in drained.requests.values())
    assert not liveness_guaranteed(pool, cfg) and liveness_guaranteed(_fa_mamba_fine_pool(13, cfg), cfg)


@pytest.mark.parametrize("scheduled_cap", [None, 2, 8, 16])
def test_align_split_capped_above_the_input_budget_hangs_vllm(vllm_env, scheduled_cap):
    """Found by the Mamba-align scheduler machine's liveness check (CI, 2026-11-28), reproduced on
    vLLM 0.33.0 (docs/proofs.md Findings 4). vLLM's align split floors a non-final chunk to a block
    boundary when the block fits ``max_num_scheduled_tokens``, but the chunk is bounded by
    ``max_num_batched_tokens`` too: with the scheduled cap at 8 or more, an input budget of 4 and
    8-token Mamba blocks, the 5-token prompt's 4-token chunk is floored to 0 every step and the
    request waits forever with the pool free. Without the larger cap (or with a smaller one) the
    chunk advances sub-block and the same trace drains."""
    from kvref.impl.reference.scheduler_liveness import align_split_stalls, liveness_hazard

    cfg = SchedulerConfig(max_num_batched_tokens=4, max_num_seqs=1, max_num_scheduled_tokens=scheduled_cap)
    fa = KVCacheGroupSpec(("full",), FullAttentionSpec(block_size=8, num_kv_heads=1, head_size=8, dtype="float16"))
    mamba = KVCacheGroupSpec(("mamba",), MambaSpec(block_size=8, shapes=((2, 8),), dtypes=("float16",),
                                                   mamba_cache_mode="align"))
    pool = PoolConfig(num_blocks=11, groups=(fa, mamba), max_model_len=61, scheduler_block_size=8, hash_block_size=8,
                      max_in_flight_tokens=cfg.max_in_flight_tokens, enable_caching=True)
    d = Lockstep(pool, cfg, _targets(vllm_env, shim=False))
    d.add(RequestSpec("r0", (24, 48, 26, 2, 16), max_tokens=1, priority=0, arrival_time=0.0))
    for _ in range(12):
        if not (d.unfinished() or d.num_in_flight()):
            break
        d.engine_step()  # every target compared after every call
    snap = d.snapshots()["vllm"]
    stalls = scheduled_cap is not None and scheduled_cap >= 8
    assert startup_consistent(pool, cfg)
    assert align_split_stalls(pool, cfg) is stalls
    if stalls:
        assert liveness_hazard(pool, cfg) == "align-split-stall"
        assert (snap.waiting, snap.running, snap.num_free_blocks) == (("r0",), (), 10)
        assert snap.requests["r0"].num_computed_tokens == 0
    else:
        assert liveness_guaranteed(pool, cfg)
        assert snap.requests["r0"].status == "finished"



def _prefix_hit_trace(vllm_env) -> dict[str, int]:
    """Two requests with the same 12-token prompt on an FA + SWA pool of 4-token blocks (hash blocks
    of the same size; a hybrid pool: vLLM's single-group coordinator asserts the two sizes equal
    itself): the second arrives after the first was computed. Returns the computed tokens
    each new request was admitted with (every target compared after every call)."""
    cfg = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=2)
    pool = _fa_swa_pool(num_blocks=24, max_model_len=32, cfg=cfg)
    d = Lockstep(pool, cfg, _targets(vllm_env, shim=False))
    admitted = {}
    for rid, t in (("a", 0.0), ("b", 1.0)):
        d.add(RequestSpec(rid, tuple(range(12)), max_tokens=3, priority=0, arrival_time=t))
        out = d.schedule()
        admitted.update((s.request_id, s.num_computed_tokens) for s in out.scheduled if s.kind == "new")
        d.complete()
    assert d.targets["vllm"].scheduler.hash_block_size == 4
    d.drain()
    return admitted


def test_vllm_default_hash_block_size_is_the_block_size(vllm_env):
    """Pools whose hash block size is the scheduler's block size build vLLM's scheduler without
    ``hash_block_size`` (its default, ``block_size``, vLLM ``Scheduler.__init__``): the second
    request hits the first one's 2 full blocks on every target (< 1 s)."""
    assert _prefix_hit_trace(vllm_env) == {"a": 0, "b": 8}


def test_a_wrong_default_hash_block_size_diverges(vllm_env, monkeypatch):
    """Planted fault: vLLM's default hash block size is half the block size (its hybrid manager
    then reads the request's 4-token block hashes as 2-token ones): the trace diverges (< 1 s)."""
    from vllm.v1.core.sched.scheduler import Scheduler as VllmSched

    from kvref.models.machines.scheduler import Divergence

    real = VllmSched.__init__

    def patched(self, *a, hash_block_size=None, **k):
        real(self, *a, hash_block_size=k["block_size"] // 2 if hash_block_size is None else hash_block_size, **k)

    monkeypatch.setattr(VllmSched, "__init__", patched)
    with pytest.raises(Divergence):
        _prefix_hit_trace(vllm_env)
