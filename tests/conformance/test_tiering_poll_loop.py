"""vLLM 0.33.0's tier-poll thread (``TieringOffloadingManager._tier_poll_loop`` and ``shutdown``)
against the reference's :class:`TierPollLoop`, pass by pass (#22): failed rounds, a lock held
elsewhere, the give-up after 30 s of failures, per-step servicing after it, and shutdown with the
thread waiting, at the lock, stuck in a round or too slow to wake; every path reached, planted
faults found."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conformance.tiering_planted import edited
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

MANAGER = "vllm.v1.kv_offload.tiering.manager"


@settings(max_examples=profile_examples(2, 8), deadline=None)
@given(st.integers(min_value=0, max_value=2 ** 32))
def test_generated_programs_agree(seed):
    require_vllm()
    from kvref.models.machines.tiering_poll_loop import run_programs

    stats = run_programs(seed, 4)
    assert stats["poll_programs"] == 4 and stats["poll_ops"] > 0, stats


def test_every_path_is_reached():
    """Seeded programs (no Hypothesis draw): the check's fast run (30 programs, seed 0) reaches each path."""
    require_vllm()
    from kvref.models.machines.tiering_poll_loop import PATHS, run_programs

    stats = run_programs(0, 30)
    assert [p for p in PATHS if not stats.get(p)] == [], stats


PLANTED = [
    # a round that succeeds does not restart the failure clock: the thread gives up too early
    ("_tier_poll_loop", "self.poll_tiers()\n                failing_since = None", "self.poll_tiers()"),
    # the thread keeps failing for twice as long before it gives up
    ("_tier_poll_loop", ">= _TIER_POLL_GIVE_UP_AFTER_S", ">= 2 * _TIER_POLL_GIVE_UP_AFTER_S"),
    # every failed round is logged (no rate limit)
    ("_tier_poll_loop", "if now - last_error_log >= _TIER_POLL_ERROR_LOG_INTERVAL_S:", "if True:"),
    # the stall clock is not restarted after a warning: a warning at every pass after 30 s
    ("_tier_poll_loop", "                    stalled_since = None\n                continue", "                continue"),
    # shutdown tears the tiers down under a thread stuck mid-round
    ("shutdown", "if self._tier_poll_thread is not None:", "if False:"),
    # a thread too slow to stop: the tiers are never shut down although the lock was free
    ("shutdown", "try:\n                self._shutdown_tiers()\n            finally:",
     "try:\n                pass\n            finally:"),
]


@pytest.mark.parametrize("method,old,new", PLANTED, ids=[f"{m}-{i}" for i, (m, _, _) in enumerate(PLANTED)])
def test_planted_faults_are_found(method, old, new):
    require_vllm()
    from kvref.models.machines.tiering_poll_loop import PollLoopDivergence, run_programs

    with edited(MANAGER, "TieringOffloadingManager", method, old, new), pytest.raises(PollLoopDivergence):
        run_programs(0, 30)
