"""Generated tiering spec configs through vLLM 0.33.0's ``TieringOffloadingSpec`` (#22): the tiers
and back-pressure detectors vLLM builds (top-level and per-tier back-pressure merged field by
field, class names resolved, medium defaults filled in) or the refusal and its clean-up agree with
the reference's ``resolve_secondary_tiers``; faults planted in the resolution are found."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conformance.tiering_planted import edited
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


@settings(max_examples=profile_examples(5, 20), deadline=None)
@given(st.integers(min_value=0, max_value=2 ** 32))
def test_generated_configs_agree(seed):
    require_vllm()
    from kvref.models.machines.tiering_spec_config import run_spec_cases

    stats = run_spec_cases(seed, 10)
    assert stats["spec_configs"] == 10, stats


def test_builds_and_every_refusal_are_reached():
    """Seeded cases (no Hypothesis draw): the check's fast run (120 configs, seed 0) builds
    detectors and refuses for every rule."""
    require_vllm()
    from kvref.models.machines.tiering_spec_config import run_spec_cases

    stats = run_spec_cases(0, 120)
    rules = ("secondary_tiers", "store_threshold", "eviction_policy", "type", "module_path", "backpressure_cls",
             "backpressure", "tier", "locality")
    assert stats.get("spec_detectors", 0) > 10 and [r for r in rules if not stats.get(f"spec_refused_{r}")] == [], stats


PLANTED = [
    # the top-level back-pressure defaults win over the tier's own fields
    ("vllm.v1.kv_offload.tiering.spec", "TieringOffloadingSpec", "__init__",
     "for source in (bp_defaults, tier_override):", "for source in (tier_override, bp_defaults):"),
    # the medium defaults overwrite the fields the config set
    ("vllm.v1.kv_offload.tiering.factory", "SecondaryTierFactory", "create_secondary_tier",
     "bp_config.setdefault(k, v)", "bp_config[k] = v"),
    # the tier's locality is not passed to the detector's defaults (a REMOTE fs tier gets local marks)
    ("vllm.v1.kv_offload.tiering.factory", "SecondaryTierFactory", "create_secondary_tier",
     "default_config(tier_type, locality=locality)", "default_config(tier_type, locality=None)"),
    # a failed build leaves the tiers built before it running
    ("vllm.v1.kv_offload.tiering.spec", "TieringOffloadingSpec", "get_manager",
     "for tier in reversed(secondary_tiers):", "for tier in []:"),
]


@pytest.mark.parametrize("module,cls_name,method,old,new", PLANTED,
                         ids=[f"{c}.{m}-{i}" for i, (_, c, m, _, _) in enumerate(PLANTED)])
def test_planted_faults_are_found(module, cls_name, method, old, new):
    require_vllm()
    from kvref.models.machines.tiering_spec_config import SpecConfigDivergence, run_spec_cases

    with edited(module, cls_name, method, old, new), pytest.raises(SpecConfigDivergence):
        run_spec_cases(0, 120)
