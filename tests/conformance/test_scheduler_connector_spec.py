"""Speculative decoding beside a KV connector, compared with vLLM 0.33.0's ``Scheduler`` (#22, #28).

The reference refused the pair ("spec decoding with a connector is not modelled"), so neither
conform-connector nor check-run could watch it (a P/D deployment with MTP stopped check-run at line
1). vLLM's waiting loop pads an admission with one token left to ``1 + k`` after an external hit
too, holds the drafter's lookahead slots back while an async load runs, and admits an async load
only beside one speculative step's blocks (``_spec_decode_step_blocks``); a request's remaining
blocks count that step (``_request_remaining_blocks``). On a pool sized for ``max_model_len`` the
reservation can exceed what is free with nothing else running: vLLM waits for ever (the machine's
drain names it ``vllm_hang_spec_step_reservation``; docs/coverage.md, findings).
"""

from __future__ import annotations

import pytest

from kvref.impl.reference import scheduler_connector
from kvref.models.machines.scheduler_connector import connector_setups, run_connector_machine
from kvref.models.run_check import check_trace
from kvref.models.run_check.connector_runs import record_connector_runs
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


def test_generated_connector_traces_with_drafting_match_vllm():
    require_vllm()
    run = run_connector_machine(True, profile_examples(6, 20), seed=5, shrink=False, spec=True)
    assert run.ok, run.failure
    assert run.coverage.get("loads_started_async", 0) > 0 and run.coverage.get("promoted_load_scheduled", 0) > 0, \
        run.coverage


def test_the_speculative_step_reservation_hang_is_reached_and_named():
    """Seed 1 draws an EAGLE drafter (k=4) on a 4-block pool of 8-token blocks and a 28-token
    prompt whose whole prefix loads asynchronously: its 4 blocks fit, the 2 of the reserved
    speculative step do not, and both schedulers refuse it for ever."""
    require_vllm()
    run = run_connector_machine(True, 20, seed=1, shrink=False, spec=True)
    assert run.ok, run.failure
    assert run.coverage.get("vllm_hang_spec_step_reservation", 0) > 0, run.coverage


def test_a_reference_without_the_speculative_step_reservation_is_caught(monkeypatch):
    """The planted fault: the reference admits an async load without reserving the speculative
    step (vLLM's ``_spec_decode_step_blocks`` dropped): it admits the request vLLM keeps waiting."""
    require_vllm()
    monkeypatch.setattr(scheduler_connector, "spec_decode_step_blocks", lambda sched: 0)
    run = run_connector_machine(True, 20, seed=1, shrink=False, spec=True)
    assert not run.ok
    assert "vllm" in run.failure and "ref" in run.failure, run.failure[:500]


def test_check_run_replays_connector_runs_with_drafting(tmp_path):
    """Runs recorded from vLLM with a connector and a drafter are followed to the end and agree
    (setup_from_header named the pair unmodelled before)."""
    require_vllm()
    runs = record_connector_runs(tmp_path, profile_examples(4, 10), seed=5, setups=connector_setups(spec=True))
    followed = 0
    for run in runs:
        r = check_trace(run.path, check_invariants_every=1)
        if r.empty or run.known_hang or run.lost_update:
            continue
        assert r.divergence is None, f"{run.path}: " + r.divergence.table()
        assert r.crash is None and r.num_findings == 0, (run.path, [f.message for f in r.findings[:3]])
        assert r.followed, (run.path, r.stopped_because)
        assert r.header.get("spec", {}).get("num_speculative_tokens"), r.header.get("spec")
        followed += 1
    assert followed >= 2, followed
