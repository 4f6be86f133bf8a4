"""One streaming pass over a trace: replay on the reference + run properties; and reproducers."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from kvref.impl.run_trace.reader import TraceReader
from kvref.impl.run_trace.writer import TraceWriter

from .crash import Crash
from .properties import Finding, RunProperties
from .replay import Divergence, LockstepReplay
from .setup import RunSetup, setup_from_header


@dataclass
class CheckResult:
    """What ``kvref check-run`` found in one trace."""

    path: str
    header: dict
    setup: RunSetup
    divergence: Divergence | None
    findings: list[Finding]
    num_findings: int
    summary: dict
    records: int
    steps_compared: int
    #: the reference followed the whole trace (no divergence, nothing unmodelled)
    followed: bool
    stopped_because: str = ""
    stopped_at_line: int = 0
    truncated: bool = False
    truncation: str = ""
    notes: list[str] = field(default_factory=list)
    #: vLLM raised inside a recorded call (an ``error`` record), with the reference's answer
    crash: Crash | None = None
    #: the trace is still being written (``--live``): a missing end record is expected
    live: bool = False

    @property
    def empty(self) -> bool:
        """Nothing was checked: no ``schedule()`` step in the trace (issue #25: never "agrees")."""
        return self.summary.get("steps", 0) == 0

    @property
    def incomplete(self) -> bool:
        """The recording process never shut down (no end record) and the trace is not checked live."""
        return self.truncated and not self.live

    @property
    def ok(self) -> bool:
        """Nothing found and something checked: a crash, a truncated (killed) or an empty trace is
        never a pass (issue #28)."""
        return (self.divergence is None and self.num_findings == 0 and self.crash is None and not self.empty
                and not self.incomplete)

    @property
    def verdict(self) -> str:
        """The one verdict word of the report."""
        if self.crash is not None:
            return "CRASH"
        if self.divergence is not None or self.num_findings:
            return "FINDINGS"
        if self.empty:
            return "EMPTY"
        if self.incomplete:
            return "INCOMPLETE"
        if self.truncated:
            return "agrees so far" if self.followed else "properties hold so far"
        return "agrees" if self.followed else "properties hold"

    def to_json(self) -> dict:
        return {
            "trace": self.path, "ok": self.ok, "vllm_version": self.setup.vllm_version,
            "followed": self.followed, "steps_compared": self.steps_compared, "records": self.records,
            "stopped_because": self.stopped_because or None, "stopped_at_line": self.stopped_at_line or None,
            "divergence": self.divergence.to_json() if self.divergence else None,
            "findings": [f.to_json() for f in self.findings], "num_findings": self.num_findings,
            "summary": self.summary, "truncated": self.truncated, "truncation": self.truncation or None,
            "notes": self.notes, "crash": self.crash.to_json() if self.crash else None, "empty": self.empty,
            "verdict": self.verdict,
        }


def check_trace(path: str | os.PathLike, *, properties_only: bool = False, starvation_steps: int = 3,
                check_invariants_every: int = 0, live: bool = False) -> CheckResult:
    """Check one trace in a single streaming pass.

    Args:
        path: the trace.
        properties_only: do not replay on the reference (e.g. a vLLM too far from 0.33.0).
        starvation_steps: see :class:`~kvref.models.run_check.properties.RunProperties`.
        check_invariants_every: also assert the reference's and the checker's own invariants every
            N records (0: never; tests use 1).
        live: the trace is still being written: a missing ``end`` record is not a finding.

    Raises:
        TraceFormatError (a ``ValueError``): the trace cannot be read (not a trace, bad record).
    """
    from kvref.spec.version import MODELLED_VLLM_VERSION as VLLM_VERSION

    with TraceReader(path) as reader:
        header = reader.header
        setup = setup_from_header(header)
        if properties_only:
            setup.unmodelled = ["--properties-only"] + setup.unmodelled
        replay = LockstepReplay(setup)
        props = RunProperties(header, starvation_steps=starvation_steps)
        feed_replay, feed_props = replay.feed, props.feed
        n = 0
        for line, rec in reader.records():
            feed_props(line, rec)
            if replay.following or rec["t"] == "error":
                feed_replay(line, rec)
            n += 1
            if check_invariants_every and n % check_invariants_every == 0:
                replay.check_invariants()
                props.check_invariants()
        props.finish()
        notes = []
        if setup.vllm_version.split("+")[0] != VLLM_VERSION:
            notes.append(f"recorded with vLLM {setup.vllm_version}; kvref's reference models vLLM {VLLM_VERSION}: a "
                         "divergence may be an intended change in that version (--properties-only checks the "
                         "run properties alone)")
        if header.get("anonymized"):
            notes.append("token ids, request ids and cache salts are anonymized in this trace")
        return CheckResult(
            path=os.fspath(path), header=header, setup=setup, divergence=replay.divergence,
            findings=props.findings, num_findings=props.num_findings, summary=props.summary(),
            records=reader.num_records, steps_compared=replay.steps_compared,
            followed=replay.divergence is None and not replay.stopped_because,
            stopped_because=replay.stopped_because, stopped_at_line=replay.stopped_at_line,
            truncated=reader.truncated, truncation=reader.truncation, notes=notes, crash=replay.crash, live=live)


def write_reproducer(trace: str | os.PathLike, divergence: Divergence, out_path: str | os.PathLike) -> str:
    """Copy the trace up to and including the divergent record into ``out_path``.

    The copy is a trace of its own (same header, an ``end`` record), so ``kvref check-run
    out_path`` reproduces the divergence at the same step. Every record before the divergence
    is kept: block ids depend on the free-queue order, which every earlier allocation and free
    shaped. Records of steps scheduled after the divergent one are left out, so the copy is as
    short as the run allows. Streams: bounded memory whatever the trace's length.
    """
    out_path = os.fspath(out_path)
    with TraceReader(trace) as reader:
        writer = TraceWriter(out_path, reader.header, background=False)
        steps = 0
        try:
            for line, rec in reader.records():
                if line > divergence.line:
                    break
                if rec["t"] == "end":
                    continue
                writer.write(rec)
                steps += rec["t"] == "sched"
        finally:
            writer.close({"t": "end", "steps": steps, "records": writer.num_records + 1, "how": "reproducer"})
    return out_path
