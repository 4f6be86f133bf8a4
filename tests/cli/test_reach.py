"""The reach report's parts without running a check (#22): the module list, the exclusion file and
its validation, the figure, the diff-to-function mapping, and the flags' bad input (exit 2)."""

from __future__ import annotations

import ast
import os
import subprocess

import pytest

from kvref import cli
from kvref.reach_changes import changed_lines, map_to_functions
from kvref.reach_exclusions import REASONS, load_exclusions, parse_exclusions
from kvref.reach_modules import load_module_globs, resolve_modules
from kvref.reach_report import FunctionReach, ModuleReach, apply_exclusions, figure, figure_line
from kvref.spec.errors import InvalidFieldError


def _fn(name, units, covered=0, checks=()):
    return FunctionReach(name, 1, units, 0, covered, 0, list(checks))


def _module():
    return ModuleReach("vllm/v1/core/block_pool.py", "/x/block_pool.py",
                       [_fn("", 10, 10, ["c"]), _fn("BlockPool.ran", 6, 3, ["conform-kv-manager"]),
                        _fn("BlockPool.gpu_only", 4), _fn("BlockPool.missed", 5)])


def _entry(module, functions, reason="needs-gpu"):
    names = ", ".join(f'"{f}"' for f in functions)
    return f'[[exclude]]\nmodule = "{module}"\nfunctions = [{names}]\nreason = "{reason}"\nwhy = "test"\n'


def test_exclusions_exclude_only_unexecuted_existing_functions_and_flag_the_rest_as_stale():
    mod = _module()
    text = (_entry("vllm/v1/core/block_pool.py", ["BlockPool.gpu_only", "BlockPool.ran", "BlockPool.nope"])
            + _entry("vllm/v1/core/gone.py", ["f"], "outside-kv-cache"))
    stale = apply_exclusions([mod], parse_exclusions(text))
    assert {(s.module, s.function) for s in stale} == {("vllm/v1/core/block_pool.py", "BlockPool.ran"),
                                                      ("vllm/v1/core/block_pool.py", "BlockPool.nope"),
                                                      ("vllm/v1/core/gone.py", "f")}
    assert "conform-kv-manager" in next(s.problem for s in stale if s.function == "BlockPool.ran")
    # the stale names exclude nothing; the valid one does
    assert [f.name for f in mod.functions if f.excluded] == ["BlockPool.gpu_only"]
    fig = figure([mod])
    assert (fig["total"], fig["excluded"], fig["counted"], fig["covered"]) == (25, 4, 21, 13)
    assert fig["excluded_by_reason"][REASONS["needs-gpu"]]["units"] == 4
    assert figure_line(fig).startswith("reach 61.9 % of 21 statements+branches (16.0 % of 25 excluded: ")


def test_a_whole_module_exclusion_is_stale_once_any_line_of_it_ran():
    mod = _module()
    stale = apply_exclusions([mod], parse_exclusions('[[exclude]]\nmodule = "vllm/v1/core/block_pool.py"\n'
                                                     'whole_module = true\nreason = "needs-gpu"\nwhy = "w"\n'))
    assert [s.function for s in stale] == ["<whole module>"] and not any(f.excluded for f in mod.functions)
    unrun = ModuleReach("vllm/v1/x.py", "/x.py", [_fn("", 3), _fn("f", 2)])
    assert apply_exclusions([unrun], parse_exclusions(_entry("vllm/v1/x.py", ["f"]).replace(
        'functions = ["f"]', "whole_module = true"))) == []
    assert figure([unrun])["excluded"] == 5


@pytest.mark.parametrize("text, field", [
    ('[[exclude]]\nmodule = "vllm/a.py"\nfunctions = ["f"]\nreason = "not modelled yet"\nwhy = "w"\n', "reason"),
    ('[[exclude]]\nmodule = "vllm/a.py"\nfunctions = ["f"]\nreason = "needs-gpu"\n', "why"),
    ('[[exclude]]\nmodule = "a.py"\nfunctions = ["f"]\nreason = "needs-gpu"\nwhy = "w"\n', "module"),
    ('[[exclude]]\nmodule = "vllm/a.py"\nreason = "needs-gpu"\nwhy = "w"\n', "functions"),
    ('[[exclude]]\nmodule = "vllm/a.py"\nfunctions = ["f"]\nwhole_module = true\nreason = "needs-gpu"\nwhy = "w"\n',
     "functions"),
    ("[[exclude]\n", "--reach-exclusions"),
])
def test_a_malformed_exclusion_entry_is_refused_naming_the_field(text, field):
    with pytest.raises(InvalidFieldError) as err:
        parse_exclusions(text, "f.toml")
    assert field in err.value.field


def test_the_packaged_exclusions_name_existing_functions_of_the_installed_vllm():
    """Static half of the staleness rule (the executed half needs a run: test_reach_vllm.py)."""
    pytest.importorskip("coverage")
    from coverage.python import PythonFileReporter

    try:
        mods = resolve_modules()
    except InvalidFieldError:
        pytest.skip("vLLM not installed")
    by_rel = mods.by_rel()
    for e in load_exclusions():
        assert e.module in by_rel, e
        assert e.reason in REASONS and e.why
        names = {r.name for r in PythonFileReporter(by_rel[e.module]).code_regions() if r.kind == "function"}
        assert set(e.functions) <= names, (e.module, set(e.functions) - names)


def test_the_module_list_resolves_every_glob_against_the_installed_vllm():
    globs = load_module_globs()
    assert any(g.glob.startswith("vllm/v1/core/") for g in globs)
    try:
        mods = resolve_modules()
    except InvalidFieldError:
        pytest.skip("vLLM not installed")
    assert mods.unmatched == ()
    rels = set(mods.by_rel())
    for must in ("vllm/v1/core/block_pool.py", "vllm/v1/core/sched/scheduler.py", "vllm/distributed/kv_events.py",
                 "vllm/distributed/kv_transfer/kv_connector/v1/multi_connector.py",
                 "vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py",
                 "vllm/v1/simple_kv_offload/manager.py", "vllm/v1/kv_offload/cpu/manager.py"):
        assert must in rels
    assert all(r.startswith("vllm/") and r.endswith(".py") for r in rels)
    assert "vllm/v1/worker/gpu_model_runner.py" not in rels


def test_a_module_list_glob_outside_vllm_is_refused():
    with pytest.raises(InvalidFieldError):
        load_module_globs('[[module]]\nglob = "../etc/*.py"\n')


SOURCE = '''import os

X = 1


def plain(a):
    return a + 1


class Pool:
    @property
    def size(self):
        return 3

    def outer(self):
        def inner():
            return 1
        return inner()
'''


def test_changed_lines_map_to_the_innermost_function_decorators_included():
    lines = SOURCE.splitlines()
    at = {text.strip(): i + 1 for i, text in enumerate(lines)}
    got = map_to_functions(SOURCE, [at["X = 1"], at["return a + 1"], at["@property"], at["return 3"],
                                    at["return 1"], at["return inner()"]])
    assert got == {("", 0): [at["X = 1"]], ("plain", at["def plain(a):"]): [at["return a + 1"]],
                   ("Pool.size", at["@property"]): [at["@property"], at["return 3"]],
                   ("Pool.outer.inner", at["def inner():"]): [at["return 1"]],
                   ("Pool.outer", at["def outer(self):"]): [at["return inner()"]]}
    # the names are coverage.py's region names
    from coverage.regions import code_regions

    assert {"plain", "Pool.size", "Pool.outer", "Pool.outer.inner"} == {r.name for r in code_regions(SOURCE)
                                                                       if r.kind == "function"}
    ast.parse(SOURCE)


def _git(cwd, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                   capture_output=True)


def test_git_diff_lines_of_additions_edits_and_deletions(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("a = 1\nb = 2\nc = 3\nd = 4\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "m.py")
    _git(tmp_path, "commit", "-qm", "base")
    f.write_text("a = 1\nb = 20\nc = 3\nnew = 5\n")  # edit line 2, replace d by new (line 4)
    assert changed_lines(str(tmp_path), "HEAD", ["m.py"]) == {"m.py": [2, 4]}
    f.write_text("a = 1\nc = 3\nd = 4\n")  # line 2 deleted: the line before it is marked
    assert changed_lines(str(tmp_path), "HEAD", ["m.py"]) == {"m.py": [1]}


def test_changed_since_outside_a_git_checkout_is_exit_2_naming_the_flag(capsys):
    try:
        root = resolve_modules().root
    except InvalidFieldError:
        pytest.skip("vLLM not installed")
    if subprocess.run(["git", "-C", os.path.join(root, "vllm"), "ls-files", "--error-unmatch", "__init__.py"],
                      capture_output=True).returncode == 0:
        pytest.skip("the installed vLLM is a git checkout here")
    rc = cli.main(["verify", "--against", "vllm", "--only", "startup-liveness", "--changed-since", "HEAD"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and "--changed-since" in err[0] and "git" in err[0]


@pytest.mark.parametrize("argv, flag", [
    (["--reach-exclusions", "x.toml"], "--reach-exclusions"),  # without --reach
    (["--reach", "{tmp}/r", "--reach-exclusions", "{tmp}/missing.toml"], "--reach-exclusions"),
    (["--reach", "{tmp}/file.txt"], "--reach"),  # not a folder
    (["--reach", "{tmp}/r", "--reach-exclusions", "{tmp}/bad.toml"], "reason"),
])
def test_bad_reach_flags_are_exit_2_with_one_line(argv, flag, tmp_path, capsys):
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "bad.toml").write_text('[[exclude]]\nmodule = "vllm/a.py"\nfunctions = ["f"]\nreason = "later"\n'
                                       'why = "w"\n')
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    rc = cli.main(["verify", "--only", "spec", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and flag in err[0], err


def _child_runs(path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("reach_probe_mod", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.branchy(3)


def test_the_collector_measures_forked_children_under_the_check_that_started_them(tmp_path):
    """The explorer's workers are multiprocessing children: their lines come back, under the check."""
    import multiprocessing

    from kvref.reach_collect import ReachCollector

    mod = tmp_path / "probe.py"
    mod.write_text("def branchy(n):\n    if n > 2:\n        return 1\n    return 0\n\n\ndef never():\n    return 2\n")
    col = ReachCollector((str(mod),), str(tmp_path / "data"))
    col.start()
    try:
        col.enter("conform-explorer")
        child = multiprocessing.get_context("fork").Process(target=_child_runs, args=(str(mod),))
        child.start()
        child.join(120)
    finally:
        cov = col.stop()
    data = cov.get_data()
    assert child.exitcode == 0
    assert data.measured_contexts() >= {"conform-explorer"}
    assert {2, 3} <= set(data.lines(str(mod)) or []) and 4 not in set(data.lines(str(mod)))
    assert (2, 3) in set(data.arcs(str(mod)) or [])  # branch mode
    assert data.contexts_by_lineno(str(mod))[3] == ["conform-explorer"]


def test_after_a_run_forked_children_no_longer_start_coverage(tmp_path):
    """coverage.py patches multiprocessing for good; kvref undoes it when its run stops, so a later
    run in the same process (a test suite) measures with its own config and other forks are left alone."""
    import multiprocessing
    import multiprocessing.process

    from kvref.reach_collect import ReachCollector

    before = multiprocessing.process.BaseProcess._bootstrap
    mod = tmp_path / "probe.py"
    mod.write_text("def branchy(n):\n    if n > 2:\n        return 1\n    return 0\n")
    for run in ("first", "second"):
        col = ReachCollector((str(mod),), str(tmp_path / run))
        col.start()
        try:
            col.enter(run)
            child = multiprocessing.get_context("fork").Process(target=_child_runs, args=(str(mod),))
            child.start()
            child.join(120)
        finally:
            cov = col.stop()
        assert cov.get_data().contexts_by_lineno(str(mod))[3] == [run]
        assert multiprocessing.process.BaseProcess._bootstrap is before
        assert "COVERAGE_RCFILE" not in os.environ


def test_a_reach_run_whose_checks_were_all_skipped_is_nothing_checked(monkeypatch, tmp_path, capsys):
    """The reach row must not turn a run that examined nothing into a green one (exit 3)."""
    import json

    from kvref import checks, verify
    from kvref.report import SKIPPED, CheckResult

    try:
        resolve_modules()
    except InvalidFieldError:
        pytest.skip("vLLM not installed")
    monkeypatch.setattr(checks, "CHECKS", [verify.Check("gone", "always skipped", lambda ctx: CheckResult(
        "gone", SKIPPED, "no vLLM here"), vllm=True)])
    rc = cli.main(["verify", "--reach", str(tmp_path / "r"), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 3 and out["ok"] is False and out["nothing_checked"] is True
    assert [(c["name"], c["status"]) for c in out["checks"]] == [("gone", "skipped"), ("reach", "skipped")]
    assert out["reach"]["figure"]["covered"] == 0


def test_the_listing_names_the_largest_gaps_first_and_never_an_excluded_function():
    from kvref.reach_report import listing_markdown

    mod = _module()
    apply_exclusions([mod], parse_exclusions(_entry("vllm/v1/core/block_pool.py", ["BlockPool.gpu_only"])))
    text = listing_markdown([mod], figure([mod]), [])
    gaps = text.split("## The largest gaps")[1].split("\n## ")[0]
    assert gaps.index("`BlockPool.missed` | MISSED") < gaps.index("`BlockPool.ran` | partly")
    assert "gpu_only" not in gaps
    assert "| `BlockPool.gpu_only` | 1 | 0/4 | excluded (needs a GPU): test |" in text


_BLOCKS_SRC = '''\
def step(x, ec, log):
    y = 0
    if ec is not None:
        y += 1
        if ec:
            y += 2
    elif (log and
          x > 9):
        y += 3
    if x > 0:
        y += 4
    return y
'''


def _measured_blocks_module(tmp_path):
    """A tiny module measured by coverage.py in branch mode (real statements and arcs): ``step``
    run with ``ec=None, log=False`` and ``x`` 1 and 0, so the ``ec`` body and the ``elif`` body never
    ran and ``if x > 0`` ran both ways."""
    import importlib.util

    coverage = pytest.importorskip("coverage")
    from kvref.reach_report import modules_from_json

    path = tmp_path / "mod_blocks.py"
    path.write_text(_BLOCKS_SRC)
    cov = coverage.Coverage(data_file=str(tmp_path / "cov"), branch=True, include=[str(path)])
    cov.start()
    try:
        spec = importlib.util.spec_from_file_location("mod_blocks", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mod.step(1, None, False)
        mod.step(0, None, False)
    finally:
        cov.stop()
    out = tmp_path / "cov.json"
    cov.json_report(morfs=[str(path)], outfile=str(out))
    import json

    return modules_from_json(json.loads(out.read_text()), {"vllm/v1/x.py": str(path)})


def test_a_block_exclusion_takes_out_only_the_never_run_body_of_its_if_header(tmp_path):
    """``blocks`` entries (#22): the bodies of the named if/elif headers leave the count — their
    statements and the branches that start in or enter them — while the headers, and every other
    line, stay counted; a header split over lines matches its one-line form."""
    [mod] = _measured_blocks_module(tmp_path)
    before = figure([mod])
    assert before["excluded"] == 0 and before["counted"] > before["covered"]
    text = ('[[exclude]]\nmodule = "vllm/v1/x.py"\nblocks = ["if ec is not None:", "elif (log and x > 9):"]\n'
            'reason = "outside-kv-cache"\nwhy = "test"\n')
    assert apply_exclusions([mod], parse_exclusions(text)) == []
    after = figure([mod])
    # excluded: statements y+=1, if ec, y+=2, y+=3 (4) + arcs 3->4, 5->6, 5->10, 7->9 (4)
    assert after["excluded"] == 8, after
    assert after["covered"] == before["covered"]
    # the headers stay counted and ran both ways where they could (3->7, 7->10, 10->11, 10->12):
    # nothing but the two bodies was missed, so what is left counted is all covered
    assert after["counted"] == after["covered"], after
    assert after["excluded_by_reason"][REASONS["outside-kv-cache"]]["units"] == 8


def test_a_block_exclusion_is_stale_for_a_header_that_is_missing_or_whose_body_ran(tmp_path):
    [mod] = _measured_blocks_module(tmp_path)
    text = ('[[exclude]]\nmodule = "vllm/v1/x.py"\nblocks = ["if x > 0:", "if nothing_like_this:"]\n'
            'reason = "outside-kv-cache"\nwhy = "test"\n')
    stale = apply_exclusions([mod], parse_exclusions(text))
    assert sorted(s.problem.split(" (")[0] for s in stale) == [
        "its body was executed", "no such if/elif header in this vLLM's module"]
    assert figure([mod])["excluded"] == 0  # a stale header excludes nothing


@pytest.mark.parametrize("blocks, field", [
    ('["y = 1"]', "blocks"),                    # not an if/elif header
    ('["if x"]', "blocks"),                     # no colon
    ('[""]', "blocks"),
    ('"if x:"', "blocks"),                      # not a list
])
def test_a_malformed_blocks_entry_is_refused_naming_the_field(blocks, field):
    text = f'[[exclude]]\nmodule = "vllm/a.py"\nblocks = {blocks}\nreason = "outside-kv-cache"\nwhy = "w"\n'
    with pytest.raises(InvalidFieldError) as err:
        parse_exclusions(text, "f.toml")
    assert field in err.value.field
    both = '[[exclude]]\nmodule = "vllm/a.py"\nfunctions = ["f"]\nblocks = ["if x:"]\nreason = "needs-gpu"\nwhy = "w"\n'
    with pytest.raises(InvalidFieldError, match="exactly one of the three"):
        parse_exclusions(both, "f.toml")


def test_the_packaged_block_exclusions_match_headers_of_the_installed_vllm():
    """Static half of the staleness rule for ``blocks``: every header exists in its module."""
    from kvref.reach_report import _if_headers

    try:
        by_rel = resolve_modules().by_rel()
    except InvalidFieldError:
        pytest.skip("vLLM not installed")
    entries = [e for e in load_exclusions() if e.blocks]
    assert entries, "the packaged file has block entries (scheduler.py's encoder cache, logging, ...)"
    for e in entries:
        headers = {text for text, *_ in _if_headers(by_rel[e.module])}
        assert set(e.blocks) <= headers, (e.module, set(e.blocks) - headers)
