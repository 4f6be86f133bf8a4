"""Each `kvref verify` check can fail: a planted difference is reported, not swallowed."""

from __future__ import annotations

import pytest

from kvref import verify
from kvref.report import FAILED, PASSED
from tests.vllm_env import require_vllm


@pytest.fixture(scope="module")
def vllm():
    return require_vllm()


@pytest.mark.vllm
def test_planning_conformance_passes_and_catches_a_planted_difference(vllm, monkeypatch):
    ctx = verify.VerifyContext(profile="fast")
    monkeypatch.setattr(ctx, "examples", lambda fast, ci, nightly=None: 40)
    assert verify.check_planning_conformance(ctx).status == PASSED

    import kvref.impl.vllm_planning as vp

    original = vp.kvref_outcome

    def off_by_one(*args, **kwargs):
        out = original(*args, **kwargs)
        if out.status == "ok":
            out.fields["num_blocks"] += 1
        return out

    monkeypatch.setattr(vp, "kvref_outcome", off_by_one)
    result = verify.check_planning_conformance(ctx)
    assert result.status == FAILED
    assert any("num_blocks" in line for line in result.details)
