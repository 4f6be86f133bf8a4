"""vLLM 0.33.0's object-store tier when NIXL calls fail, and its shutdown with transfers in flight
(#22): seeded obj traces reach every fault (a refused submission at each of its four NIXL calls,
a state query or handle release that raises, a metadata release that leaks) and agree with the
reference after every operation; faults planted in vLLM's obj tier are found."""

from __future__ import annotations

import pytest

from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

OBJ_LAYOUTS = (("obj",), ("obj", "fs"))
M = "vllm.v1.kv_offload.tiering.obj.manager:ObjectStoreSecondaryTierManager"


def _traces(seed: int, n: int) -> dict:
    require_vllm()
    from kvref.models.machines.tiering import run_traces

    return run_traces(seed, n, layouts=OBJ_LAYOUTS)


def test_obj_traces_agree_and_every_nixl_fault_is_taken():
    """run_traces is seeded (no Hypothesis draw): the same traces under every profile."""
    from kvref.impl.reference.offload.tiering.obj_tier import FAULTS

    stats = _traces(0, 3)
    assert stats["traces"] == 3
    for stage in FAULTS:
        assert stats[f"obj_fault_{stage}"] > 0, (stage, stats)
    assert stats["obj_abandoned"] > 0, stats  # shutdowns with object transfers in flight


def _finds(monkeypatch, attr: str, wrap, seeds=range(3)) -> str:
    """Wrap ``attr`` of vLLM's obj tier with ``wrap(original)`` and return the divergence."""
    require_vllm()
    import vllm.v1.kv_offload.tiering.obj.manager as om

    from kvref.models.machines.tiering import TieringDivergence, run_traces

    cls = om.ObjectStoreSecondaryTierManager
    monkeypatch.setattr(cls, attr, wrap(getattr(cls, attr)))
    for seed in seeds:
        try:
            run_traces(seed, 3, layouts=OBJ_LAYOUTS)
        except TieringDivergence as exc:
            return str(exc)
    raise AssertionError(f"the fault planted in {M}.{attr} was not found")


def test_finds_a_refused_submission_that_is_never_reported(monkeypatch):
    """A transfer NIXL refused must still end its job (a failed result): lost, the primary chunks
    stay pinned and the job stays open for good."""
    def lose(orig):
        def submit(self, job_id, *args, **kwargs):
            orig(self, job_id, *args, **kwargs)
            self._pending_results = [r for r in self._pending_results if r.job_id != job_id]
        return submit

    assert "jobs" in _finds(monkeypatch, "_submit_transfer", lose)


def test_finds_a_result_published_before_its_handle_is_released(monkeypatch):
    """A transfer whose handle NIXL would not release must not be reported (its memory may still
    be in use): a poll that ignores the failed release publishes it a poll early."""
    def careless(orig):
        def poll(self):
            agent = self._agent
            real = agent.release_xfer_handle

            def release(xid):
                try:
                    real(xid)
                except Exception:  # noqa: BLE001 - the planted fault: the failure is ignored
                    agent.xfers.pop(xid, None)
            agent.release_xfer_handle = release
            try:
                orig(self)
            finally:
                agent.release_xfer_handle = real
        return poll

    assert "vLLM" in _finds(monkeypatch, "_poll_active_transfers", careless)


def test_finds_a_failed_state_query_taken_for_success(monkeypatch):
    """check_xfer_state raising fails the transfer; a poll that reads it as DONE reports a store
    or promotion that NIXL never confirmed."""
    def hopeful(orig):
        def poll(self):
            agent = self._agent
            real = agent.check_xfer_state

            def check(xid):
                try:
                    return real(xid)
                except Exception:  # noqa: BLE001 - the planted fault
                    return "DONE"
            agent.check_xfer_state = check
            try:
                orig(self)
            finally:
                agent.check_xfer_state = real
        return poll

    assert "vLLM" in _finds(monkeypatch, "_poll_active_transfers", hopeful)


def test_finds_a_shutdown_that_leaves_transfer_handles(monkeypatch):
    """Shutdown with transfers in flight must release their handles, descriptor lists and object
    registrations (nothing else ever will)."""
    def forgetful(orig):
        def shutdown(self):
            self._transfers = {}
            orig(self)
        return shutdown

    assert "still holds" in _finds(monkeypatch, "shutdown", forgetful)


def test_shutdown_releases_the_rest_when_one_release_fails():
    """Seeded obj traces whose shutdown takes a failing NIXL release (some configurations arm one):
    every other handle is still released."""
    stats = _traces(0, 6)
    assert stats["obj_shutdown_faults"] > 0, stats


def test_finds_a_shutdown_that_gives_up_on_a_transfer_after_a_failed_release():
    """Planted: a transfer whose handle release fails at shutdown keeps its descriptor list and
    registration (the shutdown moves on to the next transfer)."""
    require_vllm()
    from kvref.models.machines.tiering import TieringDivergence
    from tests.conformance.tiering_planted import edited

    old = 'except Exception as exc:\n                logger.warning("release_xfer_handle failed for job %d: %s", job_id, exc)'
    new = "except Exception as exc:\n                continue"
    with edited("vllm.v1.kv_offload.tiering.obj.manager", "ObjectStoreSecondaryTierManager", "shutdown", old, new):
        with pytest.raises(TieringDivergence, match="still holds"):
            _traces(0, 6)
