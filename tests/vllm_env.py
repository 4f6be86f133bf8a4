"""Import vLLM 0.33.0 for conformance tests, or skip/fail clearly.

In CI (CI=true) a missing or wrong vLLM is a failure, not a skip: conformance is how we know the
reference is right. Locally the conformance tests skip with the reason.
"""

from __future__ import annotations

import os

import pytest

REQUIRED = "0.33.0"


def require_vllm():
    """Return the imported ``vllm`` module (version-checked) or skip/fail."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # ImportError or a broken install
        msg = f"vLLM {REQUIRED} not importable ({exc!r}); `make test` installs it"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    if vllm.__version__ != REQUIRED:
        msg = f"conformance targets vLLM {REQUIRED}, found {vllm.__version__}"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    return vllm
