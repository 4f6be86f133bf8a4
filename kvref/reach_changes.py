"""``kvref verify --against vllm --changed-since REF``: what a developer's change to vLLM's
KV-cache code was checked by (issue #22, part 3).

The installed vLLM must sit in a git checkout (an editable install or a source tree on
``PYTHONPATH``). ``git diff REF`` of that checkout (committed and uncommitted changes alike) is cut
to the files of the reach module list; every changed line is mapped to the innermost function
whose ``def`` (decorators included) spans it — with :mod:`ast`, on the file as it is now — or to
the module level. After the checks ran, each changed function is reported with the body lines
that ran, the checks they ran under, and the number of calls per check; one that never ran reads
"kvref did not check this change".
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
from dataclasses import dataclass, field

from kvref.spec.errors import InvalidFieldError

from .reach_collect import NO_CHECK

FLAG = "--changed-since"
NOT_CHECKED = "kvref did not check this change"


@dataclass
class ChangedFunction:
    """One function (``name == ""``: module-level code) a diff touched, and what ran it."""

    module: str
    name: str
    #: the line of its ``def`` (of the first decorator); 0 at module level
    first_line: int
    changed_lines: list[int]
    executed_lines: int = 0
    statement_lines: int = 0
    checks: list[str] = field(default_factory=list)
    calls: dict[str, int] = field(default_factory=dict)
    excluded: str | None = None
    why: str | None = None

    @property
    def checked(self) -> bool:
        return self.executed_lines > 0

    def verdict(self) -> str:
        if self.checked:
            ran = ", ".join(self.checks)
            if self.name:
                n = sum(self.calls.values())
                return f"checked: {self.executed_lines}/{self.statement_lines} lines ran, {n:,} call(s), under {ran}"
            return f"checked: {self.executed_lines}/{self.statement_lines} changed module-level lines ran, under {ran}"
        if self.excluded:
            return f"not checked: excluded from reach ({self.why})"
        return NOT_CHECKED

    def to_dict(self) -> dict:
        return {"module": self.module, "function": self.name or "<module level>", "line": self.first_line,
                "changed_lines": self.changed_lines, "checked": self.checked, "executed_lines": self.executed_lines,
                "statement_lines": self.statement_lines, "checks": self.checks, "calls": self.calls,
                "excluded": self.excluded, "verdict": self.verdict()}


def _git(cwd: str, *args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["git", "-C", cwd, *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise InvalidFieldError(FLAG, " ".join(args), f"a working git ({exc})") from None


def checkout_of(root: str, ref: str) -> tuple[str, str]:
    """``(top-level of the git checkout holding vllm/, the commit REF names)``; an
    :class:`InvalidFieldError` naming ``--changed-since`` when vLLM is not in a git checkout or
    ``ref`` names no commit there."""
    if not isinstance(ref, str) or not ref or ref.startswith("-"):
        raise InvalidFieldError(FLAG, ref, "a git revision (a commit, branch or tag) of the vLLM checkout")
    pkg = os.path.join(root, "vllm")
    tracked = _git(pkg, "ls-files", "--error-unmatch", "__init__.py")
    top = _git(pkg, "rev-parse", "--show-toplevel")
    if tracked.returncode != 0 or top.returncode != 0:
        raise InvalidFieldError(FLAG, ref, f"a vLLM inside a git checkout, but the vLLM imported here ({pkg}) is "
                                "not tracked by git (install vLLM from a checkout: pip install -e, or PYTHONPATH)")
    commit = _git(pkg, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    if commit.returncode != 0:
        raise InvalidFieldError(FLAG, ref, f"a commit of the vLLM checkout at {top.stdout.strip()}")
    return top.stdout.strip(), commit.stdout.strip()


_HUNK = re.compile(r"^@@ -\d+(?:,\d+)? \+(\d+)(?:,(\d+))? @@")


def changed_lines(top: str, commit: str, paths: list[str]) -> dict[str, list[int]]:
    """``git diff`` of the work tree against ``commit`` for ``paths`` (files of the work tree,
    relative to ``top``): ``{path: changed line numbers in the current file}``. A pure deletion
    marks the line before it (the code around the removed lines)."""
    if not paths:
        return {}
    res = _git(top, "diff", "--no-color", "--no-ext-diff", "--no-renames", "--unified=0", commit, "--", *paths)
    if res.returncode != 0:
        raise InvalidFieldError(FLAG, commit, f"a revision git can diff against ({res.stderr.strip()[:200]})")
    out: dict[str, list[int]] = {}
    current: str | None = None
    for line in res.stdout.splitlines():
        if line.startswith("+++ "):
            current = line[6:] if line.startswith("+++ b/") else None
            if current is not None:
                out.setdefault(current, [])
        elif current is not None:
            m = _HUNK.match(line)
            if m:
                start, count = int(m.group(1)), int(m.group(2) if m.group(2) is not None else 1)
                out[current].extend(range(start, start + count) if count else [max(start, 1)])
    return out


def _functions(source: str) -> list[tuple[str, int, int, int]]:
    """``(qualified name, first line incl. decorators, def line, last line)`` of every function,
    outermost first; names as coverage.py writes them (``Class.method``, ``outer.inner``)."""
    out: list[tuple[str, int, int, int]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                    out.append((name, first, child.lineno, child.end_lineno or child.lineno))
                walk(child, name + ".")
            else:
                walk(child, prefix)

    walk(ast.parse(source), "")
    return out


def map_to_functions(source: str, lines: list[int]) -> dict[tuple[str, int], list[int]]:
    """Changed lines grouped by their innermost enclosing function: ``{(name, first line): lines}``
    (``("", 0)`` for module-level lines)."""
    funcs = _functions(source)
    out: dict[tuple[str, int], list[int]] = {}
    for ln in sorted(set(lines)):
        inner = [f for f in funcs if f[1] <= ln <= f[3]]
        key = (max(inner, key=lambda f: f[1])[0], max(inner, key=lambda f: f[1])[1]) if inner else ("", 0)
        out.setdefault(key, []).append(ln)
    return out


@dataclass
class ChangePlan:
    """What the diff touched, known before the checks run (so calls can be counted)."""

    top: str
    commit: str
    ref: str
    functions: list[ChangedFunction]
    #: absolute path of each changed module
    paths: dict[str, str]

    def call_targets(self) -> dict[str, dict[int, str]]:
        """``{absolute file: {co_firstlineno: name}}`` for :class:`kvref.reach_collect.CallCounter`."""
        out: dict[str, dict[int, str]] = {}
        for f in self.functions:
            if f.name:
                out.setdefault(self.paths[f.module], {})[f.first_line] = f.name
        return out


def plan_changes(ref: str, root: str, by_rel: dict[str, str]) -> ChangePlan:
    """The changed functions of the listed modules (``by_rel``: ``vllm/...`` -> absolute path)."""
    top, commit = checkout_of(root, ref)
    # git names files as they sit in the work tree (a symlinked file by its link, not its target)
    rel_to_top = {os.path.relpath(os.path.join(root, rel), os.path.realpath(top)).replace(os.sep, "/"): rel
                  for rel in by_rel}
    diff = changed_lines(top, commit, sorted(rel_to_top))
    functions: list[ChangedFunction] = []
    paths: dict[str, str] = {}
    for path_in_top, lines in sorted(diff.items()):
        rel = rel_to_top.get(path_in_top)
        if rel is None:
            continue
        paths[rel] = by_rel[rel]
        with open(os.path.join(root, rel), encoding="utf-8") as fh:
            source = fh.read()
        try:
            by_function = map_to_functions(source, lines)
        except SyntaxError as exc:
            raise InvalidFieldError(FLAG, ref, f"changed files that parse ({rel} line {exc.lineno}: "
                                    f"{exc.msg})") from None
        for (name, first), lns in by_function.items():
            functions.append(ChangedFunction(rel, name, first, lns))
    return ChangePlan(top, commit, ref, functions, paths)


def fill_results(plan: ChangePlan, modules, counter) -> list[ChangedFunction]:
    """What ran of each changed function: from the reach modules (:mod:`kvref.reach_report`) and
    the call counter."""
    by_rel = {m.module: m for m in modules}
    for cf in plan.functions:
        mod = by_rel.get(cf.module)
        if mod is None:
            continue
        if cf.name:
            regions = [f for f in mod.function(cf.name)]
            # a same-named second definition (a property setter): the one whose def is ours
            region = next((f for f in regions if f.line >= cf.first_line), regions[0] if regions else None)
            if region is None:
                continue
            cf.executed_lines = len(region.executed_lines)
            cf.statement_lines = len(region.statement_lines)
            cf.checks = list(region.checks)
            cf.excluded, cf.why = region.excluded, region.why
            cf.calls = counter.calls(plan.paths[cf.module], cf.name) if counter is not None else {}
        else:
            outside = mod.function("")
            region = outside[0] if outside else None
            if region is None:
                continue
            changed = set(cf.changed_lines)
            ran = [ln for ln in region.executed_lines if ln in changed]
            cf.executed_lines = len(ran)
            cf.statement_lines = len([ln for ln in region.statement_lines if ln in changed])
            cf.checks = list(region.checks) if ran else []
    return plan.functions


def summary(changed: list[ChangedFunction]) -> tuple[int, str]:
    """``(number not checked and not excluded, one line for the table)``."""
    missed = [c for c in changed if not c.checked and not c.excluded and (c.name or c.statement_lines)]
    checked = sum(c.checked for c in changed)
    text = (f"{len(changed)} changed function(s)/module-level part(s) of the KV-cache modules: {checked} executed "
            f"by the checks, {len(missed)} not")
    if missed:
        text += ": " + "; ".join(f"{c.module.removeprefix('vllm/')}:{c.name or '<module level>'} — {NOT_CHECKED}"
                                 for c in missed[:5]) + (" ..." if len(missed) > 5 else "")
    return len(missed), text


__all__ = ["NO_CHECK", "NOT_CHECKED", "ChangedFunction", "ChangePlan", "plan_changes", "fill_results", "summary",
           "checkout_of", "changed_lines", "map_to_functions"]
