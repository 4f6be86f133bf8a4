"""KV-connector flows: the reference scheduler in lock step with vLLM 0.33.0's ``Scheduler`` /
``AsyncScheduler`` running the same scripted connector (built by vLLM's ``KVConnectorFactory``
from ``kv_connector_module_path``), on generated traces (#22).

Every operation compares scheduler outputs, snapshots (``kv_holding_waiting``,
``waiting_for_remote_kvs``, computed tokens, block tables, free queue), KV events and the
connector's call log; the rare paths are counted and required at the ci profile.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from kvref.models.hypothesis_runs.reproducible import same_inputs_in_every_process

from kvref.impl.interface import PoolConfig
from kvref.impl.reference import scheduler_connector as sc
from kvref.impl.reference.scheduler_connector import ConnectorConfig, ExternalHit
from kvref.impl.scheduler_types import SchedulerConfig
from kvref.models.machines.scheduler import Divergence, RequestSpec
from kvref.models.machines.scheduler_connector import (
    CONNECTOR_COVERAGE,
    ConnectorLockstep,
    connector_machine,
    reference_factory,
    vllm_factory,
)
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

#: paths every ci run must reach (counted by the machine)
RARE = ("loads_started_async", "load_ok", "load_failed", "load_invalid", "sync_load_invalid",
        "aborted_mid_load", "sends_finished", "finished_error", "promoted_load_scheduled",
        "external_tokens_after_preemption", "lookup_after_local_hit", "asked_pending_block_frees",
        "multi_connector_loads", "steps_with_deferred_frees")


@pytest.fixture(scope="module")
def factories():
    require_vllm()
    return {"vllm": vllm_factory(), "ref": reference_factory}


def test_generated_traces_match_vllm(factories):
    machine = connector_machine(factories, name="ConnectorConformance")
    CONNECTOR_COVERAGE.clear()
    # derandomized and independent of the modules the process has loaded: the rare-path assertion
    # below then sees the same traces in CI's full suite as alone (random runs missed a path now
    # and then: load_invalid / aborted_mid_load in one full-suite run of three)
    with same_inputs_in_every_process():
        run_state_machine_as_test(machine, settings=settings(max_examples=profile_examples(12, 120),
                                                             stateful_step_count=40, deadline=None,
                                                             derandomize=True, database=None))
    assert CONNECTOR_COVERAGE["loads_started_async"] > 0
    if settings._current_profile in ("ci", "nightly"):  # type: ignore[attr-defined]
        missing = [k for k in RARE if not CONNECTOR_COVERAGE[k]]
        assert not missing, f"paths never reached: {missing} ({dict(CONNECTOR_COVERAGE)})"
        assert any(k.startswith("reset_") and "connector" in k for k in CONNECTOR_COVERAGE)


def _driver(factories, conn: ConnectorConfig, async_scheduling: bool = False) -> ConnectorLockstep:
    pool = PoolConfig(num_blocks=16, groups=(KVCacheGroupSpec(("full",), FullAttentionSpec(
        block_size=4, num_kv_heads=1, head_size=8, dtype="float16")),), max_model_len=64, scheduler_block_size=4,
        hash_block_size=4, max_in_flight_tokens=64 if async_scheduling else 32, enable_caching=True)
    cfg = SchedulerConfig(max_num_batched_tokens=32, async_scheduling=async_scheduling)
    return ConnectorLockstep(pool, cfg, factories, conn)


def _spec(rid: str, n: int) -> RequestSpec:
    base = 100 * (1 + ord(rid[0]) % 50)  # distinct prompts: no local prefix hits between requests
    return RequestSpec(rid, tuple(range(base, base + n)), max_tokens=3, priority=0, arrival_time=0.0)


def test_async_load_promotion_matches_vllm(factories):
    d = _driver(factories, ConnectorConfig())
    d.add_with_hit(_spec("a", 10), ExternalHit(num_tokens=10, load_async=True))
    d.add_with_hit(_spec("b", 9), ExternalHit(num_tokens=5, load_async=False))
    out = d.schedule()
    # a waits for its load (its blocks allocated); b's sync load is computed on in the same step
    assert [(s.request_id, s.num_computed_tokens, s.num_scheduled_tokens) for s in out.scheduled] == [("b", 5, 4)]
    assert d.last_snapshot.requests["a"].status == "waiting_for_remote_kvs"
    d.complete(None)  # the load lands
    out = d.schedule()
    assert [(s.request_id, s.kind, s.num_computed_tokens) for s in out.scheduled] == [("b", "running", 9),
                                                                                      ("a", "new", 9)]
    d.drain()


def test_a_planted_fault_in_the_reference_is_a_divergence(factories, monkeypatch):
    """The comparison bites: promoting a whole-prompt load without recomputing its last token
    (a real class of bug: the request would sample from a position it never computed) is caught."""
    real = sc.update_waiting_for_remote_kv

    def faulty(sched, request):
        n = request.num_computed_tokens
        real(sched, request)
        request.num_computed_tokens = n

    monkeypatch.setattr(sc, "update_waiting_for_remote_kv", faulty)
    d = _driver(factories, ConnectorConfig())
    d.add_with_hit(_spec("a", 8), ExternalHit(num_tokens=8, load_async=True))
    d.schedule()
    d.complete(None)
    with pytest.raises((Divergence, AssertionError)):
        d.schedule()


@pytest.mark.parametrize("policy", [sc.RECOMPUTE, sc.FAIL])
def test_invalid_blocks_of_a_sync_load_match_vllm(factories, policy):
    d = _driver(factories, ConnectorConfig(kv_load_failure_policy=policy))
    d.add_with_hit(_spec("a", 13), ExternalHit(num_tokens=12, load_async=False))
    out = d.schedule()
    assert out.scheduled[0].num_computed_tokens == 12

    # the worker reports the load's first block invalid
    d.complete(report=sc.KVConnectorOutput(invalid_block_ids=(out.scheduled[0].block_ids[0][0],)))
    state = d.last_snapshot.requests["a"]
    if policy == sc.FAIL:
        assert state.finish_reason == "error"
    else:
        assert state.num_computed_tokens == 0 and state.status == "running"
    d.drain()


def test_multi_connector_matches_vllm(factories):
    """vLLM's own MultiConnector over two scripted children (built by its factory from
    ``kv_connector_extra_config["connectors"]``) against the reference composition."""
    d = _driver(factories, (ConnectorConfig(), ConnectorConfig(reset_cache_result=False)))
    d.add_with_hit(_spec("r", 10), (ExternalHit(num_tokens=0), ExternalHit(num_tokens=8, load_async=True,
                                                                            delay_free=True)))
    d.add_with_hit(_spec("q", 10), (ExternalHit(num_tokens=4, num_pending_lookups=1), ExternalHit(num_tokens=8)))
    d.schedule()
    d.complete(None)
    out = d.schedule()
    assert sorted((s.request_id, s.num_computed_tokens) for s in out.scheduled) == [("q", 4), ("r", 8)]
    d.reset_prefix_cache(False, True)
    d.drain()
