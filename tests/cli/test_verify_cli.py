"""The front door: `kvref verify` exit codes, JSON and JUnit output, check selection."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from kvref import checks, cli, verify
from kvref.report import FAILED, PASSED, CheckResult


def test_verify_spec_check_passes_and_reports_json(capsys):
    rc = cli.main(["verify", "--only", "spec", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert out["ok"] is True
    assert [c["name"] for c in out["checks"]] == ["spec"]
    assert out["checks"][0]["status"] == PASSED


def test_verify_exits_nonzero_and_writes_junit_on_failure(monkeypatch, tmp_path, capsys):
    def failing(ctx):
        return CheckResult("boom", FAILED, "deliberately failing check", details=["trace step 3"])

    monkeypatch.setattr(checks, "CHECKS", [verify.Check("boom", "always fails", failing)])
    junit = tmp_path / "report.xml"
    rc = cli.main(["verify", "--junit-xml", str(junit)])
    assert rc == 1
    suite = ET.parse(junit).getroot()
    assert suite.get("failures") == "1"
    assert suite.find("testcase/failure").get("message") == "deliberately failing check"
    assert "boom" in capsys.readouterr().out


def test_a_crashing_check_is_an_error_not_a_crash(monkeypatch, capsys):
    def crashing(ctx):
        raise RuntimeError("kaputt")

    monkeypatch.setattr(checks, "CHECKS", [verify.Check("crash", "raises", crashing)])
    rc = cli.main(["verify", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1
    assert out["checks"][0]["status"] == "error"
    assert "kaputt" in out["checks"][0]["summary"]


def test_unknown_check_name_is_rejected():
    assert cli.main(["verify", "--only", "no-such-check"]) == 2
