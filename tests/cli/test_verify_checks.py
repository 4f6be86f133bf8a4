"""Each `kvref verify` check can fail: a planted difference is reported, not swallowed."""

from __future__ import annotations

import pytest

from kvref import checks, verify
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

    import kvref.impl.vllm.planning as vp

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

    result = verify.check_proofs(verify.VerifyContext(out_dir=str(tmp_path), write_reproducers=True))
    assert result.status == PASSED, result.details
    assert len(result.artifacts) == len(HISTORIC) >= 8
    assert all(a.startswith(str(tmp_path)) for a in result.artifacts)


def test_reference_machine_catches_a_mutated_reference_and_saves_a_replayable_trace(tmp_path, capsys):
    from kvref import cli
    from kvref.models.mutants.catalogue import CATALOGUE

    ctx = verify.VerifyContext(out_dir=str(tmp_path), seed=1, shrink=False)
    with CATALOGUE["pool.touch_no_ref"].applied():
        result = verify.check_reference_machine(ctx)
        assert result.status == FAILED, result.summary
        assert result.artifacts and result.artifacts[0].startswith(str(tmp_path))
        assert "kvref replay" in result.summary
        # the saved trace replays to the same failure while the fault is in
        assert cli.main(["replay", result.artifacts[0], "--kinds", "reference"]) == 1
    # and replays clean once the fault is gone, as a step table of block tables per group
    assert cli.main(["replay", result.artifacts[0], "--kinds", "reference", "--table"]) == 0
    table = capsys.readouterr().out
    assert "block tables per group" in table and ": g0[" in table


@pytest.mark.vllm
def test_kv_manager_conformance_check_reports_a_divergence(vllm, monkeypatch, tmp_path):
    """The mapping from a failed run to the check result (the real runs are in tests/conformance)."""
    import kvref.models.machines.kv_cache_manager as m

    def fake_run(kinds, examples, **kwargs):
        assert kinds == ("reference", "vllm") and examples >= 25 and kwargs["shrink"]
        return m.MachineRun(m.MachineStats(steps=[31]), 0.1, "Divergence: block ids differ", str(tmp_path / "t.json"))

    monkeypatch.setattr(m, "run_machine", fake_run)
    result = verify.check_kv_manager_conformance(verify.VerifyContext(out_dir=str(tmp_path)))
    assert result.status == FAILED
    assert result.details == ["Divergence: block ids differ"]
    assert result.artifacts == [str(tmp_path / "t.json")]


def test_scheduler_machine_check_reports_a_failure(monkeypatch):
    import kvref.models.machines.scheduler as sm

    def fake(with_vllm, examples, shrink=True, **kw):
        return sm.SchedulerRun(ok=False, traces=3, ops=90, coverage={}, failure="liveness: r1 not finished")

    monkeypatch.setattr(sm, "run_scheduler_machine", fake)
    result = verify.check_scheduler_machine(verify.VerifyContext())
    assert result.status == FAILED and result.details == ["liveness: r1 not finished"]


def test_scheduler_machine_check_passes_on_the_reference():
    result = verify.check_scheduler_machine(verify.VerifyContext())
    assert result.status == PASSED and "generated traces" in result.summary


def test_offload_check_finds_the_pre_41289_duplicate_store():
    from kvref.models.mutants.catalogue import CATALOGUE

    ctx = verify.VerifyContext(profile="ci")
    assert verify.check_offload_machine(ctx).status == PASSED
    with CATALOGUE["offload.in_flight_not_deduped"].applied():
        result = verify.check_offload_machine(ctx)
    assert result.status == FAILED, result.summary
    assert any("two in-flight stores" in line for line in result.details), result.details


def test_explorer_check_passes_and_writes_a_step_table_for_a_fault(tmp_path):
    from kvref.models.mutants.catalogue import CATALOGUE

    ctx = verify.VerifyContext(out_dir=str(tmp_path))
    assert verify.check_explorer(ctx).status == PASSED
    with CATALOGUE["manager.swa_skip_one_too_many"].applied():  # frees a window block too early
        result = verify.check_explorer(ctx)
    assert result.status == FAILED, result.summary
    assert result.artifacts and open(result.artifacts[0]).read().strip()


def test_mutants_check_only_runs_when_asked():
    names = [c.name for c in checks.select_checks()]
    assert "mutants" not in names and "explorer" in names and "proofs" in names
    assert "mutants" in [c.name for c in checks.select_checks(mutants=True)]


def test_torch_differential_runs_on_the_requested_device_and_rejects_bad_ones():
    ok = verify.check_torch_differential(verify.VerifyContext(device="cpu"))
    assert ok.status == PASSED and ok.summary.endswith("[torch on cpu]")
    bad = verify.check_torch_differential(verify.VerifyContext(device="no-such-device"))
    assert bad.status == "error" and "not a torch device" in bad.summary


def test_explorer_conformance_check_passes_and_fails_on_a_reference_fault():
    from kvref.models.mutants.catalogue import CATALOGUE

    ctx = verify.VerifyContext()
    ok = verify.check_explorer_conformance(ctx)
    assert ok.status == PASSED and "transitions" in ok.summary and "torch" in ok.summary
    with CATALOGUE["manager.free_head_first"].applied():
        bad = verify.check_explorer_conformance(ctx)
    assert bad.status == FAILED and "divergence" in bad.summary
    assert any("DIVERGENCE" in d for d in bad.details)
