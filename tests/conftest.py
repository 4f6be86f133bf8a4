"""Shared pytest set-up: Hypothesis profiles, vLLM availability, GPU marker handling.

Profiles: ``fast`` (default, for a laptop), ``ci`` (selected when CI=true, see scripts/run-tests.sh),
``nightly`` (100x the CI example counts). Pick one with ``KVREF_HYPOTHESIS_PROFILE``.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                      HealthCheck.filter_too_much])
settings.register_profile("fast", max_examples=50, **_COMMON)
settings.register_profile("ci", max_examples=200, derandomize=False, print_blob=True, **_COMMON)
settings.register_profile("nightly", max_examples=20000, print_blob=True, **_COMMON)
settings.load_profile(os.environ.get("KVREF_HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") == "true" else "fast"))

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def profile_examples(fast: int, ci: int, nightly: int | None = None) -> int:
    """Example count for the active profile (for tests that need more or fewer than the default)."""
    name = settings._current_profile  # type: ignore[attr-defined]
    if name == "nightly":
        return nightly if nightly is not None else ci * 100
    return ci if name == "ci" else fast


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if not _cuda_available():
        skip_gpu = pytest.mark.skip(reason="no CUDA device on this machine (GPU-only test)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)
