"""A recorded call that raised inside vLLM, and what the reference does at the same point.

Issue #28: when vLLM's ``schedule()`` raised (``ValueError: Cannot get N free blocks``, an
assertion inside the scheduler), the engine's ``finally`` still called ``shutdown()`` and the trace
ended in a normal ``end`` record, so ``kvref check-run`` said "agrees". The recorder now writes an
``error`` record (the call, the step, the exception, the call's inputs) before the exception
propagates; the replay makes the same call on the reference at that point and says whether the
reference raises too or what it would have done instead. Either way a crash is a finding.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Crash:
    """vLLM raised inside a recorded call."""

    line: int
    step: int
    call: str  # "schedule", "update_from_output", "add_request", "finish_requests"
    type: str
    message: str
    #: what the reference did with the same call at the same point, in words
    reference: str = "not replayed"
    #: the reference's rows ``[id, kind, tokens, computed, block ids]`` when it scheduled instead
    reference_rows: list = field(default_factory=list)
    #: whether the reference raised too
    reference_raised: bool = False

    def text(self) -> str:
        head = (f"CRASH: vLLM raised {self.type} in {self.call} of step {self.step} (trace line {self.line}): "
                f"{self.message}")
        lines = [head, f"  reference at that point: {self.reference}"]
        for r in self.reference_rows:
            lines.append(f"    {r[0]}  {({'n': 'new', 'r': 'resumed', 'c': 'running'}).get(r[1], r[1])}  "
                         f"tokens {r[2]}  computed {r[3]}  blocks {r[4] if r[4] is not None else '-'}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"line": self.line, "step": self.step, "call": self.call, "type": self.type, "message": self.message,
                "reference": self.reference, "reference_rows": self.reference_rows,
                "reference_raised": self.reference_raised}
