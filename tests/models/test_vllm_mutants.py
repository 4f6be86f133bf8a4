"""The vLLM source-fault campaign: catalogue, overlay mechanism, outcome classification, CLI.

The overlay tests start subprocesses that import vLLM from a temporary overlay and check that the
edit is live there while the installed files stay byte-identical. The campaign subset that runs
faults through ``kvref verify`` lives in test_vllm_mutants_campaign.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvref import cli
from kvref.models.mutants.vllm_source.catalogue import CI_SUBSET, FAULTS, by_id, check_catalogue
from kvref.models.mutants.vllm_source.overlay import (
    CLASSIC, HISTORIC, NEUTRAL, Edit, FaultDoesNotApplyError, SourceFault, build_overlay, fault, file_sha256,
    installed_vllm_dir, overlay,
)
from kvref.spec.errors import InvalidFieldError
from kvref.vllm_campaign import (
    ERROR, KILLED, NOT_LIVE, SURVIVED, CampaignResult, FaultResult, _result_from_report, select_faults,
)


def _vllm_dir() -> str:
    try:
        return installed_vllm_dir()
    except InvalidFieldError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(str(exc))
        pytest.skip(str(exc))


# --------------------------------------------------------------------------------------------
# catalogue


def test_catalogue_size_and_classes():
    kinds = [f.kind for f in FAULTS]
    assert kinds.count(HISTORIC) >= 12
    assert kinds.count(HISTORIC) + kinds.count(CLASSIC) >= 40
    assert kinds.count(NEUTRAL) >= 8
    assert len({f.id for f in FAULTS}) == len(FAULTS), "fault ids are unique"
    for f in FAULTS:
        if f.kind == HISTORIC:
            assert any(ch.isdigit() for ch in f.bug), f"{f.id} names its vLLM issue/PR"
        assert f.behaviour, f"{f.id} says which behaviour it lives in"
    assert set(CI_SUBSET) <= set(by_id()), "the CI subset names catalogued faults"
    assert {by_id()[i].kind for i in CI_SUBSET} >= {HISTORIC, CLASSIC, NEUTRAL}


def test_every_fault_applies_to_the_installed_vllm():
    """Each edit's text is found exactly once in the installed vLLM (0.33.0): a vLLM that moved on
    makes this fail naming the fault, instead of the campaign silently running fewer faults."""
    errors = check_catalogue(_vllm_dir())
    assert not errors, "\n".join(map(str, errors))


def test_every_fault_changes_its_file_and_keeps_it_compilable():
    vdir = _vllm_dir()
    for f in FAULTS:
        with open(os.path.join(vdir, f.path), encoding="utf-8") as fh:
            original = fh.read()
        edited = f.apply_to(original)
        assert edited != original, f.id
        compile(edited, f.path, "exec")  # a fault is a behaviour change, never a syntax error


def test_edit_not_found_or_ambiguous_names_the_fault():
    missing = fault("x.missing", "v1/core/block_pool.py", "no such text", "y", CLASSIC, "d", behaviour="b")
    with pytest.raises(FaultDoesNotApplyError, match=r"x\.missing.*found 0 times.*block_pool\.py"):
        missing.apply_to("some text")
    twice = fault("x.twice", "v1/core/block_pool.py", "ab", "y", CLASSIC, "d", behaviour="b")
    with pytest.raises(FaultDoesNotApplyError, match=r"x\.twice.*found 2 times"):
        twice.apply_to("ab ab")
    assert isinstance(FaultDoesNotApplyError("f", "p", 0, "o"), ValueError)


@pytest.mark.parametrize("kwargs, field", [
    (dict(kind="bogus"), "SourceFault.kind"),
    (dict(kind=HISTORIC, bug=None), "SourceFault.bug"),
    (dict(path="/abs/block_pool.py"), "SourceFault.path"),
    (dict(path="v1/core/block_pool.txt"), "SourceFault.path"),
    (dict(edits=()), "SourceFault.edits"),
])
def test_bad_fault_fields_raise_invalid_field(kwargs, field):
    base = dict(id="x", path="v1/core/block_pool.py", edits=(Edit("a", "b"),), kind=CLASSIC, description="d")
    base.update(kwargs)
    with pytest.raises(InvalidFieldError) as info:
        SourceFault(**base)
    assert info.value.field == field


def test_select_faults_by_id_and_class():
    assert [f.id for f in select_faults(FAULTS, ["neutral.stm_divmod", "stm.free_head_first"])] == [
        "neutral.stm_divmod", "stm.free_head_first"]
    assert {f.kind for f in select_faults(FAULTS, kinds=["neutral"])} == {NEUTRAL}
    assert select_faults(FAULTS, ["stm.free_head_first"], ["neutral"]) == []
    with pytest.raises(InvalidFieldError, match="--faults"):
        select_faults(FAULTS, ["no.such.fault"])
    with pytest.raises(InvalidFieldError, match="--class"):
        select_faults(FAULTS, kinds=["bogus"])


# --------------------------------------------------------------------------------------------
# overlay


def _installed_hashes(vdir: str) -> dict[str, str]:
    return {f.path: file_sha256(os.path.join(vdir, f.path)) for f in FAULTS}


def test_overlay_edit_is_live_in_a_subprocess_and_installed_files_are_untouched():
    vdir = _vllm_dir()
    before = _installed_hashes(vdir)
    f = by_id()["neutral.pool_negated_free_check"]
    probe = ("import sys, vllm, vllm.v1.core.block_pool as m; "
             "print(vllm.__file__); print(m.__file__); print(open(m.__file__).read().count(sys.argv[1]))")
    with overlay(f, vdir) as ov:
        assert os.path.islink(os.path.join(ov.root, "vllm", "__init__.py"))
        assert not os.path.islink(ov.mutated)
        env = ov.env()
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        out = subprocess.run([sys.executable, "-c", probe, f.edits[0].new.strip()], env=env, capture_output=True,
                             text=True, timeout=300, check=True).stdout.split()
        assert out[0].startswith(ov.root + os.sep), out
        assert out[1] == ov.mutated
        assert out[2] == "1", "the edited text is what the subprocess imported"
        # bytecode of the mutated module went into the overlay, never into the installation
        pyc = os.path.join(os.path.dirname(ov.mutated), "__pycache__")
        assert any(n.startswith("block_pool.") for n in os.listdir(pyc))
        assert all(os.path.islink(os.path.join(pyc, n)) for n in os.listdir(pyc) if not n.startswith("block_pool."))
        root = ov.root
    assert not os.path.exists(root), "the overlay is removed afterwards"
    assert _installed_hashes(vdir) == before


def test_clean_overlay_links_everything(tmp_path):
    vdir = _vllm_dir()
    ov = build_overlay(None, str(tmp_path), vdir)
    top = os.path.join(ov.root, "vllm")
    assert ov.mutated is None
    assert all(os.path.islink(os.path.join(top, n)) for n in os.listdir(top) if n != "__pycache__")


def test_overlay_refuses_a_fault_that_does_not_apply(tmp_path):
    vdir = _vllm_dir()
    bad = fault("x.gone", "v1/core/block_pool.py", "text vLLM never had", "y", CLASSIC, "d", behaviour="b")
    with pytest.raises(FaultDoesNotApplyError, match="x.gone"):
        build_overlay(bad, str(tmp_path), vdir)
    missing = fault("x.file", "v1/core/no_such_module.py", "a", "b", CLASSIC, "d", behaviour="b")
    with pytest.raises(InvalidFieldError, match="x.file"):
        build_overlay(missing, str(tmp_path / "2"), vdir)


# --------------------------------------------------------------------------------------------
# outcome classification (no subprocess)


class _Ov:
    def __init__(self, root, mutated):
        self.root, self.mutated = root, mutated


def _report(tmp_path, statuses, *, module_file=None, vllm_file=None, sha=None):
    mutated = tmp_path / "vllm" / "m.py"
    mutated.parent.mkdir(parents=True, exist_ok=True)
    mutated.write_text("edited")
    probe = {"vllm_file": vllm_file or str(tmp_path / "vllm" / "__init__.py")}
    if module_file is not False:
        probe["module_file"] = module_file or str(mutated)
        probe["module_sha256"] = sha or file_sha256(str(mutated))
    checks = [{"name": n, "status": s, "seconds": 1.0, "summary": f"{n} {s}", "details": [f"{n} detail"]}
              for n, s in statuses]
    return _Ov(str(tmp_path), str(mutated)), {"verify": {"checks": checks}, "probe": probe}


def test_a_failed_check_is_a_kill_and_names_the_first(tmp_path):
    f = FAULTS[0]
    ov, rep = _report(tmp_path, [("conform-kv-manager", "passed"), ("conform-scheduler", "failed")])
    r = _result_from_report(f, ov, rep, 12.0)
    assert (r.outcome, r.killed_by, r.live) == (KILLED, "conform-scheduler", True)
    assert r.detail == "conform-scheduler detail"


def test_an_error_is_not_a_kill(tmp_path):
    ov, rep = _report(tmp_path, [("conform-kv-manager", "error"), ("conform-scheduler", "passed")])
    r = _result_from_report(FAULTS[0], ov, rep, 1.0)
    assert r.outcome == ERROR and r.killed_by is None


def test_all_passed_is_a_survivor(tmp_path):
    ov, rep = _report(tmp_path, [("conform-kv-manager", "passed"), ("conform-planning", "accepted")])
    assert _result_from_report(FAULTS[0], ov, rep, 1.0).outcome == SURVIVED


def test_a_fault_whose_module_never_loaded_or_is_stale_is_not_live(tmp_path):
    ov, rep = _report(tmp_path, [("conform-kv-manager", "passed")], module_file=False)
    r = _result_from_report(FAULTS[0], ov, rep, 1.0)
    assert r.outcome == NOT_LIVE and "never imported" in r.detail
    ov, rep = _report(tmp_path, [("conform-kv-manager", "failed")], sha="0" * 64)
    assert _result_from_report(FAULTS[0], ov, rep, 1.0).outcome == NOT_LIVE
    ov, rep = _report(tmp_path, [("conform-kv-manager", "failed")], vllm_file="/site-packages/vllm/__init__.py")
    assert _result_from_report(FAULTS[0], ov, rep, 1.0).outcome == NOT_LIVE


def test_campaign_result_recall_and_false_positives():
    f = by_id()
    results = [FaultResult(f["stm.free_head_first"], KILLED, 1.0, "conform-kv-manager"),
               FaultResult(f["stm.pre40946_gate_uncapped"], SURVIVED, 1.0),
               FaultResult(f["neutral.stm_divmod"], SURVIVED, 1.0),
               FaultResult(f["neutral.coord_loop_var_renamed"], KILLED, 1.0, "conform-scheduler")]
    res = CampaignResult(results, ("conform-kv-manager",), "fast", 0, 2.0)
    assert res.recall("classic") == 1.0 and res.recall("historic") == 0.0 and res.bug_recall == 0.5
    assert [r.fault.id for r in res.false_positives] == ["neutral.coord_loop_var_renamed"]
    assert [r.fault.id for r in res.survivors] == ["stm.pre40946_gate_uncapped"]
    assert not res.ok()
    md = res.to_markdown()
    assert "**FLAGGED**" in md and "**SURVIVED**" in md
    d = res.to_dict()
    assert d["false_positives"] == ["neutral.coord_loop_var_renamed"] and d["bug_recall"] == 0.5
    again = CampaignResult.from_dict(json.loads(json.dumps(d)), FAULTS)
    assert again.to_dict() == d
    summary = res.summary_markdown()
    assert "| **all bug faults** | 2 | 1 | 50.0 % |" in summary
    assert "* admission: `stm.pre40946_gate_uncapped` (#39734, PR 40946)" in summary


def test_cli_renders_a_saved_result(tmp_path, capsys):
    f = by_id()
    res = CampaignResult([FaultResult(f["stm.free_head_first"], KILLED, 3.0, "conform-kv-manager"),
                          FaultResult(f["neutral.stm_divmod"], SURVIVED, 9.0)], ("conform-kv-manager",), "fast", 0, 12.0)
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps(res.to_dict()))
    assert cli.main(["mutants", "--target", "vllm", "--from-json", str(saved), "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "`stm.free_head_first`" in out and "| neutral (must pass) | 1 | flagged: 0 |" in out
    saved.write_text("{}")
    assert cli.main(["mutants", "--target", "vllm", "--from-json", str(saved)]) == 2


# --------------------------------------------------------------------------------------------
# CLI


def test_cli_lists_a_class(capsys):
    assert cli.main(["mutants", "--target", "vllm", "--list", "--class", "neutral"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == sum(f.kind == NEUTRAL for f in FAULTS)
    assert all(line.startswith("neutral.") for line in lines)


def test_cli_rejects_unknown_faults_with_exit_2(capsys):
    assert cli.main(["mutants", "--target", "vllm", "--faults", "no.such"]) == 2
    assert "no.such" in capsys.readouterr().err
    assert cli.main(["mutants", "--target", "vllm", "--class", "bogus", "--list"]) == 2


@pytest.mark.parametrize("argv, field", [
    (["--fault-timeout", "0"], "--fault-timeout"), (["--fault-timeout", "-5"], "--fault-timeout"),
    (["--fault-timeout", "nan"], "--fault-timeout"), (["--min-rate", "2"], "--min-rate"),
    (["--min-rate", "nan"], "--min-rate"), (["--seed", "-1"], "--seed"),
])
def test_cli_rejects_bad_numbers_with_exit_2(argv, field, capsys):
    assert cli.main(["mutants", "--target", "vllm", "--faults", "stm.free_head_first", *argv]) == 2
    assert field in capsys.readouterr().err
