"""kvref's reference of vLLM's KVCR tier and of the tier-poll round, alone (no vLLM): what the tier
holds, when copies land, eviction order, failed copies, loads of evicted blocks, peer pins, and
poll rounds that leave the step's poll gate as they found it (#22)."""

from __future__ import annotations

import pytest

from kvref.impl.reference.offload.keys import LookupResult, RequestContext
from kvref.impl.reference.offload.tiering.clock import VirtualClock
from kvref.impl.reference.offload.tiering.example_tier import PolledTier
from kvref.impl.reference.offload.tiering.kvcr_tier import KVCRTier
from kvref.impl.reference.offload.tiering.manager import TieringOffloadingManager
from kvref.impl.reference.offload.tiering.primary_tier import CPUPrimaryTier
from kvref.spec.errors import InvalidFieldError

ROW = 64


def _key(i: int) -> bytes:
    return bytes([i + 1]) * 8 + b"\0\0\0\0"


def _world(num_chunks=2, slots=2, policy="lru"):
    clock = VirtualClock()
    primary = CPUPrimaryTier(num_chunks, ROW, enable_events=True)
    tier = KVCRTier("kvcr", primary.buffer, slots, policy)
    m = TieringOffloadingManager(primary, [tier], clock.monotonic)
    ctx = RequestContext("r0")
    m.on_new_request(ctx)
    return m, tier, ctx


def _store(m, ctx, i):
    """A GPU->primary store of key ``i`` (its row filled with ``i``), cascaded to KVCR, and two steps
    end: prepare_store ran the first step's poll, so the copy lands at the second's."""
    out = m.prepare_store([_key(i)], ctx)
    for cid in out.chunk_ids:
        m.primary.buffer.write(cid, bytes([i + 1]) * ROW)
    m.complete_store(list(out.keys_to_store), ctx)
    m.check_invariants()
    m.on_schedule_end([])
    m.on_schedule_end([])
    m.check_invariants()


def test_a_copy_lands_at_the_next_poll_and_is_retry_until_then():
    m, tier, ctx = _world()
    out = m.prepare_store([_key(0)], ctx)
    m.primary.buffer.write(out.chunk_ids[0], b"\x01" * ROW)
    m.complete_store([_key(0)], ctx)
    assert tier.lookup(_key(0), "r0") is LookupResult.RETRY  # filling: kvcr's FETCHING
    assert tier.residency() == {_key(0): ("filling", 0)}
    m.on_schedule_end([])  # this step's poll ran before the copy started (in prepare_store)
    assert tier.residency() == {_key(0): ("filling", 0)}
    m.on_schedule_end([])  # the next step's poll applies it
    assert tier.residency() == {_key(0): ("ready", 0)}
    assert tier.stored_keys() == {_key(0)}
    assert tier.res[_key(0)].data == b"\x01" * ROW
    assert [e.removed for e in tier.take_events()] == [False]
    stats = tier.take_stats()
    assert stats["vllm:kvcr_transfer_blocks:('local_fill',)"] == 1
    assert stats["vllm:kvcr_state:('local_g2_free_slots',)"] == 1
    assert stats["vllm:kvcr_state:('local_g2_evictable_slots',)"] == 1


@pytest.mark.parametrize("policy, evicted", [("lru", 0), ("fifo", 1)])
def test_a_failed_load_keeps_lru_recency_but_sends_fifo_to_the_back(policy, evicted):
    """Keys 0 and 1 land in KVCR in that order; key 0 comes back for a request and its copy fails:
    the claim's release makes it evictable again with no access recorded. LRU ranks it by its old
    access (first out), FIFO by when it became evictable (after key 1)."""
    m, tier, ctx = _world(num_chunks=1, slots=2, policy=policy)
    _store(m, ctx, 0)
    _store(m, ctx, 1)  # the primary tier (1 chunk) now holds key 1 only
    ctx2 = RequestContext("r1")
    m.on_new_request(ctx2)
    assert m.lookup(_key(0), ctx2) is LookupResult.HIT_PENDING  # promoted from KVCR
    tier.fail_copies = 1
    m.on_schedule_end([])  # the load is submitted: key 0 claimed, its copy fails
    assert tier.residency()[_key(0)] == ("ready", 1)
    m.on_schedule_end([])  # the failed promotion is collected
    assert not m.jobs and tier.residency()[_key(0)] == ("ready", 0)
    _store(m, ctx, 2)
    held = set(tier.stored_keys())
    assert _key(2) in held and _key(evicted) not in held, (policy, held)
    assert len(held) == 2


def test_no_evictable_slot_refuses_the_store_and_a_failed_copy_frees_its_slot():
    m, tier, ctx = _world(num_chunks=3, slots=1)
    tier.fail_copies = 1
    _store(m, ctx, 0)
    assert tier.stored_keys() == set()  # the copy failed: the slot is free again
    assert m.take_stats()[f"vllm:kv_offload_tiering_cascade_job_failures:('1:kvcr',)"] == 1
    _store(m, ctx, 1)
    assert tier.stored_keys() == {_key(1)}
    # key 1 is claimed by a load in flight: key 2's store finds no evictable slot and fails
    from kvref.impl.reference.offload.tiering.tier_base import TransferJob

    tier.submit_load(TransferJob(998, (_key(1),), (0,), True, "r0", 0.0))
    tier.submit_store(TransferJob(996, (_key(2),), (1,), False, "r0", 0.0))
    assert tier.counts["stores_refused"] == 1
    assert _key(2) not in tier.res
    assert {r.job_id: r.success for r in tier.get_finished_jobs()} == {996: False, 998: True}


def test_a_load_of_an_evicted_block_names_what_arrived():
    m, tier, ctx = _world(num_chunks=3, slots=3)
    _store(m, ctx, 0)
    from kvref.impl.reference.offload.tiering.tier_base import TransferJob

    tier.submit_load(TransferJob(997, (_key(0), _key(5)), (0, 1), True, "r0", 0.0))
    (res,) = tier.get_finished_jobs()
    assert not res.success and res.successful_keys == {_key(0)}
    assert tier.take_stats()["vllm:kvcr_duration_seconds:('remote_deliver', 'failed')_count"] == 1


def test_a_peer_pin_holds_the_chunks_until_the_next_poll():
    m, tier, ctx = _world(num_chunks=3, slots=3)
    _store(m, ctx, 0)
    tier.request_pin([_key(0), _key(4)])
    m.on_schedule_end([])  # served: key 0 HIT in the primary tier, pinned; key 4 absent
    assert tier.counts["pins"] == 1
    assert m.primary.chunk_state()[_key(0)][1] == 1
    assert [job.req_id for job, _ in m.jobs.values()] == ["kvcr-source:0"]
    assert "kvcr-source:0" not in m.req_state  # the source request finished at once
    m.check_invariants()
    m.on_schedule_end([])  # released at the next poll
    assert m.primary.chunk_state()[_key(0)][1] == 0 and not m.jobs


def test_a_poll_round_collects_polled_tiers_only_and_restores_the_gate():
    clock = VirtualClock()
    primary = CPUPrimaryTier(3, ROW)
    polled = PolledTier("PolledTier", primary.buffer)
    kvcr = KVCRTier("kvcr", primary.buffer, 3)
    m = TieringOffloadingManager(primary, [polled, kvcr], clock.monotonic)
    ctx = RequestContext("r0")
    m.on_new_request(ctx)
    out = m.prepare_store([_key(0)], ctx)
    m.complete_store(list(out.keys_to_store), ctx)  # cascades to both tiers
    assert len(m.jobs) == 2
    gate = m.processed_this_step
    m.poll_tiers()
    assert [i for _, i in m.jobs.values()] == [1]  # only the polled tier's job was collected
    assert m.processed_this_step is gate  # the gate is as it was
    m.on_schedule_end([])
    m.poll_tiers()
    assert m.processed_this_step is False  # a round between steps leaves the next step's poll to run
    polled.peer_request([_key(0)])
    m.poll_tiers()  # served: a pin through the parent, which skips the polled tier
    assert {job.req_id for job, i in m.jobs.values() if i == 0} == {"peer:0"}
    m.check_invariants()


def test_bad_arguments_are_named():
    primary = CPUPrimaryTier(2, ROW)
    with pytest.raises(InvalidFieldError, match="slots"):
        KVCRTier("kvcr", primary.buffer, 0)
    with pytest.raises(InvalidFieldError, match="policy"):
        KVCRTier("kvcr", primary.buffer, 2, "g3_lru")
    m, tier, ctx = _world()
    with pytest.raises(InvalidFieldError, match="exclude_tier_idx"):
        m.lookup(_key(0), ctx, exclude_tier_idx=5)


def test_kvcr_config_rules_in_vllms_order():
    from kvref.impl.reference.offload.tiering.kvcr_config import kvcr_config_error

    ok = {"type": "kvcr", "control_ports": [5555], "router_capabilities": ["router_hint"],
          "secondary_g2_slots": 2, "policy": "lru"}
    assert kvcr_config_error(ok, True, True) is None
    assert kvcr_config_error(ok, True, False) == ("ValueError", "self_describing_kv_events")
    assert kvcr_config_error(ok, False, False) is None  # no events: no inventory to describe
    assert kvcr_config_error({**ok, "policy": "mru"}, True, True) == ("ValueError", "policy")
    assert kvcr_config_error({**ok, "policy": "kvcr.policy.PlacementAction"}, True, True) == ("TypeError", "policy")
    assert kvcr_config_error({**ok, "policy": "kvref_no_such.Policy"}, True, True) == ("ImportError", "policy")
    assert kvcr_config_error({**ok, "policy": "g3_lru"}, True, True) == ("ValueError", "policy")
    # the policy rule comes first, then the service pairing, then the router
    assert kvcr_config_error({**ok, "policy": "mru", "router_capabilities": []}, True, True)[1] == "policy"
    assert kvcr_config_error({**ok, "compatibility_digest": "d", "router_capabilities": []}, True, True)[1] == \
        "kvcr_service_socket_path"
    assert kvcr_config_error({**ok, "router_capabilities": None}, True, True)[1] == "router_capabilities"
    assert kvcr_config_error({**ok, "control_ports": [1, 2]}, True, True)[1] == "control_ports"
    assert kvcr_config_error({**ok, "control_ports": [0]}, True, True)[1] == "control_ports"
    assert kvcr_config_error({**ok, "secondary_g2_slots": -1}, True, True)[1] == "secondary_g2_slots"
    with pytest.raises(InvalidFieldError, match="cfg"):
        kvcr_config_error({"type": "fs"}, True, True)
    with pytest.raises(InvalidFieldError, match="events"):
        kvcr_config_error(ok, "yes", True)


def test_kvcr_start_rules_and_what_vllm_hands_kvcr():
    from kvref.impl.reference.offload.tiering.kvcr_config import kvcr_built_tier, kvcr_config_error

    ok = {"type": "kvcr", "control_ports": [5555], "router_capabilities": ["router_hint"],
          "secondary_g2_slots": 2, "policy": "lru"}
    g3 = {"paths": ["/x/g3.bin"], "capacity_bytes_per_file": 1 << 16, "backend": "POSIX"}
    # the local data-parallel rank picks its port
    assert kvcr_config_error({**ok, "control_ports": [1, 2]}, True, True, 1) is None
    assert kvcr_config_error({**ok, "control_ports": [1, 2]}, True, True, 2) == ("ValueError", "control_ports")
    assert kvcr_built_tier({**ok, "control_ports": [1, 2]}, True, 64, 1)["control_port"] == 2
    # a G3 tier: needs self-describing events, its paths, local DRAM and a NIXL backend that exists
    assert kvcr_config_error({**ok, "secondary_g2_slots": 0, "g3": g3}, True, False) == \
        ("ValueError", "self_describing_kv_events")
    assert kvcr_config_error({**ok, "g3": {"backend": "POSIX"}}, True, True) == ("KeyError", "g3")
    assert kvcr_config_error({**ok, "secondary_g2_slots": 0, "g3": g3}, True, True) == ("ValueError", "g3")
    assert kvcr_config_error({**ok, "g3": {**g3, "backend": "NOPE"}}, True, True) == ("KVCRStartupError", "g3")
    assert kvcr_config_error({**ok, "policy": "g3_lru", "g3": g3}, True, True) is None
    assert kvcr_built_tier({**ok, "policy": None, "g3": g3}, True, 64)["policy"] == "G3LRUPolicy"
    # kvcr's timeouts, then the service kvref never runs (checked before them)
    assert kvcr_config_error({**ok, "operation_timeout_ms": 0}, True, True) == ("ValueError", "operation_timeout_ms")
    assert kvcr_config_error({**ok, "abandon_timeout_ms": 1999}, True, True) == ("ValueError", "abandon_timeout_ms")
    svc = {**ok, "kvcr_service_socket_path": "/x.sock", "compatibility_digest": "d", "operation_timeout_ms": 0}
    assert kvcr_config_error(svc, True, True) == ("KVCRServiceError", "kvcr_service_socket_path")
    # KV events off: no inventory, and no self-description needed
    assert kvcr_built_tier(ok, False, 64) == {"control_port": 5555, "local_dram_bytes": 128, "g3": False,
                                              "policy": "LRUPolicy", "inventory": False, "metrics": (),
                                              "reports_stats": False}
    assert kvcr_built_tier({**ok, "enable_telemetry": True}, True, 64)["metrics"][1] == "vllm:kvcr_state"
    # the NIXL backends: the remote path's always, local DRAM's only with local DRAM
    assert kvcr_config_error({**ok, "remote_fw_dram_backend": "X"}, True, True) == ("KVCRStartupError", "backend")
    assert kvcr_config_error({**ok, "local_dram_backend": "X"}, True, True) == ("KVCRStartupError", "backend")
    assert kvcr_config_error({**ok, "local_dram_backend": "X", "secondary_g2_slots": 0}, True, True) is None
    with pytest.raises(InvalidFieldError, match="dp_local_rank"):
        kvcr_config_error(ok, True, True, -1)
    with pytest.raises(InvalidFieldError, match="cfg"):
        kvcr_built_tier({**ok, "policy": "mru"}, True, 64)
