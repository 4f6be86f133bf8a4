"""kvref's reference of vLLM's object-store tier, alone (no vLLM): how NIXL failures reach the
manager (#22). The vLLM side of the same rules is compared in
tests/conformance/test_tiering_obj_faults.py."""

from __future__ import annotations

import pytest

from kvref.impl.reference.offload.tiering.clock import VirtualClock
from kvref.impl.reference.offload.tiering.obj_tier import FAULTS, ObjectStoreTier
from kvref.impl.reference.offload.tiering.tier_base import PrimaryBuffer, TransferJob
from kvref.spec.errors import InvalidFieldError

ROW = 16


def _key(i: int) -> bytes:
    return bytes([i + 1]) * 8


def _tier() -> ObjectStoreTier:
    primary = PrimaryBuffer(4, ROW)
    for c in range(4):
        primary.write(c, bytes([c + 1]) * ROW)
    return ObjectStoreTier("obj", primary, VirtualClock().monotonic, enable_events=True)


def _store(tier: ObjectStoreTier, job_id: int, chunk: int) -> None:
    tier.submit_store(TransferJob(job_id, (_key(chunk),), (chunk,), False, "r", 0.0))


def _ids(results) -> list[tuple[int, bool]]:
    return [(r.job_id, r.success) for r in results]


def test_a_refused_submission_is_reported_before_what_the_poll_finds():
    tier = _tier()
    _store(tier, 0, 0)
    tier.finish_job(0)
    tier.arm("make")
    _store(tier, 1, 1)  # refused: never in flight
    assert tier.in_flight() == [] and tier.fired["make"] == 1
    assert _ids(tier.get_finished_jobs()) == [(1, False), (0, True)]
    assert [e.keys for e in tier.take_events()] == [(_key(0),)]  # only the store that succeeded
    tier.check_invariants()


def test_a_failed_handle_release_holds_the_result_back_one_poll():
    tier = _tier()
    _store(tier, 0, 0)
    _store(tier, 1, 1)
    tier.finish_job(1)
    tier.finish_job(0)
    tier.arm("release_xfer")
    assert _ids(tier.get_finished_jobs()) == [(1, True)]  # job 0 (polled first) is kept
    assert tier.known_jobs() == {0}
    assert _ids(tier.get_finished_jobs()) == [(0, True)]
    tier.check_invariants()


def test_a_raising_state_query_fails_a_running_transfer_and_nothing_moves():
    tier = _tier()
    _store(tier, 0, 2)
    tier.arm("check")
    assert _ids(tier.get_finished_jobs()) == [(0, False)]
    assert tier.in_flight() == [] and tier.stored_keys() == set()
    with pytest.raises(InvalidFieldError, match="job_id"):
        tier.finish_job(0)  # its handle was released: NIXL no longer runs it


def test_a_raising_state_query_fails_a_promotion_that_already_landed():
    tier = _tier()
    _store(tier, 0, 3)
    tier.finish_job(0)
    tier.get_finished_jobs()
    tier.submit_load(TransferJob(1, (_key(3),), (0,), True, "r", 0.0))
    tier.finish_job(1)  # the bytes are in chunk 0
    tier.arm("check")
    assert _ids(tier.get_finished_jobs()) == [(1, False)]
    assert tier.primary.read(0) == bytes([4]) * ROW  # the bytes landed; the manager drops the slot


def test_cleanup_faults_hold_nothing_back_and_drain_leaves_results_to_the_next_poll():
    tier = _tier()
    _store(tier, 0, 0)
    tier.finish_job(0, io_error=True)
    tier.arm("release_dlist")
    tier.drain_jobs()
    assert tier.fired["release_dlist"] == 1 and tier.known_jobs() == {0}
    assert _ids(tier.get_finished_jobs()) == [(0, False)]


def test_bad_arms_and_a_drain_with_a_running_transfer_are_refused():
    tier = _tier()
    with pytest.raises(InvalidFieldError, match="stage"):
        tier.arm("nope")
    tier.arm(FAULTS[0])
    with pytest.raises(InvalidFieldError, match="armed"):
        tier.arm(FAULTS[1])
    tier.armed = None
    _store(tier, 0, 0)
    with pytest.raises(InvalidFieldError, match="jobs"):
        tier.drain_jobs()
