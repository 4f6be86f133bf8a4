"""vLLM 0.33.0's tier back-pressure (``tiering/backpressure.py``) on its own: an
``EMABackpressureDetector`` with its ``DropStorePolicy`` or ``ThrottledDropPolicy``, built from the
same keyword arguments a tier config's ``"backpressure"`` entry passes (issue #22).

The detector reads ``time.monotonic()``; run it inside :func:`kvref.impl.vllm.tiering.virtual_time`
so the trace's clock decides latencies, idle decay and cool-downs.
"""

from __future__ import annotations

from typing import Any

from kvref.spec.errors import InvalidFieldError

POLICY_NAMES = ("DropStorePolicy", "ThrottledDropPolicy")


def default_config(tier_type: str, locality: str | None = None) -> dict:
    """vLLM's ``EMABackpressureDetector.default_config`` (water marks by medium, failure threshold)."""
    from vllm.v1.kv_offload.tiering.backpressure import EMABackpressureDetector

    return EMABackpressureDetector.default_config(tier_type, locality=locality)


def build_detector(kwargs: dict, policy: str, ramp_factor: float | None = None) -> Any:
    """``EMABackpressureDetector(**kwargs, policy=...)``; vLLM's own ``ValueError`` on a config it refuses."""
    from vllm.v1.kv_offload.tiering.backpressure import (
        DropStorePolicy,
        EMABackpressureDetector,
        ThrottledDropPolicy,
    )

    if policy not in POLICY_NAMES:
        raise InvalidFieldError("policy", policy, f"one of {POLICY_NAMES}")
    if not isinstance(kwargs, dict):
        raise InvalidFieldError("kwargs", kwargs, "a dict of EMABackpressureDetector keyword arguments")
    if policy == "DropStorePolicy":
        pol = DropStorePolicy()
    else:
        pol = ThrottledDropPolicy() if ramp_factor is None else ThrottledDropPolicy(ramp_factor=ramp_factor)
    return EMABackpressureDetector(**kwargs, policy=pol)


def snapshot(detector: Any) -> tuple:
    """Everything that decides the detector's future answers, in the order of the reference's
    ``EMABackpressureDetector.snapshot``."""
    p = detector.policy
    return (detector.store_latency_ema, detector._under_pressure, detector._completions, detector._healthy_streak,
            detector._pressure_cleared_at, detector._cooldown_count, detector._consecutive_failures,
            detector._failure_tripped, detector._last_update, p._stores_dropped, p._blocks_dropped,
            getattr(p, "_drop_accumulator", 0.0))


def describe(detector: Any) -> tuple | None:
    """A tier's detector as vLLM's factory configured it, in the order of the reference's
    ``tier_configs.resolve_secondary_tiers``: (class, high, low, alpha, warm-up, decay half-life,
    cool-down, failure threshold, policy class, ramp factor), or None."""
    if detector is None:
        return None
    p = detector.policy
    return (type(detector).__name__, detector._high, detector._low, detector._alpha, detector._warmup_completions,
            detector._decay_half_life_s, detector._cooldown_s, detector._failure_threshold, type(p).__name__,
            getattr(p, "_ramp_factor", None))


__all__ = ["POLICY_NAMES", "build_detector", "default_config", "describe", "snapshot"]
