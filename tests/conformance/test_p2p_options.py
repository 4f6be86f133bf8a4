"""The P2P tier's options (``unbound_store_timeout_s``, a back-pressure detector) built or refused by
vLLM's ``P2PSecondaryTierManager`` as the reference resolves them, on generated options (#22)."""

from __future__ import annotations

import pytest

from kvref.impl.reference.offload.p2p.manager import unbound_store_timeout
from kvref.models.machines.p2p import run_p2p_config_cases
from kvref.spec.errors import InvalidFieldError
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


def test_vllm_resolves_generated_tier_options_as_the_reference():
    require_vllm()
    ok, failure = run_p2p_config_cases(profile_examples(6, 20))
    assert ok, failure


def test_the_reference_resolution():
    assert unbound_store_timeout(" 2.5 ") == 2.5 and unbound_store_timeout(True) == 1.0
    assert unbound_store_timeout("inf") == float("inf")
    for bad in (0, -1, "nan", float("nan"), None, "abc", [1]):
        with pytest.raises(InvalidFieldError, match="unbound_store_timeout_s"):
            unbound_store_timeout(bad)
    with pytest.raises(InvalidFieldError, match="backpressure"):
        unbound_store_timeout(60, backpressure=True)


def _plant(monkeypatch, change) -> None:
    from vllm.v1.kv_offload.tiering.p2p.manager import P2PSecondaryTierManager

    real = P2PSecondaryTierManager.__init__

    def planted(self, spec, view, *args, **kwargs):
        real(self, spec, view, *args, **change(dict(kwargs)))

    monkeypatch.setattr(P2PSecondaryTierManager, "__init__", planted)


def test_a_tier_that_ignores_a_backpressure_detector_is_found(monkeypatch):
    """Planted in vLLM: the detector is dropped instead of refused (the tier would then drop stores
    a PD consumer waits for until its load timeout)."""
    require_vllm()

    def drop(kwargs):
        kwargs.pop("backpressure_detector", None)
        return kwargs

    _plant(monkeypatch, drop)
    ok, failure = run_p2p_config_cases(30)
    assert not ok and "backpressure=True" in failure, failure


def test_a_tier_that_takes_the_magnitude_of_its_timeout_is_found(monkeypatch):
    """Planted in vLLM: a negative parked-store timeout is taken as its magnitude instead of refused."""
    require_vllm()

    def magnitude(kwargs):
        value = kwargs.get("unbound_store_timeout_s")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
            kwargs["unbound_store_timeout_s"] = -value
        return kwargs

    _plant(monkeypatch, magnitude)
    ok, failure = run_p2p_config_cases(40)
    assert not ok and "unbound_store_timeout_s=-" in failure, failure
