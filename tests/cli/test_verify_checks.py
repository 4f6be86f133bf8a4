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


def test_crosshair_verdicts_map_to_check_results():
    from kvref.proofs.crosshair_run import (
        CONFIRMED,
        NOT_ANALYSED,
        NOT_REFUTED,
        REFUTED,
        ConditionResult,
        CrossHairReport,
    )

    def report(*statuses):
        return CrossHairReport("contracts.py", 1.0,
                               [ConditionResult("f", "__return__ >= 0", i, s, "msg") for i, s in enumerate(statuses)])

    assert verify._crosshair_result(report(CONFIRMED, NOT_REFUTED)).status == PASSED
    failed = verify._crosshair_result(report(CONFIRMED, REFUTED))
    assert failed.status == FAILED and "1 refuted" in failed.summary
    unknown = verify._crosshair_result(report(CONFIRMED, NOT_ANALYSED))
    assert unknown.status == "unknown" and "could not analyse" in unknown.summary


def test_proofs_check_proves_theorems_and_refutes_every_historic_variant(tmp_path):
    from kvref.proofs import HISTORIC

    result = verify.check_proofs(verify.VerifyContext(out_dir=str(tmp_path)))
    assert result.status == PASSED, result.details
    assert len(result.artifacts) == len(HISTORIC) >= 8
    assert all(a.startswith(str(tmp_path)) for a in result.artifacts)
