"""The scheduler machines' pools come through the one road (#26): a drawn setup that startup
would build exactly as drawn is the plan's pool, so the scheduler runs on what
:func:`kvref.spec.plan_kv_cache` sized, and the liveness oracle's own reading of startup
(:func:`startup_consistent`) must agree with the plan on every setup."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import find

from kvref.impl.reference.scheduler_liveness import startup_consistent
from kvref.models.machines.scheduler import GROUP_KINDS, scheduler_setups
from tests.conftest import profile_examples

REFUSED = "startup refuses it ("


@settings(max_examples=profile_examples(60, 300), deadline=None)
@given(setup=scheduler_setups(consistent=None, kinds=GROUP_KINDS))
def test_the_plan_and_the_liveness_oracle_read_startup_alike(setup):
    """A pool the plan built passes the oracle's startup check; a pool the plan refused fails it
    (had they disagreed, the scheduler machines would assert a drain startup never promised, or
    waive one it did: the #39734 class, inside kvref)."""
    pool, cfg = setup
    if pool.origin == "plan":
        assert startup_consistent(pool, cfg), (pool, cfg)
    else:
        assert pool.origin.startswith("off-plan: scheduler setups aim at pools startup refuses or builds otherwise: ")
        if REFUSED in pool.origin:
            assert not startup_consistent(pool, cfg), (pool, cfg)


def test_planned_pools_are_drawn_and_run_the_plan_s_values():
    pool, cfg = find(scheduler_setups(consistent=True, kinds=GROUP_KINDS), lambda s: s[0].origin == "plan",
                     settings=settings(database=None, max_examples=500))
    # the plan's pool with the scheduler-side settings on top: the startup bound holds by construction
    assert startup_consistent(pool, cfg)
    assert pool.max_in_flight_tokens == cfg.max_in_flight_tokens
    refused, cfg = find(scheduler_setups(consistent=False, kinds=GROUP_KINDS), lambda s: REFUSED in s[0].origin,
                        settings=settings(database=None, max_examples=500))
    assert not startup_consistent(refused, cfg)
