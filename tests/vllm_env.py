"""Import vLLM for conformance tests, or skip/fail clearly.

Any importable vLLM is tested: kvref models 0.33.0 (what `make test` installs), and on another
version a conformance test that fails is a finding about what changed, never a reason to skip.
In CI (CI=true) a missing vLLM is a failure, not a skip: conformance is how we know the reference
is right. Locally the conformance tests skip with the reason.
"""

from __future__ import annotations

import os

import pytest


def require_vllm():
    """Return the imported ``vllm`` module or skip/fail."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # ImportError or a broken install
        msg = f"vLLM not importable ({exc!r}); `make test` installs 0.33.0"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    return vllm
