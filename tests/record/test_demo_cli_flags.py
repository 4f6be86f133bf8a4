"""Every option of ``kvref demo record`` / ``kvref demo campaign``, found by walking the nested parser,
answers a wrong value of its kind with exit 2 and one error line naming the option, before any vLLM
run starts (the CLI flag fuzz of tests/hardening walks the top-level subcommands only)."""

from __future__ import annotations

import argparse

import pytest

from kvref import cli
from tests.hardening import cli_flag_fuzz as fz

WRONG = {"int": ("x", "-1", str(10**30), "1.5"), "choice": ("nosuch", ""), "text": ("nosuch", ",", "")}


def _demo_options():
    demo = fz.subparsers()["demo"]
    nested = next(a for a in demo._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("record", "campaign"):
        sp = nested.choices[name]
        for action in sp._actions:
            if fz.takes_value(action) and action.option_strings:
                kind = fz.kind_of(action)
                for value in WRONG.get(kind, ()):
                    yield pytest.param(name, fz._flag(action), value, id=f"{name}{fz._flag(action)}={value!r}")


@pytest.mark.parametrize("sub, flag, value", list(_demo_options()))
def test_a_wrong_value_is_exit_2_naming_the_option(sub, flag, value, tmp_path, capsys):
    argv = ["demo", sub, *([str(tmp_path / "run.kvtrace.gz")] if sub == "record" else []), f"{flag}={value}"]
    assert cli.main(argv) == 2, argv
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if "error" in ln.lower()]
    assert out == "" and len(lines) == 1 and flag in lines[0], err


def test_an_unwritable_output_and_a_missing_demo_command_are_input_errors(tmp_path, capsys):
    assert cli.main(["demo", "record", str(tmp_path / "no" / "such" / "run.kvtrace.gz")]) == 2
    assert "OUT" in capsys.readouterr().err
    assert cli.main(["demo"]) == 2
    assert "DEMO_COMMAND" in capsys.readouterr().err


def test_demo_record_plants_every_fault_the_campaign_knows():
    """``--fault`` takes the feature faults too (the check_stop ones among them, #28): before, the
    record command offered six of the eight demo faults and none of the feature faults."""
    from kvref.impl.vllm.demo_faults import FAULTS
    from kvref.impl.vllm.record_faults import FEATURE_FAULTS

    demo = fz.subparsers()["demo"]
    nested = next(a for a in demo._actions if isinstance(a, argparse._SubParsersAction))
    [fault] = [a for a in nested.choices["record"]._actions if "--fault" in a.option_strings]
    assert set(fault.choices) == set(FAULTS) | set(FEATURE_FAULTS)
    assert {"min-tokens-first", "repetition-ignores-min"} <= set(fault.choices)
