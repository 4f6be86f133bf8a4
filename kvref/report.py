"""Results of checks and how they are shown: a rich table, JSON, JUnit XML.

Every check of ``kvref verify`` returns a :class:`CheckResult`; the CLI renders the list as a table
for people, ``--json`` for machines and ``--junit-xml`` for CI systems.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from typing import Iterable

PASSED = "passed"
FAILED = "failed"
UNKNOWN = "unknown"
SKIPPED = "skipped"
ERROR = "error"

#: statuses that make ``kvref verify`` exit non-zero
FAILING = (FAILED, ERROR)


@dataclass
class CheckResult:
    """What one check found.

    Args:
        name: short id (``proofs``, ``explorer``…).
        status: passed / failed / unknown / skipped / error.
        summary: one line for the table.
        seconds: wall time.
        details: extra lines (per theorem, per mutant, …).
        artifacts: files written (counterexamples, reproducers).
    """

    name: str
    status: str
    summary: str
    seconds: float = 0.0
    details: list[str] = field(default_factory=list)
    artifacts: list[str] = field(default_factory=list)

    @property
    def failing(self) -> bool:
        return self.status in FAILING


_STYLE = {PASSED: "green", FAILED: "bold red", ERROR: "bold red", UNKNOWN: "yellow", SKIPPED: "dim"}


def render_table(results: Iterable[CheckResult], title: str = "kvref verify") -> "object":
    """A rich Table of the results (import of rich kept local: the spec layer never needs it)."""
    from rich.table import Table

    table = Table(title=title, show_lines=False)
    table.add_column("check", style="bold")
    table.add_column("result")
    table.add_column("time", justify="right")
    table.add_column("summary", overflow="fold")
    for r in results:
        table.add_row(r.name, f"[{_STYLE.get(r.status, '')}]{r.status}[/]", f"{r.seconds:.1f}s", r.summary)
    return table


def to_json(results: Iterable[CheckResult]) -> str:
    results = list(results)
    return json.dumps({
        "ok": not any(r.failing for r in results),
        "checks": [asdict(r) for r in results],
    }, indent=2)


def write_junit_xml(results: Iterable[CheckResult], path: str) -> None:
    """JUnit XML: one testcase per check; failed/error → <failure>, skipped/unknown → <skipped>."""
    results = list(results)
    suite = ET.Element("testsuite", name="kvref-verify", tests=str(len(results)),
                       failures=str(sum(r.status == FAILED for r in results)),
                       errors=str(sum(r.status == ERROR for r in results)),
                       skipped=str(sum(r.status in (SKIPPED, UNKNOWN) for r in results)),
                       time=f"{sum(r.seconds for r in results):.3f}")
    for r in results:
        case = ET.SubElement(suite, "testcase", classname="kvref.verify", name=r.name, time=f"{r.seconds:.3f}")
        body = "\n".join([r.summary, *r.details, *(f"artifact: {a}" for a in r.artifacts)])
        if r.status == FAILED:
            ET.SubElement(case, "failure", message=r.summary).text = body
        elif r.status == ERROR:
            ET.SubElement(case, "error", message=r.summary).text = body
        elif r.status in (SKIPPED, UNKNOWN):
            ET.SubElement(case, "skipped", message=f"{r.status}: {r.summary}")
        else:
            ET.SubElement(case, "system-out").text = body
    ET.ElementTree(suite).write(path, encoding="utf-8", xml_declaration=True)
