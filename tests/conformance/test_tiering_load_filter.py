"""A request's load tier filter (``kv_load_tiers`` -> ``ReqContext.load_tier_filter``) in vLLM
0.33.0's tiering lookups (#22): a secondary tier the filter does not allow is not asked (and its
lookup not counted); a tier that declares no medium (KVCR) is allowed by every filter. Seeded
traces agree with the reference; faults planted in vLLM's lookup and matcher are found."""

from __future__ import annotations

import pytest

from tests.conformance.tiering_planted import edited
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


def _traces(seed: int, n: int) -> dict:
    require_vllm()
    from kvref.models.machines.tiering import run_traces

    return run_traces(seed, n)


def test_filtered_requests_agree():
    """Seeded traces (no Hypothesis draw): the same under every profile."""
    stats = _traces(0, 8)
    assert stats["traces"] == 8 and stats["load_tier_filters"] > 0, stats


PLANTED = [
    # lookups ignore the request's filter
    ("vllm.v1.kv_offload.tiering.manager", "TieringOffloadingManager", "lookup",
     "if not req_context.load_tier_filter.allows(tier.medium, tier.locality):", "if False:"),
    # a matcher naming a locality refuses tiers that declare none
    ("vllm.v1.kv_offload.base", "TierMatcher", "matches",
     "self.locality is None or locality is None or self.locality == locality", "self.locality == locality"),
]


@pytest.mark.parametrize("module,cls_name,method,old,new", PLANTED,
                         ids=[f"{c}.{m}" for _, c, m, _, _ in PLANTED])
def test_planted_faults_are_found(module, cls_name, method, old, new):
    require_vllm()
    from kvref.models.machines.tiering import TieringDivergence

    with edited(module, cls_name, method, old, new), pytest.raises(TieringDivergence):
        _traces(0, 8)
