"""The real-run path's detection, as a number: planted faults on the demo workloads (issue #28).

For every demo workload and scheduling mode, :func:`run_campaign` records a pristine run (which
must check clean: a finding there is a false alarm) and one run per planted fault
(:mod:`kvref.impl.vllm.demo_faults`), then checks each faulty trace twice: ``kvref check-run``
(lock-step replay on the reference plus the run properties) and ``--properties-only`` (the
properties alone, what a user on another vLLM version gets). A fault *manifests* in a run when
vLLM raised or the recorded run differs from the pristine one (same workload, same seed); a fault
that changed nothing cannot be caught and is counted apart. ``kvref demo campaign`` prints the
table; BENCHMARKS.md keeps the figures with the command.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class CampaignRow:
    workload: str
    async_scheduling: bool
    fault: str | None
    crashed: str | None
    manifested: bool
    replay_caught: bool
    properties_caught: bool
    replay_verdict: str
    properties_kinds: list = field(default_factory=list)

    def to_json(self) -> dict:
        return dict(self.__dict__)


def _digest(path: str) -> str:
    """The recorded run without its header (the header holds a pid and a timestamp)."""
    h = hashlib.sha256()
    with gzip.open(path, "rt", encoding="utf-8") as f:
        next(f)
        for line in f:
            h.update(line.encode())
    return h.hexdigest()


def run_campaign(workloads=None, faults=None, modes=(True, False), seed: int = 0, ticks: int = 200,
                 progress: Callable[[str], None] | None = None) -> list[CampaignRow]:
    """Record and check every (workload, mode, fault); returns one row per run (pristine rows: fault None)."""
    from kvref.demo import record_demo
    from kvref.impl.vllm.demo_faults import FAULTS
    from kvref.impl.vllm.scheduler import VllmEnv
    from kvref.models.run_check import check_trace
    from kvref.models.run_check.demo import WORKLOADS, workload as get_workload

    workloads = list(workloads or WORKLOADS)
    for w in workloads:
        get_workload(w)
    faults = list(faults or FAULTS)
    env = VllmEnv()
    rows: list[CampaignRow] = []
    with tempfile.TemporaryDirectory(prefix="kvref-campaign-") as d:
        for w in workloads:
            for mode in modes:
                base = os.path.join(d, f"{w}-{mode}-pristine.kvtrace.gz")
                run = record_demo(base, w, None, mode, seed=seed, ticks=ticks, env=env)
                r = check_trace(base)
                p = check_trace(base, properties_only=True)
                rows.append(CampaignRow(w, mode, None, run.crashed, False, not r.ok, not p.ok, r.verdict,
                                        sorted({f.kind for f in p.findings})))
                clean = _digest(base)
                for fault in faults:
                    path = os.path.join(d, f"{w}-{mode}-{fault}.kvtrace.gz")
                    run = record_demo(path, w, fault, mode, seed=seed, ticks=ticks, env=env)
                    r = check_trace(path)
                    p = check_trace(path, properties_only=True)
                    manifested = run.crashed is not None or _digest(path) != clean
                    rows.append(CampaignRow(w, mode, fault, run.crashed, manifested, not r.ok, not p.ok, r.verdict,
                                            sorted({f.kind for f in p.findings})))
                if progress is not None:
                    progress(f"{w} ({'async' if mode else 'sync'}): {len(rows)} runs recorded and checked")
    return rows


def summarize(rows: list[CampaignRow]) -> dict:
    """Per fault: runs, manifested, caught by replay, caught by the properties alone, crashes caught;
    and the false alarms on pristine runs."""
    out: dict = {"faults": {}, "pristine_runs": 0, "false_alarms_replay": 0, "false_alarms_properties": 0}
    for row in rows:
        if row.fault is None:
            out["pristine_runs"] += 1
            out["false_alarms_replay"] += row.replay_caught
            out["false_alarms_properties"] += row.properties_caught
            continue
        s = out["faults"].setdefault(row.fault, {"runs": 0, "manifested": 0, "replay": 0, "properties": 0,
                                                 "crashes": 0, "crashes_caught": 0, "properties_when_replay": 0})
        s["runs"] += 1
        if not row.manifested:
            continue
        s["manifested"] += 1
        s["replay"] += row.replay_caught
        s["properties"] += row.properties_caught
        s["properties_when_replay"] += row.replay_caught and row.properties_caught
        if row.crashed:
            s["crashes"] += 1
            s["crashes_caught"] += row.replay_caught and row.properties_caught
    total = {k: sum(s[k] for s in out["faults"].values())
             for k in ("runs", "manifested", "replay", "properties", "crashes", "crashes_caught",
                       "properties_when_replay")}
    out["total"] = total
    return out


def table(summary: dict) -> str:
    """The summary as a Markdown table (what BENCHMARKS.md keeps)."""
    lines = ["| fault | runs | manifested | check-run (replay) | --properties-only | crashes (caught) |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, s in list(summary["faults"].items()) + [("**all**", summary["total"])]:
        lines.append(f"| {name} | {s['runs']} | {s['manifested']} | {s['replay']} | {s['properties']} | "
                     f"{s['crashes']} ({s['crashes_caught']}) |")
    lines.append(f"\npristine runs: {summary['pristine_runs']}, false alarms: replay {summary['false_alarms_replay']}, "
                 f"properties {summary['false_alarms_properties']}")
    return "\n".join(lines)


def to_json(rows: list[CampaignRow]) -> str:
    return json.dumps({"summary": summarize(rows), "runs": [r.to_json() for r in rows]}, indent=1)


__all__ = ["CampaignRow", "run_campaign", "summarize", "table", "to_json"]
