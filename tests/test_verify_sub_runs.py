"""kvref.verify's sub-run tables (conform-scheduler, conform-spec-decode): every row names a runner
that exists, and ``_then`` runs the rows in order, stops at the first divergence with its trace and
signature, and on passes extends the summary and the examined count (#26)."""

from __future__ import annotations

import importlib
from collections import Counter
from types import SimpleNamespace

import pytest

from kvref.check_context import VerifyContext
from kvref.report import FAILED, PASSED, CheckResult
from kvref.verify import SCHEDULER_RUNS, SPEC_DECODE_RUNS, SubRun, _then

#: what the fake runners below were called with, in order
CALLS: list[tuple[str, int, bool, int]] = []


def passing_runner(examples: int, shrink: bool, seed: int):
    CALLS.append(("pass", examples, shrink, seed))
    return SimpleNamespace(ok=True, traces=3, coverage=Counter(hits=5))


def failing_runner(examples: int, shrink: bool, seed: int):
    CALLS.append(("fail", examples, shrink, seed))
    return SimpleNamespace(ok=False, failure="op 7 diverged\nline two", signature="sig-x", traces=1, coverage={})


_PASS = SubRun(f"{__name__}:passing_runner", (2, 9), "the passing run", "; {traces} passing ({hits} hits, {absent} absent)")
_FAIL = SubRun(f"{__name__}:failing_runner", (4, 8), "the failing run", "; never shown")


@pytest.mark.parametrize("row", SCHEDULER_RUNS + SPEC_DECODE_RUNS, ids=lambda row: row.runner.split(":")[1])
def test_every_row_names_a_runner(row):
    module, func = row.runner.split(":")
    assert callable(getattr(importlib.import_module(module), func))
    assert row.examples[0] <= row.examples[1]
    assert "{traces}" in row.summary


def test_passes_extend_the_summary_and_the_count_in_order():
    CALLS.clear()
    res = _then(VerifyContext(profile="ci", seed=3, shrink=False), "conform-x",
                CheckResult("conform-x", PASSED, "main", examined=10), (_PASS, _PASS))
    assert res.status == PASSED
    assert res.summary == "main; 3 passing (5 hits, 0 absent); 3 passing (5 hits, 0 absent)"
    assert res.examined == 16
    assert CALLS == [("pass", 9, False, 3), ("pass", 9, False, 3)]


def test_the_first_divergence_fails_the_check_and_stops():
    CALLS.clear()
    res = _then(VerifyContext(profile="fast"), "conform-x", CheckResult("conform-x", PASSED, "main", examined=10),
                (_PASS, _FAIL, _PASS))
    assert res.status == FAILED and res.name == "conform-x"
    assert res.summary == "the failing run diverged from vLLM"
    assert res.details == ["op 7 diverged", "line two"] and res.signature == "sig-x"
    assert [c[0] for c in CALLS] == ["pass", "fail"]


def test_offload_sub_run_divergences_fail_conform_offload_with_their_own_signature(monkeypatch):
    """conform-offload's retention and EAGLE sub-runs (kvref.verify_offload_retention) turn an
    OffloadInvariantError into the check's failed row, naming where it diverged, with the error as
    the details and a signature per sub-run; no later sub-run runs after one failed."""
    from kvref import verify_offload_retention as vor
    from kvref.models.offload import offloading_eagle, offloading_retention
    from kvref.models.offload.world_common import OffloadInvariantError

    def diverge(*_args, **_kwargs):
        raise OffloadInvariantError("op 3: stores differ")

    def not_reached(*_args, **_kwargs):
        raise AssertionError("a sub-run after the failing one ran")

    monkeypatch.setattr(offloading_retention, "retention_refusal_cases", lambda rng, n: [])
    monkeypatch.setattr(offloading_retention, "compare_refusals", lambda cases: {"configs": 0, "refused": 0})
    monkeypatch.setattr(offloading_retention, "retention_cases", lambda seed, n: [])
    monkeypatch.setattr(offloading_retention, "run_retention_traces", diverge)
    monkeypatch.setattr(offloading_eagle, "run_eagle_traces", not_reached)
    passed = CheckResult("conform-offload", PASSED, "main", examined=10)
    res = vor.with_retention(VerifyContext(), passed)
    assert res.status == FAILED and res.name == "conform-offload"
    assert res.summary == ("vLLM's OffloadingConnector diverged from the reference under a prefix-cache "
                           "retention interval")
    assert res.details == ["op 3: stores differ"]
    assert res.signature == "conform-offload: OffloadingConnector retention interval"

    monkeypatch.setattr(offloading_eagle, "eagle_cases", lambda seed, n: [])
    monkeypatch.setattr(offloading_eagle, "run_eagle_traces", diverge)
    res = vor.with_eagle(VerifyContext(), passed)
    assert res.status == FAILED
    assert res.summary == "vLLM's OffloadingConnector diverged from the reference on a pool with an EAGLE drafter group"
    assert res.signature == "conform-offload: OffloadingConnector EAGLE group"
