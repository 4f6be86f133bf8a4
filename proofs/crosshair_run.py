"""Run CrossHair over the contracts in a fixed budget and report every condition.

``python -m crosshair check --report_all`` prints one line per postcondition: "Confirmed over all
paths." (exhaustive), "Not confirmed." (explored within the budget, no counterexample, not
exhaustive) or an error with the failing call. A condition with no line at all was not analysed
(CrossHair could not run it) and is reported as ``not analysed`` — never silently dropped.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field

CONFIRMED = "confirmed"          # all paths explored
NOT_REFUTED = "not refuted"      # budget spent, no counterexample
REFUTED = "refuted"              # counterexample found
NOT_ANALYSED = "not analysed"    # no report from CrossHair

_LINE = re.compile(r"^(?P<file>.+?):(?P<line>\d+): (?P<level>info|error|warning): (?P<msg>.*)$")


@dataclass
class ConditionResult:
    function: str
    condition: str
    line: int
    status: str
    message: str = ""


@dataclass
class CrossHairReport:
    target: str
    seconds: float
    conditions: list[ConditionResult] = field(default_factory=list)
    stderr: str = ""

    @property
    def refuted(self) -> list[ConditionResult]:
        return [c for c in self.conditions if c.status == REFUTED]

    @property
    def ok(self) -> bool:
        return not self.refuted and not any(c.status == NOT_ANALYSED for c in self.conditions)


def _conditions(path: str) -> list[tuple[str, int, str]]:
    """``(function, line, text)`` of every ``post:`` line in the module's docstrings."""
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and ast.get_docstring(node):
            doc = node.body[0]
            first = doc.lineno
            raw = doc.value.value  # type: ignore[attr-defined]
            for i, text in enumerate(raw.splitlines()):
                if text.strip().startswith("post:"):
                    out.append((node.name, first + i, text.strip()[5:].strip()))
    return out


def run_crosshair(path: str | None = None, per_condition_timeout: float = 2.0, per_path_timeout: float = 1.0,
                  timeout: float = 240.0) -> CrossHairReport:
    """Check the contracts in ``path`` (default: :mod:`kvref.proofs.contracts`)."""
    if path is None:
        from . import contracts

        path = contracts.__file__
    path = os.path.abspath(path)
    cmd = [sys.executable, "-m", "crosshair", "check", "--report_all",
           f"--per_condition_timeout={per_condition_timeout}", f"--per_path_timeout={per_path_timeout}", path]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    seconds = time.perf_counter() - start
    by_line: dict[int, tuple[str, str]] = {}
    errors: list[tuple[int, str]] = []
    for raw in proc.stdout.splitlines():
        m = _LINE.match(raw.strip())
        if not m or os.path.abspath(m["file"]) != path:
            continue
        line, msg = int(m["line"]), m["msg"]
        if m["level"] == "error":
            errors.append((line, msg))
            by_line[line] = (REFUTED, msg)
        elif msg.startswith("Confirmed"):
            by_line.setdefault(line, (CONFIRMED, msg))
        elif msg.startswith("Not confirmed"):
            by_line.setdefault(line, (NOT_REFUTED, msg))
    report = CrossHairReport(target=path, seconds=seconds, stderr=proc.stderr[-2000:])
    known = set()
    for func, line, text in _conditions(path):
        status, msg = by_line.get(line, (NOT_ANALYSED, "no report from CrossHair"))
        report.conditions.append(ConditionResult(func, text, line, status, msg))
        known.add(line)
    # An error on a line that is not a postcondition (e.g. an exception in the body) still counts.
    for line, msg in errors:
        if line not in known:
            report.conditions.append(ConditionResult("?", "(function body)", line, REFUTED, msg))
    return report
