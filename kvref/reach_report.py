"""The reach report: what of vLLM's KV-cache modules the checks executed, per module and function
(issue #22), with the reviewed exclusions applied and checked.

Counts are coverage.py's in branch mode: a module's or function's *units* are its statements plus
its branch destinations, *covered* those executed. Functions are coverage.py's code regions
(qualified names such as ``BlockPool.get_cached_block``; a nested function is its own region), and
a function counts as executed when any of its body lines ran. The figure::

    reach X % of N statements+branches (E % of T excluded: outside KV-cache management a %, ...)

is ``covered / N`` over the ``N`` units the exclusion file does not exclude; ``E`` is the excluded
share of all ``T`` units. An exclusion that names a module or function this vLLM does not have, or
a function that ran, is *stale*: it excludes nothing, and the report fails until it is fixed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from .reach_collect import NO_CHECK
from .reach_exclusions import REASONS, Exclusion


@dataclass
class FunctionReach:
    """One function (or, with ``name == ""``, a module's code outside every function)."""

    name: str
    line: int
    statements: int
    branches: int
    covered_statements: int
    covered_branches: int
    #: the checks under which any of its lines ran
    checks: list[str] = field(default_factory=list)
    #: executed body lines, and every statement line (for the changed-since report)
    executed_lines: list[int] = field(default_factory=list)
    statement_lines: list[int] = field(default_factory=list)
    #: the exclusion's reason key, when excluded
    excluded: str | None = None
    why: str | None = None
    #: lines and branch arcs never executed (what an excluded block may take out of the count)
    missing_lines: list[int] = field(default_factory=list)
    missing_arcs: list[tuple[int, int]] = field(default_factory=list)
    #: units of excluded if/elif bodies inside the function, per reason key (``blocks`` entries)
    block_excluded: dict[str, int] = field(default_factory=dict)

    @property
    def units(self) -> int:
        return self.statements + self.branches

    @property
    def excluded_units(self) -> int:
        """What the exclusion file takes out of the count: all of it, or its excluded blocks."""
        return self.units if self.excluded else sum(self.block_excluded.values())

    @property
    def counted(self) -> int:
        return self.units - self.excluded_units

    @property
    def covered(self) -> int:
        return self.covered_statements + self.covered_branches

    @property
    def executed(self) -> bool:
        return self.covered_statements > 0

    def to_dict(self) -> dict:
        return {"name": self.name or "<module level>", "line": self.line, "statements": self.statements,
                "branches": self.branches, "covered_statements": self.covered_statements,
                "covered_branches": self.covered_branches, "percent": _pct(self.covered, self.counted),
                "executed": self.executed, "checks": self.checks, "excluded": self.excluded, "why": self.why,
                "excluded_block_units": sum(self.block_excluded.values())}


@dataclass
class ModuleReach:
    module: str
    path: str
    functions: list[FunctionReach]

    @property
    def units(self) -> int:
        return sum(f.units for f in self.functions)

    @property
    def covered(self) -> int:
        return sum(f.covered for f in self.functions)

    @property
    def excluded_units(self) -> int:
        return sum(f.excluded_units for f in self.functions)

    def function(self, name: str) -> list[FunctionReach]:
        return [f for f in self.functions if f.name == name]

    def to_dict(self) -> dict:
        counted = self.units - self.excluded_units
        real = [f for f in self.functions if f.name]
        return {"module": self.module, "units": self.units, "counted": counted, "covered": self.covered,
                "percent": _pct(self.covered, counted), "excluded_units": self.excluded_units,
                "functions_executed": sum(f.executed for f in real), "functions": len(real),
                "function_details": [f.to_dict() for f in self.functions]}


@dataclass(frozen=True)
class Stale:
    """An exclusion entry (one of its names) that excludes nothing: why."""

    module: str
    function: str
    problem: str

    def to_dict(self) -> dict:
        return {"module": self.module, "function": self.function, "problem": self.problem}


def _pct(part: int, whole: int) -> float:
    return round(100.0 * part / whole, 2) if whole else 100.0


def _base(name: str) -> str:
    """coverage.py names a second region of the same name ``name@line``."""
    return name.split("@", 1)[0] if "@" in name and name.rsplit("@", 1)[1].isdigit() else name


def _region(name: str, data: dict) -> FunctionReach:
    s = data["summary"]
    ctx = data.get("contexts") or {}
    checks = sorted({c or NO_CHECK for lines in ctx.values() for c in lines})
    executed = sorted(data.get("executed_lines", []))
    missing = sorted(data.get("missing_lines", []))
    return FunctionReach(_base(name), int(data.get("start_line", 1)), s["num_statements"], s.get("num_branches", 0),
                         s["covered_lines"], s.get("covered_branches", 0), checks, executed,
                         sorted(executed + missing), missing_lines=missing,
                         missing_arcs=[(int(a), int(b)) for a, b in data.get("missing_branches", [])])


def modules_from_json(report: dict, by_rel: dict[str, str]) -> list[ModuleReach]:
    """Per-module figures from coverage.py's JSON report (``show_contexts`` on), for the files of
    ``by_rel`` (relative name -> absolute path); a listed file coverage did not report (never
    imported, or no data at all) is read and counted as entirely missed."""
    files = {os.path.realpath(os.path.abspath(k)): v for k, v in report.get("files", {}).items()}
    out = []
    for rel, path in sorted(by_rel.items()):
        data = files.get(os.path.realpath(path))
        if data is None:
            out.append(ModuleReach(rel, path, _unmeasured(path)))
            continue
        funcs = [_region(name, d) for name, d in data.get("functions", {}).items() if name]
        funcs.sort(key=lambda f: f.line)
        outside = data.get("functions", {}).get("")
        if outside is not None:
            funcs.insert(0, _region("", outside))
        out.append(ModuleReach(rel, path, funcs))
    return out


def _unmeasured(path: str) -> list[FunctionReach]:
    """A file with no coverage data: its regions from coverage.py's parser, nothing executed."""
    from coverage.python import PythonFileReporter

    fr = PythonFileReporter(path)
    statements = fr.lines()
    arcs = fr.exit_counts()
    branch_arcs = [(a, b) for a, b in fr.arcs() if arcs.get(a, 0) > 1]
    regions = [r for r in fr.code_regions() if r.kind == "function"]
    inside: set[int] = set().union(*(r.lines for r in regions)) if regions else set()

    def make(name: str, line: int, lines: set[int]) -> FunctionReach:
        st = sorted(statements & lines)
        br = sum(n for ln, n in arcs.items() if ln in lines and n > 1)
        return FunctionReach(name, line, len(st), br, 0, 0, [], [], st, missing_lines=st,
                             missing_arcs=[(a, b) for a, b in branch_arcs if a in lines])

    out = [make("", 1, set(statements) - inside)]
    out += sorted((make(r.name, r.start, r.lines) for r in regions), key=lambda f: f.line)
    return out


def apply_exclusions(modules: list[ModuleReach], exclusions: tuple[Exclusion, ...]) -> list[Stale]:
    """Mark excluded functions; return the stale names (they exclude nothing)."""
    by_rel = {m.module: m for m in modules}
    stale: list[Stale] = []
    for e in exclusions:
        mod = by_rel.get(e.module)
        if mod is None:
            stale += [Stale(e.module, n, "no such module in the reach module list of this vLLM") for n in e.names()]
            continue
        if e.whole_module:
            ran = sorted({c for f in mod.functions if f.executed for c in f.checks})
            if ran:
                stale.append(Stale(e.module, "<whole module>", f"lines of it were executed (by {', '.join(ran)})"))
                continue
            for f in mod.functions:
                f.excluded, f.why = e.reason, e.why
            continue
        if e.blocks:
            stale += _exclude_blocks(mod, e)
            continue
        for name in e.functions:
            found = mod.function(name)
            if not found:
                stale.append(Stale(e.module, name, "no such function in this vLLM's module"))
            elif any(f.executed for f in found):
                ran = sorted({c for f in found for c in f.checks})
                stale.append(Stale(e.module, name, f"it was executed (by {', '.join(ran)}): not excludable"))
            else:
                for f in found:
                    f.excluded, f.why = e.reason, e.why
    return stale


def _if_headers(path: str) -> list[tuple[str, int, int, int]]:
    """Every if/elif statement of the file: (collapsed header text, header line, first and last
    line of its body). A header split over lines reads as one line (``if (a and b):``)."""
    import ast

    from .reach_exclusions import collapse

    with open(path, encoding="utf-8") as fh:
        src = fh.read()
    lines = src.splitlines()
    out = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.If):
            # the header: from the if/elif keyword to the end of its test, then the colon
            # (closing parentheses after the test, up to the colon, are part of the header)
            end, col = node.test.end_lineno, node.test.end_col_offset
            head = lines[node.lineno - 1:end]
            head[-1] = head[-1][:col]
            head[0] = head[0][node.col_offset:] if len(head) > 1 else head[0][node.col_offset:col]
            tail, ln = lines[end - 1][col:], end
            while ":" not in tail and ln < len(lines):
                tail, ln = tail + " " + lines[ln], ln + 1
            text = collapse(" ".join(head) + tail[:tail.find(":") + 1])
            last = max(getattr(n, "end_lineno", None) or n.lineno for n in node.body)
            out.append((text, node.lineno,
                        node.body[0].lineno, last))
    return out


def _exclude_blocks(mod: ModuleReach, e: Exclusion) -> list[Stale]:
    """Exclude the bodies of ``e.blocks``' if/elif headers in ``mod``: their never-executed
    statements and the branches that start in or enter them; a header matching nothing, or a
    body a check executed, is stale (it excludes nothing)."""
    try:
        headers = _if_headers(mod.path)
    except (OSError, SyntaxError, UnicodeDecodeError) as exc:
        return [Stale(e.module, f"block `{b}`", f"the module could not be parsed ({exc})") for b in e.blocks]
    stale = []
    for block in e.blocks:
        found = [(h, lo, hi) for text, h, lo, hi in headers if text == block]
        if not found:
            stale.append(Stale(e.module, f"block `{block}`", "no such if/elif header in this vLLM's module"))
            continue
        for h, lo, hi in found:
            owner = [f for f in mod.functions if h in f.statement_lines]
            ran = sorted({c for f in owner for c in f.checks})
            if any(lo <= ln <= hi for f in owner for ln in f.executed_lines):
                stale.append(Stale(e.module, f"block `{block}` (line {h})",
                                   f"its body was executed (by {', '.join(ran)}): not excludable"))
                continue
            for f in owner:
                units = sum(1 for ln in f.missing_lines if lo <= ln <= hi)
                units += sum(1 for a, b in f.missing_arcs if lo <= a <= hi or (a == h and lo <= b <= hi))
                if units:
                    f.block_excluded[e.reason] = f.block_excluded.get(e.reason, 0) + units
    return stale


def figure(modules: list[ModuleReach]) -> dict:
    """The headline numbers: counted/covered units, the excluded share per reason."""
    total = sum(m.units for m in modules)
    excluded = sum(m.excluded_units for m in modules)
    covered = sum(m.covered for m in modules)
    by_reason = {REASONS[r]: sum(f.units if f.excluded == r else f.block_excluded.get(r, 0)
                                 for m in modules for f in m.functions if not f.excluded or f.excluded == r)
                 for r in REASONS}
    counted = total - excluded
    return {"percent": _pct(covered, counted), "covered": covered, "counted": counted, "total": total,
            "excluded": excluded, "excluded_percent": _pct(excluded, total) if total else 0.0,
            "excluded_by_reason": {k: {"units": v, "percent": _pct(v, total) if total else 0.0}
                                   for k, v in by_reason.items()}}


def figure_line(fig: dict) -> str:
    """``reach X % of N statements+branches (E % of T excluded: ...)``."""
    parts = ", ".join(f"{k} {v['percent']:.1f} %" for k, v in fig["excluded_by_reason"].items())
    return (f"reach {fig['percent']:.1f} % of {fig['counted']:,} statements+branches "
            f"({fig['excluded_percent']:.1f} % of {fig['total']:,} excluded: {parts})")


def listing_markdown(modules: list[ModuleReach], fig: dict, stale: list[Stale]) -> str:
    """The per-function listing a developer opens (``functions.md``): per module, every function
    with its figure, the checks that ran it, and missed / partly / excluded marks."""
    lines = ["# kvref reach: vLLM KV-cache functions executed by the checks", "", figure_line(fig), ""]
    if stale:
        lines += ["## Stale exclusions (they exclude nothing)", ""]
        lines += [f"- `{s.module}` `{s.function}`: {s.problem}" for s in stale] + [""]
    gaps = sorted(((f.counted - f.covered, m.module, f) for m in modules for f in m.functions
                   if f.name and not f.excluded and f.covered < f.counted), key=lambda g: (-g[0], g[1], g[2].line))
    lines += ["## The largest gaps (units not executed, per function)", "",
              "| not executed | module | function | state |", "|---|---|---|---|"]
    lines += [f"| {n} | {mod} | `{f.name}` | {'MISSED' if not f.executed else 'partly'} |" for n, mod, f in gaps[:40]]
    lines.append("")
    for m in modules:
        counted = m.units - m.excluded_units
        lines += [f"## {m.module} — {_pct(m.covered, counted):.1f} % of {counted} units", "",
                  "| function | line | covered | state | checks |", "|---|---|---|---|---|"]
        for f in m.functions:
            state = (f"excluded ({REASONS[f.excluded]}): {f.why}" if f.excluded else
                     "MISSED" if not f.executed else "partly" if f.covered < f.counted else "executed")
            if f.block_excluded and not f.excluded:
                state += "; blocks excluded: " + ", ".join(f"{n} ({REASONS[r]})" for r, n in f.block_excluded.items())
            lines.append(f"| `{f.name or '<module level>'}` | {f.line} | {f.covered}/{f.units if f.excluded else f.counted} | {state} | "
                         f"{', '.join(f.checks)} |")
        lines.append("")
    return "\n".join(lines)


def write_reports(cov, modules_files: tuple[str, ...], out_dir: str) -> dict:
    """coverage.py's JSON (with contexts) and HTML reports of the listed files into ``out_dir``;
    returns the JSON report (empty when nothing at all was measured)."""
    from coverage.exceptions import NoDataError

    os.makedirs(out_dir, exist_ok=True)
    raw = os.path.join(out_dir, "coverage.json")
    try:
        cov.json_report(morfs=list(modules_files), outfile=raw, show_contexts=True, ignore_errors=True)
        cov.html_report(morfs=list(modules_files), directory=os.path.join(out_dir, "html"), show_contexts=True,
                        title="kvref reach: vLLM KV-cache code executed by the checks", ignore_errors=True)
    except NoDataError:
        return {}
    with open(raw, encoding="utf-8") as fh:
        return json.load(fh)


def render_modules_table(modules: list[ModuleReach], fig: dict):
    """A rich table, one row per module with code, the figure as its caption."""
    from rich.table import Table

    table = Table(title="reach: vLLM KV-cache modules executed by the checks", caption=figure_line(fig),
                  caption_justify="left")
    table.add_column("module (vllm/…)", overflow="fold")
    table.add_column("covered", justify="right")
    table.add_column("units", justify="right")
    table.add_column("functions run", justify="right")
    table.add_column("excluded", justify="right")
    for m in modules:
        if not m.units:  # an empty __init__.py: nothing to run
            continue
        d = m.to_dict()
        table.add_row(m.module.removeprefix("vllm/"), f"{d['percent']:.1f} %", str(d["counted"]),
                      f"{d['functions_executed']}/{d['functions']}",
                      f"{_pct(m.excluded_units, m.units):.0f} %" if m.excluded_units else "")
    return table
