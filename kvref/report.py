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
#: a failure the user's baseline file accepts (a deliberate behaviour change): not failing
ACCEPTED = "accepted"

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
        signature: the finding without ids (operation and what differed), for baselines.
    """

    name: str
    status: str
    summary: str
    seconds: float = 0.0
    details: list[str] = field(default_factory=list)
    artifacts: list[str] = field(default_factory=list)
    signature: str | None = None
    #: differences met and accepted (baseline) while the check searched on past them
    met_signatures: list[str] = field(default_factory=list)
    #: how many cases (examples, traces, ops, states, transitions) the check examined, where it
    #: counts them; 0 is never "passed" (:func:`kvref.verify.run_check`, issue #25)
    examined: int | None = None

    @property
    def failing(self) -> bool:
        return self.status in FAILING


_STYLE = {PASSED: "green", FAILED: "bold red", ERROR: "bold red", UNKNOWN: "yellow", SKIPPED: "dim",
          ACCEPTED: "yellow"}


def render_table(results: Iterable[CheckResult], title: str = "kvref verify", caption: str | None = None) -> "object":
    """A rich Table of the results (import of rich kept local: the spec layer never needs it).

    ``caption`` names what was checked (the vLLM version, path and commit) under the table.
    """
    from rich.table import Table

    table = Table(title=title, show_lines=False, caption=caption, caption_justify="left")
    table.add_column("check", style="bold")
    table.add_column("result")
    table.add_column("time", justify="right")
    table.add_column("summary", overflow="fold")
    for r in results:
        table.add_row(r.name, f"[{_STYLE.get(r.status, '')}]{r.status}[/]", f"{r.seconds:.1f}s", r.summary)
    return table


def nothing_checked(results: Iterable[CheckResult]) -> bool:
    """Every check was skipped (no vLLM for a vLLM-only selection, say): the run examined nothing,
    so it is not "ok" and ``kvref verify`` exits 3 (issue #25). A run of no check at all is refused
    before it starts (``--only``/``--skip`` leaving none)."""
    return all(r.status == SKIPPED for r in results)


def to_json(results: Iterable[CheckResult], meta: dict | None = None) -> str:
    """``{"ok", "interrupted", "checks", ...meta}``; ``meta`` carries what was checked (``"vllm"``:
    version, path, commit) and, for a run stopped by Ctrl-C, ``"interrupted": true`` and
    ``"not_run"``: such a partial report is never ``"ok"``, whatever the checks that ran say."""
    results = list(results)
    interrupted = bool((meta or {}).get("interrupted"))
    return json.dumps({
        "ok": not interrupted and not any(r.failing for r in results) and not nothing_checked(results),
        "interrupted": interrupted,
        "nothing_checked": nothing_checked(results),
        **(meta or {}),
        "checks": [asdict(r) for r in results],
    }, indent=2)


def junit_properties(meta: dict | None) -> list[tuple[str, str]]:
    """Flatten ``meta`` into JUnit ``<property>`` pairs (``vllm.version``, ``vllm.git_commit``…)."""
    out: list[tuple[str, str]] = []
    for key, value in (meta or {}).items():
        if isinstance(value, dict):
            out += [(f"{key}.{k}", str(v)) for k, v in value.items() if v is not None]
        elif value is not None:
            out.append((key, str(value)))
    return out


def write_junit_xml(results: Iterable[CheckResult], path: str, meta: dict | None = None) -> None:
    """JUnit XML: one testcase per check; failed/error → <failure>, skipped/unknown → <skipped>;
    ``meta`` (what was checked) as suite ``<properties>``."""
    results = list(results)
    suite = ET.Element("testsuite", name="kvref-verify", tests=str(len(results)),
                       failures=str(sum(r.status == FAILED for r in results)),
                       errors=str(sum(r.status == ERROR for r in results)),
                       skipped=str(sum(r.status in (SKIPPED, UNKNOWN, ACCEPTED) for r in results)),
                       time=f"{sum(r.seconds for r in results):.3f}")
    props = junit_properties(meta)
    if props:
        node = ET.SubElement(suite, "properties")
        for name, value in props:
            ET.SubElement(node, "property", name=name, value=value)
    not_run = list((meta or {}).get("not_run") or ())
    if not_run:  # an interrupted run: the checks it never reached are listed as skipped
        suite.set("tests", str(len(results) + len(not_run)))
        suite.set("skipped", str(int(suite.get("skipped", "0")) + len(not_run)))
    for r in results:
        case = ET.SubElement(suite, "testcase", classname="kvref.verify", name=r.name, time=f"{r.seconds:.3f}")
        body = "\n".join([r.summary, *r.details, *(f"artifact: {a}" for a in r.artifacts)])
        if r.status == FAILED:
            ET.SubElement(case, "failure", message=r.summary).text = body
        elif r.status == ERROR:
            ET.SubElement(case, "error", message=r.summary).text = body
        elif r.status in (SKIPPED, UNKNOWN, ACCEPTED):
            ET.SubElement(case, "skipped", message=f"{r.status}: {r.summary}")
        else:
            ET.SubElement(case, "system-out").text = body
    for name in not_run:
        case = ET.SubElement(suite, "testcase", classname="kvref.verify", name=name, time="0.000")
        ET.SubElement(case, "skipped", message="not run: the run was interrupted (Ctrl-C)")
    ET.ElementTree(suite).write(path, encoding="utf-8", xml_declaration=True)
