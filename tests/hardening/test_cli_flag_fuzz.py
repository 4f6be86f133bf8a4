"""Every option of every subcommand, found by walking the parser, answers wrong values of its kind
with exit 2 and one clear line; broken files, config.json fields of the wrong type and extreme
sizes never give a traceback, a hang or non-JSON on ``--json`` stdout (``cli_flag_fuzz.py``).

CI runs every flag-walk, file and extreme case and a stable slice of the config.json field edits
(~1,500 cases, ~30 s); the nightly profile runs the other field edits too.
"""

from __future__ import annotations

import argparse
import os

import pytest

from tests.hardening import cli_flag_fuzz as fz

ALL = fz.all_cases()
SAMPLE = fz.ci_sample(ALL)
_IN_SAMPLE = {c.id for c in SAMPLE}
REST = [c for c in ALL if c.id not in _IN_SAMPLE]

#: cases whose fix is in a file this suite's owner does not edit (strict: they must flip when fixed)
KNOWN: dict[str, str] = {}


def _check(case, tmp_path, request):
    if case.id in KNOWN:
        request.applymarker(pytest.mark.xfail(strict=True, reason=KNOWN[case.id]))
    argv, rc, out, err = fz.run_in_process(case, str(tmp_path))
    problems = fz.judge(case, argv, rc, out, err)
    assert not problems, f"{argv}\nexit {rc}\nproblems: {problems}\nstdout: {out[-800:]}\nstderr: {err[-1500:]}"


@pytest.mark.parametrize("case", SAMPLE, ids=[c.id for c in SAMPLE])
def test_flag_walk_case(case, tmp_path, request):
    _check(case, tmp_path, request)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("KVREF_HYPOTHESIS_PROFILE") != "nightly", reason="nightly profile only")
@pytest.mark.parametrize("case", REST, ids=[c.id for c in REST])
def test_flag_walk_case_nightly(case, tmp_path, request):
    _check(case, tmp_path, request)


def test_every_option_of_every_subcommand_is_fuzzed():
    """The walk leaves nothing out: each option or positional that takes a value has cases."""
    covered = {(c.subcommand, c.flag) for c in ALL}
    missing = [(sub, fz._flag(a)) for sub, a, _ in fz.options() if (sub, fz._flag(a)) not in covered]
    assert not missing, missing


def test_a_new_option_is_fuzzed_without_being_listed():
    """An option added tomorrow gets cases from its declaration alone (kind from type/metavar)."""
    from kvref.cli import build_parser

    parser = build_parser()
    size = fz.subparsers(parser)["size"]
    size.add_argument("--new-count", type=int)
    size.add_argument("--new-report", metavar="FILE")
    kinds = {fz._flag(a): k for s, a, k in fz.options(parser) if s == "size"}
    assert kinds["--new-count"] == "int" and kinds["--new-report"] == "in-file"
    cases = fz.flag_cases(parser)
    assert {c.value for c in cases if c.flag == "--new-count"} >= {"x", "nan", "-1", str(10**30)}
    assert {c.value for c in cases if c.flag == "--new-report"} >= {"missing", "deep", "binary"}


@pytest.mark.parametrize("rc, out, err, problem", [
    (None, "", "", "hang"),
    (98, "", "Traceback (most recent call last):\n  ...\nRecursionError", "traceback"),
    (0, "", "", "exit"),  # a value that cannot mean anything accepted
    (2, "", "kvref size: error: one\nkvref size: error: two", "error-line"),
    (2, "", "kvref size: error: something went wrong", "error-line"),  # names no flag, nothing allowed
    (2, "{}", "kvref size: error: --block-size='x' is invalid: expected an int", "json"),
])
def test_the_oracle_can_fail(rc, out, err, problem):
    case = fz.FuzzCase("t", ["size", "--block-size=x", "--json"], "size", "int", "--block-size", "x", True)
    assert any(p.startswith(problem) for p in fz.judge(case, case.argv, rc, out, err))


def test_dashdash_as_a_value_is_one_clear_error(capsys):
    """``--against=--``: argparse hands back ``[]`` (it drops the ``--``); it crashed ``.split``."""
    from kvref import cli

    for argv in (["explore", "--against=--"], ["replay", "x.json", "--kinds=--"], ["verify", "--device=--"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and "error:" in err and argv[-1].split("=")[0] in err


def test_kinds_are_derived_from_the_declaration():
    p = argparse.ArgumentParser()
    acts = [p.add_argument("--a", type=int), p.add_argument("--b", type=float), p.add_argument("--c", choices=("x",)),
            p.add_argument("--d", metavar="BYTES"), p.add_argument("--e", metavar="DIR"), p.add_argument("--f"),
            p.add_argument("--g", metavar="PNG"), p.add_argument("--h", metavar="F=V", action="append")]
    assert [fz.kind_of(a) for a in acts] == ["int", "float", "choice", "bytes", "out-dir", "text", "out-file", "set"]


def test_plot_format_is_checked_before_the_plan(tmp_path, capsys):
    """``--plot plan.foo`` failed after the tables were printed, with matplotlib's message; a name
    without suffix was written as ``NAME.png`` while kvref said ``NAME``."""
    from kvref import cli

    base = ["size", "--example", "llama3_8b", "--available-memory", "16GiB", "--plot"]
    assert cli.main([*base, str(tmp_path / "plan.foo")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "--plot" in err and ".png" in err
    assert cli.main([*base, str(tmp_path / "plan")]) == 0
    assert (tmp_path / "plan").read_bytes().startswith(b"\x89PNG") and not (tmp_path / "plan.png").exists()


SUBCOMMANDS = sorted(fz.subparsers())


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_combinations_of_options(sub):
    """One to four options of a subcommand at once, each with a value of its kind (wrong or good),
    in any order: the same oracle (no traceback or hang, 0/1/2, one error line, JSON stdout)."""
    import tempfile

    from hypothesis import given, settings
    from hypothesis import strategies as st

    from tests.conftest import profile_examples

    choices = fz.combination_choices(sub)
    if not choices:
        pytest.skip(f"{sub} has no option that takes a value")
    picks = st.lists(st.sampled_from(choices).flatmap(
        lambda c: st.tuples(st.just(c[0]), st.sampled_from(c[2]))), min_size=1, max_size=4)

    @settings(max_examples=profile_examples(8, 25, 2000), deadline=None, database=None)
    @given(picks=picks, as_json=st.booleans())
    def run(picks, as_json):
        flags = {f for f, _ in picks}
        base = fz.BASES.get(sub, [sub])
        base = [a for i, a in enumerate(base) if not (a in flags or (i and base[i - 1] in flags and a[:1] != "-"))]
        argv = [*base, *(f"{f}={v}" for f, v in picks)]
        if as_json and any(a == "--json" for a in fz.subparsers()[sub]._option_string_actions):
            argv.append("--json")
        case = fz.FuzzCase("combo", argv, sub, "combination", picks[-1][0], picks[-1][1], False)
        with tempfile.TemporaryDirectory() as tmp:
            got_argv, rc, out, err = fz.run_in_process(case, tmp)
        problems = [p for p in fz.judge(case, got_argv, rc, out, err) if not p.startswith("error-line: names none")]
        assert not problems, f"{got_argv}\nexit {rc}\n{problems}\nstdout: {out[-600:]}\nstderr: {err[-1200:]}"

    run()


def test_only_runs_that_start_ray_leave_the_test_process():
    """``--ray`` read as ``auto`` (bare, or ``--ray=--``) runs in a fresh ``kvref``; an address Ray's
    check refuses, and every run without ``--ray``, stay in process (their errors are the finding)."""
    assert fz.reaches_ray(["verify", "--only", "spec", "--ray=--"])
    assert fz.reaches_ray(["verify", "--only", "spec", "--ray"])
    assert not fz.reaches_ray(["verify", "--only", "spec", "--ray=bogus"])
    assert not fz.reaches_ray(["verify", "--only", "spec"])
    assert not fz.reaches_ray(["verify", "--no-such-flag"])
