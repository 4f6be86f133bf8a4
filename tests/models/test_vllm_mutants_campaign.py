"""The vLLM source-fault campaign end to end: faults applied to an overlay of the installed vLLM,
each checked by ``kvref verify --against vllm`` in a subprocess.

* CI (``ci`` profile, ~3 minutes on 2 cores): the CI subset — bug faults each killed by a
  different check, two neutral refactors that must pass every vLLM-facing check.
* nightly: the whole catalogue at verify's ``ci`` profile; no neutral refactor flagged and the
  recall of the bug faults at least what was measured (53/60; the goal of issue #13 is 95 %).

Skipped under the ``fast`` profile (local ``make test``): run
``KVREF_HYPOTHESIS_PROFILE=ci pytest tests/models/test_vllm_mutants_campaign.py`` or
``kvref mutants --target vllm`` instead.
"""

from __future__ import annotations

import os

import pytest

from kvref.models.mutants.vllm_source.catalogue import CI_SUBSET, FAULTS, by_id
from kvref.models.mutants.vllm_source.overlay import NEUTRAL
from kvref.vllm_campaign import KILLED, RECALL_GOAL, SURVIVED, run_campaign
from tests.vllm_env import require_vllm

#: bug-fault recall measured at verify's ci profile, seed 0 (53 of 60; BENCHMARKS.md)
MEASURED_CI_RECALL = 53 / 60

PROFILE = os.environ.get("KVREF_HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") == "true" else "fast")


@pytest.fixture(scope="module")
def vllm():
    return require_vllm()


def _explain(res) -> str:
    return "\n" + res.render()


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(PROFILE not in ("ci", "nightly"), reason="~3 min: runs under the ci and nightly profiles")
def test_ci_subset_kills_the_bugs_and_passes_the_refactors(vllm):
    faults = [by_id()[i] for i in CI_SUBSET]
    res = run_campaign(faults, profile="fast", seed=0, baseline=False)
    for r in res.results:
        assert r.live, f"{r.fault.id}: the edit was not live in the verify subprocess ({r.detail}){_explain(res)}"
        if r.fault.kind == NEUTRAL:
            assert r.outcome == SURVIVED, f"neutral {r.fault.id} flagged or errored: {r.outcome}{_explain(res)}"
            assert set(r.checks) == set(res.checks), "a neutral ran through every vLLM-facing check"
        else:
            assert r.outcome == KILLED, f"{r.fault.id}: {r.outcome}{_explain(res)}"
    killers = {r.killed_by for r in res.results if r.outcome == KILLED}
    assert len(killers) >= 2, f"the subset exercises more than one check: {killers}"


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(PROFILE != "nightly", reason="the whole vLLM campaign (~1-2 h) runs nightly")
def test_whole_vllm_campaign_holds_its_measured_recall(vllm):
    """The goal is RECALL_GOAL (95 %); measured at ``ci``: 53/60 (docs/vllm_mutants.md lists the 7
    survivors and the generator gaps they sit in). This floor stops a regression; raise it as the
    gaps close, up to the goal."""
    res = run_campaign(FAULTS, profile="ci", seed=0)
    assert not res.dropped_checks, f"checks failing on the clean vLLM: {res.dropped_checks}"
    assert not res.false_positives, f"neutral refactors flagged: {[r.fault.id for r in res.false_positives]}"
    assert res.bug_recall >= MEASURED_CI_RECALL, _explain(res)
    if res.bug_recall < RECALL_GOAL:
        print(f"vLLM campaign recall {res.bug_recall:.1%} is below the {RECALL_GOAL:.0%} goal:" + _explain(res))
