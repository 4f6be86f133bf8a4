"""No false green (issue #25): a check, a run or a plugin item that examined nothing is never
"passed" / "ok" / exit 0."""

from __future__ import annotations

import json

from kvref import checks, cli, verify
from kvref.baseline import Baseline
from kvref.report import ERROR, PASSED, SKIPPED, CheckResult


def _ctx_with_no_examples(monkeypatch):
    ctx = verify.VerifyContext(profile="fast")
    monkeypatch.setattr(ctx, "examples", lambda fast, ci, nightly=None: 0)
    return ctx


def test_a_check_that_examined_nothing_is_an_error_not_passed():
    empty = verify.Check("empty", "examines nothing", lambda ctx: CheckResult("empty", PASSED, "0 traces", examined=0))
    some = verify.Check("some", "examines one", lambda ctx: CheckResult("some", PASSED, "1 trace", examined=1))
    result = verify.run_check(empty, verify.VerifyContext(), Baseline())
    assert result.status == ERROR and "examined nothing" in result.summary and result.failing
    assert verify.run_check(some, verify.VerifyContext(), Baseline()).status == PASSED


def test_startup_liveness_with_no_case_is_not_passed(monkeypatch):
    """It used to return passed with "0 random configs" (the count it ran was thrown away)."""
    from kvref.check_context import CheckResult as _  # noqa: F401  (the same class verify uses)

    monkeypatch.setattr(verify, "vllm_gate", lambda ctx, name: CheckResult(name, SKIPPED, "no vLLM here"))
    check = verify.Check("startup-liveness", "", verify.check_startup_liveness)
    result = verify.run_check(check, _ctx_with_no_examples(monkeypatch), Baseline())
    assert result.status == ERROR, result


def test_the_offload_machine_with_no_trace_is_not_passed(monkeypatch):
    check = verify.Check("machine-offload", "", verify.check_offload_machine)
    result = verify.run_check(check, _ctx_with_no_examples(monkeypatch), Baseline())
    assert result.status == ERROR, result
    assert verify.run_check(check, verify.VerifyContext(), Baseline()).status == PASSED


def test_verify_of_no_check_is_an_input_error(capsys):
    assert cli.main(["verify", "--only", "spec", "--skip", "spec", "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "--skip" in captured.err


def test_verify_where_every_check_was_skipped_is_nothing_checked(monkeypatch, capsys):
    skipped = verify.Check("needs-x", "skips", lambda ctx: CheckResult("needs-x", SKIPPED, "x not installed"))
    monkeypatch.setattr(checks, "CHECKS", [skipped])
    assert cli.main(["verify", "--json"]) == cli.EXIT_NOTHING_CHECKED == 3
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["nothing_checked"] is True
    assert cli.main(["verify"]) == 3
    assert "NOTHING CHECKED" in capsys.readouterr().out


def test_the_pytest_plugin_fails_an_item_whose_check_examined_nothing(tmp_path):
    """The plugin's items go through verify's run_check: a check that examined nothing fails there."""
    import subprocess
    import sys

    (tmp_path / "conftest.py").write_text(
        "from kvref import checks, verify\n"
        "from kvref.report import PASSED, CheckResult\n"
        "checks.CHECKS.append(verify.Check('empty', 'examines nothing', "
        "lambda ctx: CheckResult('empty', PASSED, '0 traces', examined=0), default=False))\n")
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "kvref.pytest_plugin", "-q", "-p", "no:cacheprovider",
                          "--kvref", "--kvref-checks", "empty"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 1, out.stdout[-2000:]
    assert "kvref check empty: error: examined nothing" in out.stdout


def test_crosshair_with_no_condition_is_not_passed():
    """A CrossHair run that analysed no condition (a contract registry emptied by a refactor)."""
    from types import SimpleNamespace

    check = verify.Check("crosshair", "", lambda ctx: verify._crosshair_result(SimpleNamespace(conditions=[])))
    assert verify.run_check(check, verify.VerifyContext(), Baseline()).status == ERROR


def test_a_vllm_facing_check_that_vllm_crashes_is_a_finding_not_an_error():
    """Session 21's generated vLLM faults: a fault that made vLLM's own allocation raise (``Cannot
    get N free blocks``) under conform-kv-manager read as *error*, a kvref problem, and the vLLM
    campaign did not count it as detected. vLLM's code raising under a vLLM-facing check is *failed*,
    naming the vLLM frame; kvref's own crash, or one outside a vLLM-facing check, stays *error*."""
    import pytest

    from kvref.report import FAILED
    from tests.vllm_env import require_vllm

    require_vllm()
    from vllm.v1.core.block_pool import BlockPool

    def drive(ctx):
        pool = BlockPool(num_gpu_blocks=4, enable_caching=False, hash_block_size=16)
        pool.get_new_blocks(10)  # vLLM: ValueError("Cannot get 10 free blocks from the pool")
        return CheckResult("drives-vllm", PASSED, "never reached", examined=1)

    def own_bug(ctx):
        raise KeyError("kvref's own")

    crashed = verify.run_check(verify.Check("drives-vllm", "", drive, vllm=True), verify.VerifyContext(), Baseline())
    assert crashed.status == FAILED and crashed.failing, crashed
    assert "vllm/v1/core/block_pool.py" in crashed.summary and "get_new_blocks" in crashed.summary
    assert crashed.signature == "vllm raised ValueError in get_new_blocks"
    not_facing = verify.run_check(verify.Check("drives-vllm", "", drive), verify.VerifyContext(), Baseline())
    assert not_facing.status == ERROR
    mine = verify.run_check(verify.Check("own", "", own_bug, vllm=True), verify.VerifyContext(), Baseline())
    assert mine.status == ERROR and "KeyError" in mine.summary
    with pytest.raises(ValueError):
        drive(None)


def test_a_vllm_frame_is_found_through_the_campaign_s_overlay_links(tmp_path, monkeypatch):
    """The vLLM source campaign imports vLLM from an overlay whose unchanged files are links into
    the installation: a frame names the link, whose target lies outside the overlay (the first
    version resolved links and missed every vLLM crash in an unchanged file)."""
    import sys
    import types

    from kvref.vllm_crash import vllm_frame

    installed, overlay = tmp_path / "site" / "vllm", tmp_path / "overlay" / "vllm"
    (installed / "v1").mkdir(parents=True)
    (overlay / "v1").mkdir(parents=True)
    (installed / "v1" / "pool.py").write_text("def take():\n    raise ValueError('Cannot get 2 free blocks')\n")
    (overlay / "v1" / "pool.py").symlink_to(installed / "v1" / "pool.py")
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__path__=[str(overlay)]))
    for name in (overlay / "v1" / "pool.py",):
        scope: dict = {}
        exec(compile((installed / "v1" / "pool.py").read_text(), str(name), "exec"), scope)
        try:
            scope["take"]()
        except ValueError as exc:
            frame = vllm_frame(exc)
        assert frame is not None and frame.filename == "vllm/v1/pool.py" and frame.name == "take", (name, frame)
    outside = tmp_path / "kvref_code.py"
    scope = {}
    exec(compile("def f():\n    raise KeyError(1)\n", str(outside), "exec"), scope)
    try:
        scope["f"]()
    except KeyError as exc:
        assert vllm_frame(exc) is None
