"""vLLM 0.33.0's KVCR framework-pin adapter leaks a primary-tier pin (#22, proved here).

``_FrameworkPinAdapter._resolve_pin`` looks a peer's keys up one by one, then pins the HITs with one
``create_store_job``. With another secondary tier behind KVCR, a later key's lookup can promote a
chunk into the primary tier and evict an earlier HIT. ``create_store_job`` -> ``prepare_read`` then
raises (``assert chunk is not None``) part-way: the HITs before the evicted key already had their
``ref_cnt`` raised, no job was registered, and the adapter only logs. Nothing ever lowers that
``ref_cnt``: the chunk is pinned for good (never evictable, never reused). kvref's reference pins
all or nothing (docs/differences.md). The test runs both on the same operations: the first
divergence is exactly that chunk's ref count, and vLLM's pin outlives every step and request."""

from __future__ import annotations

import pytest

from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

#: key 2 is stored first, then 1, then 0 (two primary chunks: 2 is evicted to the example tier);
#: every store cascades to KVCR and the example tier
_FILL = [("new_request",), ("prepare_store", 0, (2,)), ("complete_store", 0, True), ("schedule_end",),
         ("prepare_store", 0, (1,)), ("complete_store", 0, True), ("schedule_end",),
         ("prepare_store", 0, (0,)), ("complete_store", 0, True), ("schedule_end",),
         ("finish_request", 0), ("schedule_end",), ("schedule_end",)]


def _world():
    require_vllm()
    pytest.importorskip("kvcr")
    pytest.importorskip("nixl")
    from kvref.impl.reference.offload.tiering.clock import VirtualClock
    from kvref.models.machines.tiering import TieringConfig, TieringWorld

    cfg = TieringConfig(num_chunks=2, tiers=("kvcr", "example"), kvcr_slots=6, num_keys=6)
    clock = VirtualClock()
    return TieringWorld(cfg, clock), clock


def _pinned(state, key) -> int:
    return state[key][1] if key in state else 0


def test_a_pin_whose_hit_is_evicted_by_a_later_promotion_leaks_in_vllm():
    from kvref.impl.vllm.tiering import virtual_time
    from kvref.models.machines.tiering import TieringDivergence

    world, clock = _world()
    with virtual_time(clock):
        try:
            world.compare(("start",))
            for op in _FILL:
                world.apply(op)
            k0, k1, k2 = world.keys[0], world.keys[1], world.keys[2]
            state = world.vllm.chunk_state()
            assert set(state) == {k0, k1} and _pinned(state, k1) == _pinned(state, k0) == 0
            assert k2 in world.ref.tiers[1].stored_keys()  # the example tier holds the evicted key
            # a peer reads (1, 0, 2): 1 and 0 HIT; 2's lookup promotes it from the example tier,
            # which evicts 0 (the least recent) before create_store_job pins (1, 0)
            pin = [k1, k0, k2]
            world.ref.tiers[0].request_pin(pin)
            world.vllm.kvcr_request_pin(0, pin)
            with pytest.raises(TieringDivergence) as exc:
                world.apply(("schedule_end",))
            assert "primary chunks" in str(exc.value)
            ref, vll = world.primary.chunk_state(), world.vllm.chunk_state()
            assert k0 not in ref and k0 not in vll  # both evicted 0 for 2's promotion
            assert _pinned(ref, k1) == 0  # the reference pinned nothing
            assert _pinned(vll, k1) == 1  # vLLM pinned 1 and registered no job that would unpin it
            assert not any(k1 in job[2] for job in world.vllm.jobs().values())
            adapter = world.vllm.tiers[0]._framework_pin_adapter
            assert not adapter.has_active_pins()  # KVCR holds no pin either: no one will release it
            # the pin outlives every later step, the promotion's end and a new request's stores
            mgr = world.vllm.manager
            from kvref.impl.vllm.tiering import schedule_end_context

            for _ in range(4):
                mgr.on_schedule_end(schedule_end_context())
            ctx = world.vllm.req_context("after")
            mgr.on_new_request(ctx)
            for k in world.keys[3:]:
                out = mgr.prepare_store([k], ctx)
                if out is not None and out.keys_to_store:
                    mgr.complete_store(list(out.keys_to_store), ctx, True)
                mgr.on_schedule_end(schedule_end_context())
            mgr.on_request_finished(ctx)
            for _ in range(3):
                mgr.on_schedule_end(schedule_end_context())
            after = world.vllm.chunk_state()
            assert _pinned(after, k1) == 1 and after[k1][0] == vll[k1][0]  # same chunk, still pinned
            assert not world.vllm.jobs()
        finally:
            world.close()


def test_the_reference_pins_nothing_when_a_hit_is_gone():
    """The reference's side of the same operations alone: the pin request is refused whole, every
    chunk stays evictable and the refusal is counted."""
    from kvref.impl.reference.offload.tiering.kvcr_tier import KVCRTier
    from kvref.impl.vllm.tiering import virtual_time

    world, clock = _world()
    with virtual_time(clock):
        try:
            world.compare(("start",))
            for op in _FILL:
                world.apply(op)
            tier = world.ref.tiers[0]
            assert isinstance(tier, KVCRTier)
            tier.request_pin([world.keys[1], world.keys[0], world.keys[2]])
            world.ref.on_schedule_end([])
            world.ref.check_invariants()
            assert tier.counts.get("pin_failures", 0) == 1 and not tier.pins
            assert all(ref_cnt <= 0 for _, ref_cnt in world.primary.chunk_state().values())
        finally:
            world.close()
