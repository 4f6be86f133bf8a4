"""kvref's reference of vLLM's multi-tier offloading, alone (no vLLM): back-pressure, async lookup
probes, the fs tier and the orchestrator's rules with invariants after every call (#22)."""

from __future__ import annotations

import pytest

from kvref.impl.reference.offload.keys import LookupResult, OffloadStateError, RequestContext
from kvref.impl.reference.offload.tiering.async_lookup import AsyncLookupManager, LookupPhase
from kvref.impl.reference.offload.tiering.backpressure import (
    DropStorePolicy,
    EMABackpressureDetector,
    ThrottledDropPolicy,
    default_config,
)
from kvref.impl.reference.offload.tiering.clock import VirtualClock
from kvref.impl.reference.offload.tiering.example_tier import ExampleTier
from kvref.impl.reference.offload.tiering.fs_tier import FileSystemTier
from kvref.impl.reference.offload.tiering.manager import TieringOffloadingManager
from kvref.impl.reference.offload.tiering.primary_tier import CPUPrimaryTier
from kvref.spec.errors import InvalidFieldError

MIB = 1 << 20


def _key(i: int) -> bytes:
    return bytes([i + 1]) * 8 + b"\0\0\0\0"


def _detector(clock, policy=None, **kw):
    args = dict(default_config("fs"), warmup_completions=2, policy=policy or DropStorePolicy(), clock=clock.monotonic)
    args.update(kw)
    return EMABackpressureDetector(**args)


def test_backpressure_warmup_pressure_decay_and_cooldown():
    clock = VirtualClock()
    det = _detector(clock)
    for _ in range(2):  # warm-up: the mean of the samples seeds the EMA, never pressure
        det.update(clock.monotonic() - 0.1, MIB)
    assert det.ema == pytest.approx(0.1) and not det.is_under_pressure()
    det.update(clock.monotonic() - 0.1, MIB)  # 0.1 s/MiB > 0.010: pressure
    assert det.is_under_pressure()
    assert not det.should_store(3) and det.policy.pop_stores_dropped() == (1, 3)
    clock.advance(20.0)  # ten half-lives of silence: the EMA decays below the low mark
    assert not det.is_under_pressure() and det.pressure_cleared_at == clock.monotonic()
    assert det.should_store(1) and not det.should_store(1)  # cool-down drops every second store
    det.check_invariants()


def test_backpressure_trips_on_consecutive_failures_and_throttles_proportionally():
    clock = VirtualClock()
    det = _detector(clock, policy=ThrottledDropPolicy())
    for _ in range(2):
        det.on_store_failed()
    assert not det.is_under_pressure()
    det.on_store_failed()  # third in a row (fs default threshold 3), even during warm-up
    assert det.is_under_pressure() and det.failure_tripped and det.ema == pytest.approx(0.040)
    assert not det.should_store(1)  # 4x the high mark: overshoot 3 >= ramp 2, every store dropped
    det.ema = 0.02  # overshoot 1 -> drop rate 0.5: about one store in two (float accumulation)
    decisions = [det.should_store(1) for _ in range(8)]
    assert decisions.count(False) in (3, 4) and decisions[0]
    det.check_invariants()


def test_backpressure_rejects_bad_configuration():
    clock = VirtualClock()
    with pytest.raises(InvalidFieldError, match="low_water_s"):
        EMABackpressureDetector(0.001, 0.002, clock=clock.monotonic)
    with pytest.raises(InvalidFieldError, match="alpha"):
        EMABackpressureDetector(0.01, 0.002, alpha=0, clock=clock.monotonic)


def test_async_lookup_generations_and_in_flight_probes():
    present = {_key(0)}
    lm = AsyncLookupManager(lambda k: k in present)
    assert lm.lookup(_key(0), "r0") is None and lm.lookup(_key(1), "r0") is None
    lm.flush()
    assert {s.phase for s in lm.state.values()} == {LookupPhase.IN_FLIGHT}
    lm.cleanup("r0")  # in flight: kept for a request that may share the probe
    assert set(lm.state) == {_key(0), _key(1)}
    assert lm.run_worker() and not lm.run_worker()
    lm.drain_results()  # nobody asks any more: the answers drop the probes
    assert lm.state == {}
    assert lm.lookup(_key(0), "r1") is None  # a new probe, a new generation
    lm.flush()
    lm.run_worker()
    assert lm.lookup(_key(0), "r1") is True
    lm.mark_miss([_key(0)])  # a failed load: the verdict becomes "absent" (vLLM #49176)
    assert lm.lookup(_key(0), "r1") is False
    lm.check_invariants()


def _world(num_chunks=2, tiers=("fs",)):
    clock = VirtualClock()
    primary = CPUPrimaryTier(num_chunks, 64, enable_events=True)
    made = [FileSystemTier(t, primary.buffer, clock.monotonic, enable_events=True) if t == "fs"
            else ExampleTier(t, primary.buffer) for t in tiers]
    return clock, primary, made, TieringOffloadingManager(primary, made, clock.monotonic)


def _store(mgr, primary, ctx, keys):
    out = mgr.prepare_store(keys, ctx)
    for k, cid in zip(out.keys_to_store, out.chunk_ids):
        primary.buffer.write(cid, k * 4 + bytes(64 - 4 * len(k)))
    mgr.complete_store(out.keys_to_store, ctx)
    mgr.check_invariants()
    return out


def test_cascade_pins_until_collected_and_promotion_restores_the_bytes():
    clock, primary, (fs,), mgr = _world()
    ctx = RequestContext("r0")
    mgr.on_new_request(ctx)
    _store(mgr, primary, ctx, [_key(0)])
    (job,) = fs.in_flight()
    assert primary.chunk_state()[_key(0)][1] == 1  # pinned by the cascade
    fs.finish_job(job)
    mgr.on_schedule_end()  # prepare_store already polled this step: the once-per-step poll is spent
    assert primary.chunk_state()[_key(0)][1] == 1
    assert mgr.lookup(_key(0), ctx) is LookupResult.HIT  # the next step's first lookup collects
    assert primary.chunk_state()[_key(0)][1] == 0
    stored = fs.files[_key(0)]
    _store(mgr, primary, ctx, [_key(1)])
    _store(mgr, primary, ctx, [_key(2)])  # the primary tier (2 chunks) evicted key 0
    assert _key(0) not in primary.chunk_state()
    assert mgr.lookup(_key(0), ctx) is LookupResult.RETRY  # the fs probe is not answered yet
    mgr.on_schedule_end()
    fs.run_lookup_worker()
    for job in fs.in_flight():
        fs.finish_job(job)
    mgr.on_schedule_end()
    assert mgr.lookup(_key(0), ctx) is LookupResult.HIT_PENDING  # promotion reserved a slot
    assert mgr.lookup(_key(0), ctx) is LookupResult.HIT_PENDING  # and is not started twice
    mgr.on_schedule_end()
    (load,) = fs.in_flight()
    fs.finish_job(load)
    assert mgr.lookup(_key(0), ctx) is LookupResult.HIT
    (cid,) = mgr.prepare_load([_key(0)], ctx)
    assert primary.buffer.read(cid) == stored and mgr.get_load_source(_key(0), ctx) == "DISK"
    mgr.complete_load([_key(0)], ctx)
    mgr.check_invariants()


def test_failed_promotion_frees_the_slot_and_the_verdict():
    clock, primary, (fs,), mgr = _world()
    ctx = RequestContext("r0")
    mgr.on_new_request(ctx)
    for i in range(3):
        _store(mgr, primary, ctx, [_key(i)])
        for job in fs.in_flight():
            fs.finish_job(job)
        mgr.on_schedule_end()
    mgr.lookup(_key(0), ctx)
    mgr.on_schedule_end()
    fs.run_lookup_worker()
    assert mgr.lookup(_key(0), ctx) is LookupResult.HIT_PENDING
    mgr.on_schedule_end()
    fs.finish_job(fs.in_flight()[0], io_error=True)
    assert mgr.lookup(_key(0), ctx) is LookupResult.MISS  # slot gone, verdict "absent"
    assert _key(0) not in primary.chunk_state()
    mgr.check_invariants()


def test_reset_requires_drained_tiers_and_holds_promotions():
    clock, primary, (fs, ex), mgr = _world(tiers=("fs", "example"))
    ctx = RequestContext("r0")
    mgr.on_new_request(ctx)
    _store(mgr, primary, ctx, [_key(0)])
    with pytest.raises(OffloadStateError, match="in flight"):
        mgr.reset_cache()
    fs.finish_job(fs.in_flight()[0])
    mgr.reset_cache()
    assert primary.chunk_state() == {} and mgr.promotions_held
    assert mgr.lookup(_key(0), ctx) is LookupResult.MISS  # held: the example tier is not asked
    mgr.on_reset_flushed()
    assert mgr.lookup(_key(0), ctx) is LookupResult.HIT_PENDING  # the example tier still has it
    mgr.check_invariants()


def test_unknown_request_and_bad_keys_are_rejected():
    _, _, _, mgr = _world()
    with pytest.raises(InvalidFieldError, match="ctx"):
        mgr.lookup(_key(0), RequestContext("nobody"))
    ctx = RequestContext("r0")
    mgr.on_new_request(ctx)
    with pytest.raises(InvalidFieldError, match="key"):
        mgr.lookup(b"x", ctx)
    with pytest.raises(OffloadStateError, match="no GPU->primary store pending"):
        mgr.complete_store([_key(0)], ctx)
