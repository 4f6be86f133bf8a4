"""The reference scheduler's KV-connector flows (:mod:`kvref.impl.reference.scheduler_connector`).

Hand scenarios pin each rule with the numbers vLLM 0.33.0 gives (the same scenarios run in lock
step with vLLM in tests/conformance/test_connector_conformance.py); the generated machine runs
the reference alone with its invariants after every step and the drain at teardown.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from kvref.impl.interface import PoolConfig
from kvref.impl.reference.scheduler import Scheduler
from kvref.impl.reference.scheduler_connector import (
    FAIL,
    KV_CONSUMER,
    ConnectorConfig,
    ExternalHit,
    KVConnectorOutput,
    ScriptedConnector,
)
from kvref.impl.request import Request
from kvref.impl.scheduler_types import ModelOutput, SchedulerConfig
from kvref.models.machines.scheduler_connector import CONNECTOR_COVERAGE, connector_machine, reference_factory
from kvref.spec.errors import InvalidFieldError
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec
from tests.conftest import profile_examples

BS = 4


def _pool(num_blocks: int = 16, swa: bool = False, caching: bool = True) -> PoolConfig:
    groups = [KVCacheGroupSpec(("full",), FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8,
                                                            dtype="float16"))]
    if swa:
        groups.append(KVCacheGroupSpec(("swa",), SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=8,
                                                                   dtype="float16", sliding_window=4)))
    return PoolConfig(num_blocks=num_blocks, groups=tuple(groups), max_model_len=64, scheduler_block_size=BS,
                      hash_block_size=BS, max_in_flight_tokens=64, enable_caching=caching)


def _sched(conn_cfg: ConnectorConfig | None = None, **pool_kw):
    conn = ScriptedConnector(conn_cfg or ConnectorConfig())
    return Scheduler(_pool(**pool_kw), SchedulerConfig(max_num_batched_tokens=64), connector=conn), conn


def _add(s, conn, rid: str, n: int, hit: ExternalHit, max_tokens: int = 4) -> Request:
    conn.set_hit(rid, hit)
    r = Request(rid, list(range(100, 100 + n)), max_tokens=max_tokens)
    s.add_request(r)
    return r


def _state(s, rid):
    return s.snapshot().requests[rid]


def test_async_whole_prompt_load_waits_then_recomputes_last_token():
    s, conn = _sched()
    _add(s, conn, "a", 10, ExternalHit(num_tokens=10, load_async=True))
    out = s.schedule()
    assert out.scheduled == ()
    st = _state(s, "a")
    assert st.status == "waiting_for_remote_kvs" and st.num_computed_tokens == 10
    assert s.snapshot().kv_holding_waiting == ("a",)
    assert s.kv_cache_manager.get_block_ids("a") == ((1, 2, 3),)
    assert ("update_state_after_alloc", "a", ((1, 2, 3),), 10) in conn.calls
    s.update_from_output(out, ModelOutput({}), KVConnectorOutput())
    out = s.schedule()
    assert out.scheduled == ()  # still loading: skipped, not blocking
    s.update_from_output(out, ModelOutput({}), KVConnectorOutput(finished_recving=("a",)))
    out = s.schedule()
    (a,) = out.scheduled
    # the whole prompt was loaded: the last token is recomputed to sample the next one
    assert (a.kind, a.num_computed_tokens, a.num_scheduled_tokens) == ("new", 9, 1)
    assert s.snapshot().kv_holding_waiting == ()


def test_sync_load_scheduled_in_the_same_step():
    s, conn = _sched()
    _add(s, conn, "a", 10, ExternalHit(num_tokens=10, load_async=False))
    (a,) = s.schedule().scheduled
    # a sync load leaves the last token to compute
    assert (a.num_computed_tokens, a.num_scheduled_tokens) == (9, 1)


def test_failed_receive_recomputes_from_zero_and_frees_blocks():
    s, conn = _sched()
    _add(s, conn, "a", 10, ExternalHit(num_tokens=8, load_async=True))
    out = s.schedule()
    assert s.kv_cache_manager.get_block_ids("a") == ((1, 2),)  # 8 external tokens
    s.update_from_output(out, ModelOutput({}), KVConnectorOutput(finished_recving=("a",), failed_recving=("a",)))
    out = s.schedule()
    (a,) = out.scheduled
    assert (a.num_computed_tokens, a.num_scheduled_tokens) == (0, 10)
    # freed at promotion (nothing valid; uncached blocks go back to the queue's front, the tail
    # block first), then the whole prompt is allocated afresh
    assert s.kv_cache_manager.get_block_ids("a") == ((2, 1, 3),)


def test_invalid_block_truncates_async_load_to_the_valid_prefix():
    s, conn = _sched()
    _add(s, conn, "a", 12, ExternalHit(num_tokens=12, load_async=True))
    out = s.schedule()
    (blocks,) = s.kv_cache_manager.get_block_ids("a")
    s.update_from_output(out, ModelOutput({}),
                         KVConnectorOutput(finished_recving=("a",), invalid_block_ids=(blocks[1],)))
    (a,) = s.schedule().scheduled
    assert (a.num_computed_tokens, a.num_scheduled_tokens) == (BS, 12 - BS)


def test_fail_policy_finishes_with_an_error_and_frees_after_the_receive():
    s, conn = _sched(ConnectorConfig(kv_load_failure_policy=FAIL))
    r = _add(s, conn, "a", 8, ExternalHit(num_tokens=8, load_async=True))
    out = s.schedule()
    s.update_from_output(out, ModelOutput({}), KVConnectorOutput(finished_recving=("a",), failed_recving=("a",)))
    assert (r.status.value, r.finish_reason) == ("finished", "error")
    assert "a" not in s.requests and not any(s.kv_cache_manager.get_block_ids("a"))


def test_abort_mid_load_keeps_blocks_until_the_receive_finishes():
    s, conn = _sched()
    _add(s, conn, "a", 8, ExternalHit(num_tokens=8, load_async=True))
    out = s.schedule()
    held = s.kv_cache_manager.get_block_ids("a")
    s.finish_requests("a")
    assert s.kv_cache_manager.get_block_ids("a") == held and "a" in s.requests
    assert not s.has_unfinished_requests()
    s.update_from_output(out, ModelOutput({}), KVConnectorOutput(finished_recving=("a",)))
    assert "a" not in s.requests and not any(s.kv_cache_manager.get_block_ids("a"))


def test_delayed_free_until_finished_sending_with_the_clipped_table():
    s, conn = _sched(ConnectorConfig(kv_role=KV_CONSUMER))
    r = _add(s, conn, "a", 6, ExternalHit(num_tokens=0, delay_free=True), max_tokens=1)
    out = s.schedule()
    s.update_from_output(out, ModelOutput({"a": [7]}), KVConnectorOutput())
    assert r.finish_reason == "length"
    call = next(c for c in conn.calls if c[0] == "request_finished")
    assert call == ("request_finished", "a", ((1, 2),))  # 6 computed tokens: two blocks of 4
    assert "a" in s.requests and s.kv_cache_manager.get_block_ids("a") == ((1, 2),)
    out = s.schedule()
    s.update_from_output(out, ModelOutput({}), KVConnectorOutput(finished_sending=("a",)))
    assert "a" not in s.requests


def test_reset_prefix_cache_with_the_connector():
    s, conn = _sched(ConnectorConfig(reset_cache_result=False))
    assert s.reset_prefix_cache(reset_connector=False) is True
    assert s.reset_prefix_cache(reset_connector=True) is False  # reset_cache() said False
    assert conn.calls[-1] == ("reset_cache",)
    s2, conn2 = _sched(ConnectorConfig(reset_cache_result=True))
    _add(s2, conn2, "a", 8, ExternalHit(num_tokens=8, load_async=True))
    s2.schedule()
    # the async load holds blocks: the prefix-cache reset fails, the connector is reset all the same
    assert s2.reset_prefix_cache(reset_connector=True) is False
    assert conn2.store_reset


def test_bad_inputs_are_named():
    s, conn = _sched()
    with pytest.raises(InvalidFieldError, match="kv_role"):
        ConnectorConfig(kv_role="kv_sideways")
    with pytest.raises(InvalidFieldError, match="finished_recving"):
        KVConnectorOutput(finished_recving=["a"])
    with pytest.raises(InvalidFieldError, match="invalid_block_ids"):
        KVConnectorOutput(invalid_block_ids=(-1,))
    out = s.schedule()
    with pytest.raises(InvalidFieldError, match="finished_recving"):
        s.update_from_output(out, ModelOutput({}), KVConnectorOutput(finished_recving=("nobody",)))
    plain = Scheduler(_pool(), SchedulerConfig())
    out = plain.schedule()
    with pytest.raises(InvalidFieldError, match="kv_connector_output"):
        plain.update_from_output(out, ModelOutput({}), KVConnectorOutput())
    hybrid, _ = _sched(swa=True)
    out = hybrid.schedule()
    with pytest.raises(InvalidFieldError, match="invalid_block_ids"):
        hybrid.update_from_output(out, ModelOutput({}), KVConnectorOutput(invalid_block_ids=(1,)))
    # speculative decoding beside a connector is modelled (session 19): no longer refused
    drafting = Scheduler(_pool(num_blocks=16), SchedulerConfig(num_speculative_tokens=2), connector=ScriptedConnector())
    assert drafting.config.num_speculative_tokens == 2


def test_generated_traces_reference_alone():
    """The reference with a connector: invariants after every operation, drain at teardown."""
    machine = connector_machine({"ref": reference_factory}, name="ConnectorReference")
    CONNECTOR_COVERAGE.clear()
    run_state_machine_as_test(machine, settings=settings(max_examples=profile_examples(30, 150),
                                                         stateful_step_count=40, deadline=None))
    assert CONNECTOR_COVERAGE["loads_started_async"] > 0
    assert CONNECTOR_COVERAGE["load_ok"] > 0


def test_multi_connector_composition():
    """vLLM's MultiConnector rules: the first child with a hit loads; a child that cannot answer
    yet makes the answer None; the blocks stay while any child sends; reset resets every child."""
    from kvref.impl.reference.scheduler_connector_multi import MultiScriptedConnector

    a, b = ScriptedConnector(), ScriptedConnector(ConnectorConfig(reset_cache_result=False))
    multi = MultiScriptedConnector([a, b])
    s = Scheduler(_pool(), SchedulerConfig(max_num_batched_tokens=64), connector=multi)
    a.set_hit("r", ExternalHit(num_tokens=0))
    b.set_hit("r", ExternalHit(num_tokens=8, load_async=True, delay_free=True))
    a.set_hit("q", ExternalHit(num_tokens=4, num_pending_lookups=1))
    b.set_hit("q", ExternalHit(num_tokens=8))
    s.add_request(Request("r", list(range(100, 110)), max_tokens=2))
    s.add_request(Request("q", list(range(300, 310)), max_tokens=2))
    out = s.schedule()
    # r: b chose to load 8 tokens, a saw the same blocks with 0; q: a answered None -> skipped
    assert ("update_state_after_alloc", "r", ((1, 2),), 0) in a.calls
    assert ("update_state_after_alloc", "r", ((1, 2),), 8) in b.calls
    assert out.scheduled == () and not any(c[0] == "get_num_new_matched_tokens" and c[1] == "q" for c in b.calls)
    s.update_from_output(out, ModelOutput({}), KVConnectorOutput(finished_recving=("r",)))
    (q, r) = sorted(s.schedule().scheduled, key=lambda x: x.request_id)
    assert (q.num_computed_tokens, r.num_computed_tokens) == (4, 8)  # q: a's hit wins over b's longer one
    assert s.reset_prefix_cache(reset_connector=True) is False  # b's reset said False; a was reset too
    assert a.store_reset and not b.store_reset


def test_consumer_under_async_scheduling_defers_frees_to_the_step_fence():
    """vLLM's ``defer_block_free``: with two batches in flight a consumer's freed blocks return to
    the pool only once the steps that may still write them were processed."""
    conn = ScriptedConnector(ConnectorConfig(kv_role=KV_CONSUMER))
    s = Scheduler(PoolConfig(num_blocks=16, groups=_pool().groups, max_model_len=64, scheduler_block_size=BS,
                             hash_block_size=BS, max_in_flight_tokens=64, enable_caching=False),
                  SchedulerConfig(max_num_batched_tokens=32, async_scheduling=True), connector=conn)
    s.add_request(Request("a", list(range(100, 108)), max_tokens=8))
    first = s.schedule()
    second = s.schedule()  # two steps in flight, both writing a's blocks
    free = s.kv_cache_manager.get_num_free_blocks()
    s.finish_requests("a")
    assert s.kv_cache_manager.get_num_free_blocks() == free  # deferred: a step still writes them
    assert s.connector_state.deferred_frees
    s.update_from_output(first, ModelOutput({"a": [1]}))
    assert s.kv_cache_manager.get_num_free_blocks() == free  # the fence is the second step
    s.update_from_output(second, ModelOutput({}))
    assert s.kv_cache_manager.get_num_free_blocks() == free + 3 and not s.connector_state.deferred_frees
