"""Baseline files: the differences a vLLM developer changed on purpose, so CI shows only new ones.

A vLLM developer who changes behaviour deliberately (a new eviction order, a different admission
rule) sees kvref report it as a finding — correctly, kvref models 0.33.0. They record it once::

    kvref verify --against vllm --update-baseline kvref-baseline.json   # writes today's findings
    $EDITOR kvref-baseline.json                                           # say why, per entry
    kvref verify --against vllm --baseline kvref-baseline.json            # CI: only new findings fail

and commit the file beside their change. An accepted finding is matched by its *signature* — the
check, the operation and what differed, without ids (:func:`kvref.models.conformance.accepted.signature`) — so
it stays accepted on every trace that shows it. While a check runs, its accepted signatures are
handed to the generated-trace machines, which discard a trace that meets one and keep searching
(:mod:`kvref.models.conformance.accepted`): a *new* difference behind an accepted one still fails the run.
Checks that stop at their first difference report an accepted one as ``accepted`` and say that
nothing behind it was searched.

File format (JSON, versioned)::

    {"kvref_baseline": 1,
     "accepted": [{"check": "conform-kv-manager", "signature": "allocate: block_ids differs",
                   "reason": "PR 1234: LIFO reuse of freed blocks", "recorded_with": "vLLM 0.33.1.dev3+g…"}]}
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from kvref.spec.errors import InvalidFieldError

from .report import FAILED, CheckResult

BASELINE_FORMAT = 1


class BaselineError(InvalidFieldError):
    """A baseline file that cannot be used: names the file, the position and what was expected."""


@dataclass(frozen=True)
class AcceptedFinding:
    check: str
    signature: str
    reason: str = ""
    recorded_with: str = ""


def finding_signature(result: CheckResult) -> str:
    """The signature of a failed check's finding: the one the check set, else its summary's."""
    from kvref.models.conformance.accepted import signature

    return result.signature or signature(result.summary)


@dataclass
class Baseline:
    entries: list[AcceptedFinding] = field(default_factory=list)

    def signatures_for(self, check: str) -> frozenset[str]:
        return frozenset(e.signature for e in self.entries if e.check == check)

    def accepts(self, result: CheckResult) -> AcceptedFinding | None:
        """The entry accepting ``result``'s finding (a failed check only), or None."""
        if result.status != FAILED:
            return None
        sig = finding_signature(result)
        return next((e for e in self.entries if e.check == result.name and e.signature == sig), None)

    @classmethod
    def load(cls, path: str) -> "Baseline":
        """Read a baseline file; every problem is a :class:`BaselineError` naming file and position."""
        from kvref.cli.input import read_json

        try:  # not UTF-8, an int of 5,000 digits, nesting 10,000 deep: named, never a traceback
            data = read_json("--baseline", path, "baseline file")
        except InvalidFieldError as exc:
            raise BaselineError(exc.field, exc.value, exc.allowed) from None
        if not isinstance(data, dict) or data.get("kvref_baseline") != BASELINE_FORMAT:
            got = data.get("kvref_baseline") if isinstance(data, dict) else type(data).__name__
            raise BaselineError(f"{path}: kvref_baseline", got, f"{BASELINE_FORMAT} (a file written by --update-baseline)")
        accepted = data.get("accepted", [])
        if not isinstance(accepted, list):
            raise BaselineError(f"{path}: accepted", accepted, "a list of {check, signature, reason} objects")
        entries = []
        for i, item in enumerate(accepted):
            where = f"{path}: accepted[{i}]"
            if not isinstance(item, dict):
                raise BaselineError(where, item, "an object with 'check' and 'signature'")
            unknown = set(item) - set(AcceptedFinding.__dataclass_fields__)
            if unknown:
                raise BaselineError(f"{where}.{sorted(unknown)[0]}", item[sorted(unknown)[0]],
                                    "only check, signature, reason, recorded_with")
            for key in ("check", "signature"):
                if not isinstance(item.get(key), str) or not item[key]:
                    raise BaselineError(f"{where}.{key}", item.get(key), "a non-empty string")
            for key in ("reason", "recorded_with"):
                if not isinstance(item.get(key, ""), str):
                    raise BaselineError(f"{where}.{key}", item[key], "a string")
            entries.append(AcceptedFinding(**item))
        return cls(entries)

    def with_findings(self, results: list[CheckResult], recorded_with: str) -> "Baseline":
        """This baseline plus every finding of ``results`` not yet in it (reasons kept): the failed
        checks' findings and every difference a check met and searched past (record mode)."""
        entries = list(self.entries)
        have = {(e.check, e.signature) for e in entries}
        for r in results:
            keys = [(r.name, s) for s in r.met_signatures]
            if r.status == FAILED:
                keys.append((r.name, finding_signature(r)))
            for key in keys:
                if key not in have:
                    have.add(key)
                    entries.append(AcceptedFinding(*key, reason="TODO: say why this change is intended",
                                                   recorded_with=recorded_with))
        return Baseline(entries)

    def save(self, path: str) -> None:
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump({"kvref_baseline": BASELINE_FORMAT, "accepted": [asdict(e) for e in self.entries]}, fh,
                      indent=2)
            fh.write("\n")
        os.replace(tmp, path)
