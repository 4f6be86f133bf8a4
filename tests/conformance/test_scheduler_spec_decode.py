"""Speculative decoding in the scheduler, compared with vLLM 0.33.0's ``Scheduler`` / ``AsyncScheduler``
(issue #22 part 2).

Generated traces with drafts on (1-4 per request, n-gram or EAGLE-like with lookahead slots and
block drop, with and without ``can_skip_drafts``), sync and async, FCFS and PRIORITY, FA / FA+SWA /
FA+chunked-local / FA+Mamba pools, tight pools: the fake model accepts a drawn number of each
step's drafts and proposes a drawn number (0..k) after each synchronous step. After every
operation the lock-step compares scheduled tokens and scheduled drafts (ids included),
``skip_drafts``, computed tokens (rejections rolled back), placeholders, block ids per group, free
blocks, queues, every request's pending drafts, and after every update the ``SpecDecodingStats``.
Targets: vLLM, the reference, and the reference scheduler on vLLM's KVCacheManager.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from kvref.models.hypothesis_runs.reproducible import same_inputs_in_every_process

from kvref.impl.interface import PoolConfig
from kvref.impl.request import Request
from kvref.impl.scheduler_types import EAGLE, ModelOutput, SchedulerConfig
from kvref.models.machines.scheduler import COVERAGE, Lockstep, RequestSpec, machine_with, scheduler_setups
from kvref.spec.errors import InvalidFieldError
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from tests.conftest import profile_examples
from tests.conformance.scheduler_targets import scheduler_targets as _targets
from tests.conformance.scheduler_targets import vllm_env  # noqa: F401 - the module-scoped fixture

pytestmark = pytest.mark.vllm

MIN_STEPS = 30
STEP_COUNT = 45
#: paths the spec-decode traces must keep reaching at ci profile
RARE = ("spec_verify_steps", "spec_rejected", "spec_all_accepted", "spec_padded", "spec_draft_updates",
        "spec_skip_drafts", "spec_stale_verify", "spec_eagle_prefix_hits", "spec_padded_drafts",
        "spec_drafts_in_output", "spec_request_metrics_observed",
        "preemptions", "prefix_hits", "steps_async", "steps_sync",
        "finished_stop", "finished_length")


def test_generated_spec_decode_traces_match_vllm(vllm_env):
    machine = machine_with(_targets(vllm_env), setups=scheduler_setups(spec=True), name="SpecDecodeConformance",
                           spec=True)
    COVERAGE.clear()
    # derandomized and independent of the modules the process has loaded, so the rare-path
    # assertion sees the same traces in CI's full suite as alone (a random run missed
    # spec_stale_verify once)
    with same_inputs_in_every_process():
        run_state_machine_as_test(machine, _min_steps=MIN_STEPS + 1,
                                  settings=settings(max_examples=profile_examples(15, 200),
                                                    stateful_step_count=STEP_COUNT, derandomize=True,
                                                    database=None))
    print("spec decode coverage:", dict(COVERAGE))
    if profile_examples(False, True) and not COVERAGE["spec_stale_verify"]:
        # a stale verification needs async scheduling, a rejected draft and a step in flight; when
        # the mixed draws of the pass above miss it (the MTP setups joined them in session 12 and
        # moved every draw), a derandomized async-only pass looks for it on its own
        async_only = machine_with(_targets(vllm_env), setups=scheduler_setups(spec=True, async_scheduling=True),
                                  name="SpecDecodeAsyncConformance", spec=True)
        with same_inputs_in_every_process():
            run_state_machine_as_test(async_only, _min_steps=MIN_STEPS + 1,
                                      settings=settings(max_examples=100, stateful_step_count=STEP_COUNT,
                                                        derandomize=True, database=None))
    if profile_examples(False, True):
        missing = [k for k in RARE if COVERAGE[k] == 0]
        assert not missing, f"paths never exercised: {missing} (coverage {dict(COVERAGE)})"


def test_generated_spec_decode_tight_priority_traces_match_vllm(vllm_env):
    """Drafts under KV pressure: tight pools, PRIORITY preemption of requests already scheduled in
    the step (their drafts leave the step), async stale verifications."""
    machine = machine_with(_targets(vllm_env, shim=False),
                           setups=scheduler_setups(spec=True, tight=True, policy="priority"),
                           name="SpecDecodeTightConformance", spec=True)
    COVERAGE.clear()
    run_state_machine_as_test(machine, _min_steps=MIN_STEPS + 1,
                              settings=settings(max_examples=profile_examples(8, 100),
                                                stateful_step_count=STEP_COUNT))
    if profile_examples(False, True):
        assert COVERAGE["preemptions"] and COVERAGE["spec_verify_steps"], dict(COVERAGE)


def _pool(num_blocks: int, cfg: SchedulerConfig, use_eagle: bool) -> PoolConfig:
    fa = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16")
    return PoolConfig(num_blocks=num_blocks, groups=(KVCacheGroupSpec(("full",), fa),), max_model_len=40,
                      scheduler_block_size=4, hash_block_size=4, max_in_flight_tokens=cfg.max_in_flight_tokens,
                      use_eagle=use_eagle)


@pytest.mark.parametrize("is_async", [False, True])
def test_eagle_prefix_hit_is_padded_and_verified(vllm_env, is_async):
    """A request whose prompt is a prefix hit up to its last token is admitted padded to
    ``1 + k`` with placeholder drafts beside a running decode; the EAGLE block drop shortens the
    hit by one block first (so this one is a real prefill), and lookahead slots are reserved."""
    cfg = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4, num_speculative_tokens=3,
                          speculative_method=EAGLE, async_scheduling=is_async)
    d = Lockstep(_pool(64, cfg, use_eagle=True), cfg, _targets(vllm_env))
    prompt = tuple(range(1, 18))
    d.add(RequestSpec("a", prompt, max_tokens=8, priority=0, arrival_time=0.0))
    for _ in range(6):
        d.engine_step(seed=1)  # seed 1: drafts proposed, some accepted
    d.add(RequestSpec("b", prompt, max_tokens=8, priority=0, arrival_time=1.0))
    for _ in range(30):
        d.engine_step(seed=2)
    snap = d.snapshots()["vllm"]
    assert snap.requests["a"].status == "finished" and snap.requests["b"].status == "finished"
    assert len(snap.requests["a"].output_token_ids) == 8


def _metrics_trace(vllm_env, level: str) -> Lockstep:
    """Two requests sharing a prompt under n-gram drafts, synchronous, with per-request metrics at
    ``level``: the Lockstep compares vLLM's RequestSpecDecodeMetrics with the reference's after
    every update (live requests and those finished in it)."""
    cfg = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4, num_speculative_tokens=3,
                          spec_decode_metrics_level=level)
    d = Lockstep(_pool(64, cfg, use_eagle=False), cfg, _targets(vllm_env, shim=False))
    COVERAGE.clear()
    prompt = tuple(range(1, 10))
    d.add(RequestSpec("a", prompt, max_tokens=9, priority=0, arrival_time=0.0))
    d.add(RequestSpec("b", prompt + (5,), max_tokens=6, priority=0, arrival_time=1.0))
    d.seen_metrics = []  # every request's metrics after each step, as the reference has them
    for _ in range(20):
        d.engine_step()  # seeded by the step count: drafts proposed, some accepted, some rejected
        d.seen_metrics += d.targets["ref"].request_spec_decode_metrics.values()
    return d


@pytest.mark.parametrize("level", ["summary", "detailed"])
def test_per_request_spec_decode_metrics_match_vllm(vllm_env, level):
    """vLLM's per_request_spec_decode_metrics: each verified step adds to the request's histogram
    of accepted drafts and its proposed drafts ("detailed": the per-step sequences too)."""
    d = _metrics_trace(vllm_env, level)
    assert all(r.status == "finished" for r in d.snapshots()["vllm"].requests.values())
    assert COVERAGE["spec_request_metrics_observed"] > 0, dict(COVERAGE)  # compared with a draft verified
    # steps that accepted no draft, some and all of them, in both requests' metrics
    assert {j for m in d.seen_metrics for j, c in enumerate(m.histogram) if c} == {0, 1, 2, 3}
    assert any(m.per_step_accepted for m in d.seen_metrics) == (level == "detailed")


def test_a_wrong_per_request_metric_in_vllm_diverges(vllm_env, monkeypatch):
    """A planted fault: vLLM's observe counts a verify step's accepted drafts one bucket low."""
    from vllm.v1.metrics.stats import RequestSpecDecodeMetrics

    real = RequestSpecDecodeMetrics.observe

    def observe(self, num_draft_tokens, num_accepted, detailed=False):
        real(self, num_draft_tokens, max(num_accepted - 1, 0), detailed)

    monkeypatch.setattr(RequestSpecDecodeMetrics, "observe", observe)
    with pytest.raises(AssertionError, match="per-request spec decode metrics differ"):
        _metrics_trace(vllm_env, "summary")


def test_vllm_fails_when_the_padded_admission_is_cut_by_the_long_prefill_threshold(vllm_env):
    """A finding on vLLM 0.33.0: a one-token admission beside a running decode is padded to
    ``1 + k`` tokens, then cut to ``long_prefill_token_threshold`` (< 1 + k), and ``schedule()``
    fails ``assert num_new_tokens == 1 + self.num_spec_tokens``. kvref refuses such a config
    (docs/differences.md); vLLM's is made with the threshold set after construction."""
    mod, env = vllm_env
    with pytest.raises(InvalidFieldError, match="long_prefill_token_threshold"):
        SchedulerConfig(long_prefill_token_threshold=2, num_speculative_tokens=3)
    cfg = SchedulerConfig(num_speculative_tokens=3)
    s = mod.VllmScheduler(_pool(64, cfg, use_eagle=False), cfg, env)
    s.scheduler.scheduler_config.long_prefill_token_threshold = 2  # read by schedule() each step
    prompt = list(range(1, 10))
    s.add_request(Request("a", prompt, max_tokens=10))
    for _ in range(3):
        out = s.schedule()
        s.update_from_output(out, ModelOutput({x.request_id: [7] for x in out.scheduled if not x.is_prefill_chunk}))
    s.add_request(Request("b", prompt[:8] + [99], max_tokens=10))  # a hit up to its last token
    with pytest.raises(AssertionError):
        s.schedule()


def padding_boundary_trace(targets: dict, max_model_len: int) -> Lockstep:
    """A running decode and a one-token admission (a hit of 8 of its 9 prompt tokens) beside it,
    with ``max_model_len`` 12 (the padded span ``8 + 1 + 2`` plus the sampled token fits exactly)
    or 11 (it does not: no padding). Every step compared on all targets."""
    cfg = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4, num_speculative_tokens=2)
    fa = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16")
    pool = PoolConfig(num_blocks=32, groups=(KVCacheGroupSpec(("full",), fa),), max_model_len=max_model_len,
                      scheduler_block_size=4, hash_block_size=4, max_in_flight_tokens=cfg.max_in_flight_tokens)
    d = Lockstep(pool, cfg, targets)
    prompt = tuple(range(1, 10))
    d.add(RequestSpec("a", prompt, max_tokens=8, priority=0, arrival_time=0.0))
    d.engine_step(seed=0)
    d.add(RequestSpec("b", prompt[:8] + (99,), max_tokens=8, priority=0, arrival_time=1.0))
    d.schedule()
    return d


@pytest.mark.parametrize("max_model_len", [11, 12])
def test_padding_stops_at_the_max_model_len_boundary(vllm_env, max_model_len):
    d = padding_boundary_trace(_targets(vllm_env), max_model_len)
    out = d.in_flight["vllm"][-1]
    b = next(s for s in out.scheduled if s.request_id == "b")
    assert (b.num_computed_tokens, b.num_scheduled_tokens) == (8, 3 if max_model_len == 12 else 1)
