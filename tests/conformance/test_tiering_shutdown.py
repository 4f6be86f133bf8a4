"""vLLM 0.33.0's tiering manager shutdown when a tier's shutdown fails (#22): every other tier
still gets its attempt, the failure is raised, and the primary tier is kept (a failed tier may
still use its memory). Seeded traces whose out-of-tree tiers fail at shutdown agree with the
reference (what shutdown reached, in order, and whether it raised); faults planted in vLLM's
shutdown are found."""

from __future__ import annotations

import pytest

from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

#: layouts with an out-of-tree tier (the ones a trace can make fail), before and after another tier
LAYOUTS = (("fs", "RequestLevelTier"), ("PolledTier", "fs"), ("RequestLevelTier", "PolledTier"))
MANAGER = "vllm.v1.kv_offload.tiering.manager:TieringOffloadingManager"


def _traces(seed: int, n: int) -> dict:
    require_vllm()
    from kvref.models.machines.tiering import run_traces

    return run_traces(seed, n, layouts=LAYOUTS)


def test_failed_tier_shutdowns_agree():
    """run_traces is seeded (no Hypothesis draw): the same traces under every profile."""
    stats = _traces(0, 4)
    assert stats["traces"] == 4 and 0 < stats["failed_shutdowns"] < 4, stats  # some fail, some do not


def _finds(monkeypatch, wrap) -> str:
    require_vllm()
    import vllm.v1.kv_offload.tiering.manager as tm

    from kvref.models.machines.tiering import TieringDivergence

    cls = tm.TieringOffloadingManager
    monkeypatch.setattr(cls, "_shutdown_tiers", wrap(cls._shutdown_tiers))
    for seed in range(3):
        try:
            _traces(seed, 4)
        except TieringDivergence as exc:
            return str(exc)
    raise AssertionError(f"the fault planted in {MANAGER}._shutdown_tiers was not found")


def test_finds_a_shutdown_that_stops_at_the_first_failing_tier(monkeypatch):
    """Planted: the first tier whose shutdown raises ends the shutdown; the tiers after it keep
    their threads and transfers."""
    def eager(orig):
        def shutdown_tiers(self):
            for tier in self.secondary_tiers:
                tier.shutdown()
            self.primary_tier.shutdown()
        return shutdown_tiers

    assert "shutdown: reference reached" in _finds(monkeypatch, eager)


def test_finds_a_shutdown_that_releases_the_primary_after_a_failure(monkeypatch):
    """Planted: the primary tier's memory is released although a tier failed to shut down."""
    def careless(orig):
        def shutdown_tiers(self):
            try:
                orig(self)
            except Exception:
                self.primary_tier.shutdown()
                raise
        return shutdown_tiers

    assert "'primary'" in _finds(monkeypatch, careless)
