"""kv_transfer_params of the OffloadingConnector: load tier filters, load / store caps, hit sources.

conform-offload compares the parsed filter and caps of every request, the lookups they cap and the
hit sources with vLLM's OffloadingConnectorScheduler on generated traces; these pin the rules.
"""

from __future__ import annotations

import pytest

from kvref.impl.reference.offload.tier_filter import (
    ALL,
    TierFilter,
    parse_tier_filter,
    request_tier_filter,
    token_cap,
)
from kvref.models.offload.offloading_connector_world import OffloadingConfig, OffloadingWorld
from kvref.spec.errors import InvalidFieldError


@pytest.mark.parametrize("raw, matchers, everything", [
    ([{"medium": "cpu"}], (("CPU", None),), False),
    ([{"medium": "Storage", "locality": "remote"}], (("STORAGE", "REMOTE"),), False),
    ([{}], ((None, None),), False),
    ([], (), False),                                   # explicitly nothing
    ([{"medium": "disk"}], ((None, None),), True),     # every entry skipped: every tier
    (["cpu", {"medium": 3}], ((None, None),), True),   # non-dict and non-string entries skipped
    ("cpu", ((None, None),), True),                    # not a list
    ([{"medium": "cpu", "locality": "far"}, {"locality": "LOCAL"}], ((None, "LOCAL"),), False),
])
def test_parse_is_lenient_as_vllm(raw, matchers, everything):
    f = parse_tier_filter(raw)
    assert (f.matchers, f.everything) == (matchers, everything)


def test_allows_and_caps():
    assert ALL.allows("STORAGE", "REMOTE") and not TierFilter(()).allows("CPU", None)
    cpu = parse_tier_filter([{"medium": "cpu"}])
    assert cpu.allows("CPU", "REMOTE") and not cpu.allows("STORAGE", None) and cpu.allows(None, None)
    assert request_tier_filter({}) is ALL and request_tier_filter(None) is ALL
    assert request_tier_filter({"kv_load_tiers": None}) is ALL
    assert token_cap({"max_load_tokens": 8}, "max_load_tokens") == 8
    for bad in (-1, True, 8.0, "8", None):
        assert token_cap({"max_load_tokens": bad}, "max_load_tokens") is None
    with pytest.raises(InvalidFieldError, match="kv_transfer_params"):
        request_tier_filter(["kv_load_tiers"])
    with pytest.raises(InvalidFieldError, match="medium"):
        ALL.allows("DISK", None)


def _revisit(cfg, params):
    w = OffloadingWorld(cfg, "reference")
    p = list(range(100, 133))
    w.add_request(p)
    for _ in range(6):
        w.step(8)
    while w.jobs:
        w.complete(0, cfg.num_workers)
    w.step(8)
    assert w.reset_gpu_prefix_cache()
    w.add_request(p + [5])
    w.step(8)
    return w


@pytest.mark.parametrize("params, hit", [
    (None, 32), ({"max_load_tokens": 12}, 8), ({"max_load_tokens": 3}, 0), ({"max_load_tokens": True}, 32),
    ({"kv_load_tiers": []}, 32),  # the CPU tier ignores the filter
])
def test_max_load_tokens_caps_the_hit_to_whole_chunks(params, hit):
    """blocks_per_chunk 2 (8-token chunks): a 12-token cap loads one chunk, a cap under a chunk
    nothing; a bool is no cap."""
    w = _revisit(OffloadingConfig(blocks_per_chunk=2, num_gpu_blocks=30, num_cpu_chunks=32,
                                  kv_transfer_params=(params,)), None)  # odd arrivals (r1) get params
    assert w.metas[-1][3] == (("r1", 0, hit),)
    if hit:
        assert w.hit_sources == [("r1", (("host", hit),))]


def test_max_offload_tokens_caps_the_stores():
    w = OffloadingWorld(OffloadingConfig(num_cpu_chunks=32, kv_transfer_params=({"max_offload_tokens": 9},)),
                        "reference")
    w.add_request(list(range(100, 133)))  # r0: even arrivals carry no params
    w.add_request(list(range(300, 333)))  # r1
    stored = []
    for _ in range(6):
        stored += [job[1] for job in w.step(8)[1] for k in job[2]]
    assert stored.count("r1") == 2 and stored.count("r0") == 8  # two 4-token chunks fit under 9 tokens
    assert w.b.request_offload_state("r1") == ("ALL", None, 9) and w.b.request_offload_state("r0") == ("ALL", None, None)
