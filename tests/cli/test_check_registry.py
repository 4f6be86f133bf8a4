"""kvref.checks.CHECKS is the single source of checks: what ``kvref verify`` and the pytest plugin
accept is exactly what the two mutant campaigns can select, and no other module lists checks."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

from kvref import checks
from kvref.check_context import CAMPAIGN, Check, VerifyContext
from kvref.spec.errors import InvalidFieldError

ROOT = Path(__file__).resolve().parents[2]
NAMES = [c.name for c in checks.CHECKS]


def _verify_choices() -> list[str]:
    from kvref.cli.verify import add_parser

    parser = add_parser(argparse.ArgumentParser().add_subparsers())
    return next(a.choices for a in parser._actions if "--only" in a.option_strings)


def test_every_check_has_one_entry_and_the_one_signature():
    assert len(NAMES) == len(set(NAMES))
    assert all(isinstance(c, Check) and callable(c.run) and c.description for c in checks.CHECKS)


def test_what_verify_knows_is_exactly_what_the_campaigns_can_select():
    verify_names = set(_verify_choices())
    assert verify_names == set(NAMES)
    reference = set(checks.mutant_campaign_checks())
    from kvref.vllm_campaign import VLLM_CHECKS

    vllm = set(checks.vllm_checks(default_only=False))
    # the reference campaign selects every check but itself; the vLLM campaign the vLLM-facing ones
    assert reference | {checks.CAMPAIGN_CHECK} == verify_names
    assert vllm <= reference and set(VLLM_CHECKS) <= vllm
    assert set(checks.MUTANT_CAMPAIGN) <= reference and set(checks.VLLM_FIRST) <= vllm
    # and each campaign accepts exactly those names
    for name in reference:
        checks.unavailable_checks([name])  # a known name: no InvalidFieldError
    for name in verify_names - reference:
        with pytest.raises(InvalidFieldError, match="names"):
            checks.unavailable_checks([name])
    with pytest.raises(InvalidFieldError, match="checks"):
        checks.run_mutant_campaign([], checks=[checks.CAMPAIGN_CHECK])
    from kvref.vllm_campaign import run_campaign

    for name in verify_names:
        if name in vllm:  # a selectable check: validation goes on to the next argument
            with pytest.raises(InvalidFieldError, match="--profile"):
                run_campaign([], checks=(name,), profile="weekly")
        else:
            with pytest.raises(InvalidFieldError, match="--checks"):
                run_campaign([], checks=(name,), profile="weekly")


def test_the_defaults_keep_verify_and_the_campaigns_as_they_were():
    assert [c.name for c in checks.select_checks()] == [
        "spec", "startup-liveness", "proofs", "crosshair", "machine-reference", "machine-scheduler",
        "machine-offload", "explorer", "conform-explorer", "torch-differential", "conform-kv-manager",
        "conform-scheduler", "conform-spec-decode", "conform-connector", "conform-offload", "conform-p2p",
        "conform-offload-worker", "conform-tiering", "conform-planning"]
    assert [c.name for c in checks.select_checks(mutants=True)][-1] == "mutants"
    assert checks.MUTANT_CAMPAIGN == ("spec-formulas", "explorer", "pool-machine", "scheduler-machine",
                                      "manager-machine", "manager-vllm", "scheduler-vllm", "proofs")
    assert checks.vllm_checks() == ("startup-liveness", "conform-explorer", "conform-kv-manager",
                                    "conform-scheduler", "conform-spec-decode", "conform-connector",
                                    "conform-offload", "conform-p2p", "conform-offload-worker", "conform-tiering",
                                    "conform-planning")


def test_a_campaign_check_runs_under_verify_and_under_the_campaign_profile():
    check = checks.check_named("spec-formulas")
    assert check.run(VerifyContext()).status == "passed"
    assert check.run(VerifyContext(profile=CAMPAIGN, budget=5)).summary == "passed at budget 5"


def test_no_other_module_constructs_checks():
    """A second list of checks would be a second registry: ``Check(...)`` is called in
    kvref/checks.py only (among kvref/ and models/)."""
    offenders = []
    for folder in ("kvref", "models"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "kvref" / "checks.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in (
                        "Check", "CampaignCheck"):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders
