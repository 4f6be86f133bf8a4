"""check-run replays runs with structured output (issue #28, format 7).

A version-6 recorder named ``structured_output`` on the arrival and check-run stopped following
there. The recorder now writes ``add.so`` and, on each record, the answers vLLM's scheduler got from
the requests' grammars during the call (``gr``: grammar still compiling / ready / failed in the
waiting loop, the drafts ``validate_tokens`` kept, whether ``accept_tokens`` took the sampled
tokens; impl/vllm/record_grammar.py); the replay hands the reference those answers in order
(models/run_check/grammar.py). Generated runs of the conform-scheduler structured-output machine,
recorded from vLLM's scheduler with its grammars scripted, agree step by step and hold every
property; on a vLLM that keeps a request whose sampled tokens the grammar rejected, the same draws
diverge where the reference finishes it as an error.
"""

from __future__ import annotations

from collections import Counter

import pytest

from kvref.models.run_check.feature_runs import record_feature_runs
from tests.record.traces import flagged_runs, followed_runs, read_lines
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

SEED, EXAMPLES, STEPS = 0, 16, 30


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    require_vllm()
    from tests.vllm_faults import planted_vllm_fault

    d = tmp_path_factory.mktemp("structured-output")
    pristine = record_feature_runs(d / "pristine", "structured-output", EXAMPLES, seed=SEED, steps=STEPS)
    with planted_vllm_fault("sched.grammar_rejection_ignored", ("v1/core/sched/scheduler.py",)):
        faulty = record_feature_runs(d / "faulty", "structured-output", EXAMPLES, seed=SEED, steps=STEPS,
                                     strict=False)
    return pristine, faulty


def test_structured_output_runs_are_replayed_step_by_step(recorded):
    pristine, _ = recorded

    def header_check(header):
        assert header["version"] == 7 and header["unmodelled"] == [], header["unmodelled"]

    followed = followed_runs(pristine, header_check)
    assert len(followed) >= 8, len(followed)
    answers: Counter = Counter()
    for run in followed:
        for rec in read_lines(run.path)[1:]:
            assert "x" not in rec or "structured_output" not in rec["x"], rec
            answers["so_arrivals"] += rec.get("t") == "add" and rec.get("so") is True
            for kind, _, answer in rec.get("gr") or ():
                answers[f"{kind}:{answer}"] += 1
    # the replays followed requests waiting for their grammar, drafts cut and tokens rejected
    assert answers["so_arrivals"] and answers["g:pending"] and answers["g:ready"], answers
    assert answers["v:0"] and answers["x:False"], answers


def test_a_vllm_that_keeps_rejected_tokens_is_flagged(recorded):
    _, faulty = recorded

    def finishes_differ(d):
        assert d.call == "update_from_output" and "finishes differ" in d.message, d.table()

    flagged, _ = flagged_runs(faulty, on_divergence=finishes_differ)
    assert flagged >= 1, [r.path for r in faulty]


def test_anonymized_runs_with_drafts_are_replayed_too(tmp_path, monkeypatch):
    """The same draws recorded with ``KVREF_RECORD_ANONYMIZE=1``: the drafts of ``drafts`` records
    and of the ``sched`` records' ``spec`` are renamed alike (-1 slots kept), and a request that
    finished while a step naming it was still in flight keeps its anonymous id in that step's update.
    Before, both made anonymized runs with speculative decoding diverge (27 of 34 hash-lookahead runs)."""
    require_vllm()
    monkeypatch.setenv("KVREF_RECORD_ANONYMIZE", "1")
    runs = record_feature_runs(tmp_path, "structured-output", 10, seed=1, steps=40)

    def header_check(header):
        assert header["anonymized"] is True

    assert len(followed_runs(runs, header_check)) >= 8
