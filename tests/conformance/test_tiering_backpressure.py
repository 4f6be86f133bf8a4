"""vLLM 0.33.0's tier back-pressure (``EMABackpressureDetector`` with ``DropStorePolicy`` /
``ThrottledDropPolicy``) against the reference on generated completion-time programs (#22): every
decision and the whole detector state agree after every operation, every decision path is reached,
and faults planted in vLLM's detector and policy are found."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conformance.tiering_planted import edited
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

BP = "vllm.v1.kv_offload.tiering.backpressure"


@settings(max_examples=profile_examples(5, 20), deadline=None)
@given(st.integers(min_value=0, max_value=2 ** 32))
def test_generated_programs_agree(seed):
    require_vllm()
    from kvref.models.machines.tiering_backpressure import run_programs

    stats = run_programs(seed, 10)
    assert stats["bp_programs"] == 10 and stats["bp_ops"] > 0, stats


def test_every_decision_path_is_reached():
    """The programs are seeded (no Hypothesis draw): the same under every profile; the check's
    fast run (60 programs, seed 0) reaches each path."""
    require_vllm()
    from kvref.models.machines.tiering_backpressure import PATHS, run_programs

    stats = run_programs(0, 60)
    assert [p for p in PATHS if not stats.get(p)] == [], stats


PLANTED = [
    # the throttle forgets the fraction it carried: every store after the first drop is dropped
    ("ThrottledDropPolicy", "should_store", "self._drop_accumulator -= 1.0", "self._drop_accumulator = 1.0"),
    # the cool-down drops every store instead of every second one
    ("EMABackpressureDetector", "should_store", "self._cooldown_count % 2 == 0", "self._cooldown_count % 1 == 0"),
    # a failure trip during warm-up never decays (pressure held until warm-up ends)
    ("EMABackpressureDetector", "is_under_pressure", " or self._failure_tripped", ""),
    # recovery needs the EMA at or below the low mark instead of strictly below (boundary)
    ("EMABackpressureDetector", "on_store_completed", "elif self._ema < self._low:", "elif self._ema <= self._low * 1.5:"),
    # the warm-up seeds the EMA with the last sample instead of the mean
    ("EMABackpressureDetector", "on_store_completed",
     "sum(self._warmup_samples) / len(self._warmup_samples)", "self._warmup_samples[-1]"),
    # a zero high mark lets every store through
    ("ThrottledDropPolicy", "should_store", "if high <= 0:\n            return False",
     "if high <= 0:\n            return True"),
]


@pytest.mark.parametrize("cls_name,method,old,new", PLANTED, ids=[f"{c}.{m}-{i}" for i, (c, m, _, _) in
                                                                  enumerate(PLANTED)])
def test_planted_faults_are_found(cls_name, method, old, new):
    require_vllm()
    from kvref.models.machines.tiering_backpressure import BackpressureDivergence, run_programs

    with edited(BP, cls_name, method, old, new), pytest.raises(BackpressureDivergence):
        run_programs(0, 60)
