"""The block properties hold on KV-connector runs (issue #28): blocks a connector keeps past their
request and blocks vLLM parks behind a step fence are counted, so conservation and reuse are checked
there (before, a connector run switched them off: "block_checks: off: kv_connector").

Generated runs of vLLM's own ``AsyncScheduler`` with a KV *consumer* (vLLM's ``defer_block_free``:
a freed request's blocks wait in ``deferred_frees`` until the steps that may still write them were
processed), recorded through ``scheduler_cls``; then the same with that fence removed in vLLM (the
bug class ``defer_block_free`` exists for: a block returned to the pool while an in-flight step may
write it), which ``--properties-only`` must find on its own.
"""

from __future__ import annotations

import pytest
from kvref.models.run_check import check_trace
from kvref.models.run_check.connector_runs import record_connector_runs

from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


def _consumer_async():
    from kvref.impl.reference.scheduler_connector import KV_CONSUMER
    from kvref.models.machines.scheduler_connector import connector_setups

    def fenced(setup) -> bool:
        _pool, cfg, conn = setup
        first = conn[0] if isinstance(conn, tuple) else conn
        return cfg.async_scheduling and first.kv_role == KV_CONSUMER

    return connector_setups().filter(fenced)


def test_deferred_and_delayed_frees_are_counted_and_the_block_checks_stay_on(tmp_path):
    require_vllm()
    runs = record_connector_runs(tmp_path, profile_examples(12, 20), seed=3, setups=_consumer_async())
    holds = {"sending": 0, "recving": 0, "fence": 0}
    checked = 0
    for run in runs:
        if run.known_hang or run.lost_update:
            continue
        r = check_trace(run.path, check_invariants_every=1)
        if r.empty:
            continue
        assert r.header["scheduler"]["async_scheduling"] and r.header["connector"]["kv_role"] == "kv_consumer"
        assert r.summary["block_checks"] == "on", r.summary["block_checks"]
        # vLLM 0.33.0 hangs itself where a whole failed load is offered again (docs/coverage.md):
        # a true finding, named; a run that got out of it (an abort) is not the drain's known_hang
        hang = [f for f in r.findings if f.kind == "starvation" and "self-reservation hang" in f.message]
        assert r.followed and r.divergence is None and r.crash is None, (run.path, r.divergence and r.divergence.table())
        assert r.num_findings == len(hang), (run.path, r.findings[:3])
        p = check_trace(run.path, properties_only=True)
        assert [f.message for f in p.findings] == [f.message for f in hang], (run.path, p.findings[:3])
        for kind, n in r.summary["connector_holds"].items():
            holds[kind] += n
        checked += 1
    assert checked >= 4
    assert holds["fence"] > 0 and holds["sending"] > 0, holds


def test_a_free_that_ignores_the_step_fence_is_found_by_the_properties_alone(tmp_path, monkeypatch):
    """vLLM's ``_request_blocks_can_be_freed`` planted to say yes while the request's last step is
    still in flight: the blocks return to the pool early. Conservation sees fewer blocks in use
    than the trace says are held (or a parked block handed out again)."""
    require_vllm()
    from vllm.v1.core.sched.scheduler import Scheduler

    monkeypatch.setattr(Scheduler, "_request_blocks_can_be_freed", lambda self, request: True)
    runs = record_connector_runs(tmp_path, profile_examples(12, 20), seed=3, setups=_consumer_async(), strict=False)
    monkeypatch.undo()
    kinds: set[str] = set()
    replay_found = 0
    for run in runs:
        p = check_trace(run.path, properties_only=True)
        kinds.update(f.kind for f in p.findings)
        replay_found += check_trace(run.path).divergence is not None
    assert kinds & {"conservation", "reused_while_needed"}, kinds
    assert replay_found > 0


def test_a_hit_on_blocks_cached_by_a_same_step_preemption_is_reported_where_replay_agrees():
    """A generated connector run (priority policy; recorded from vLLM 0.33.0, kept as data):
    schedule() preempts r4 after allocating (and caching) two blocks for its next chunk, so their
    hashes name tokens never computed; at step 10 r4 resumes with a 52-token hit through them. The
    reference does what vLLM does (replay agrees); the hit-content property names the blocks."""
    from pathlib import Path

    path = Path(__file__).parent / "data" / "same_step_preemption_hit.kvtrace.gz"
    r = check_trace(path, check_invariants_every=1)
    assert r.followed and r.divergence is None and r.summary["block_checks"] == "on"
    hits = [f for f in r.findings if f.kind == "wrong_hit"]
    assert hits and {f.step for f in hits} == {10} and all("r4's prefix-cache hit of 52 tokens" in f.message
                                                            for f in hits), r.findings
    assert {f.kind for f in r.findings} == {"wrong_hit"}


def test_the_prefix_cache_metrics_are_checked_on_connector_runs(tmp_path):
    """vLLM records a lookup's local prefix-cache stats at the request's admission (async loads
    included); on a connector run that is the update_state_after_alloc following the lookup's
    connector question. Pristine runs agree with the recorded SchedulerStats; the demo's
    ``hit-stats`` fault (a resumed request counted as a new one) is found by --properties-only."""
    require_vllm()
    from kvref.impl.vllm.demo_faults import plant

    pristine = record_connector_runs(tmp_path / "pristine", profile_examples(12, 20), seed=2)
    checked = [check_trace(run.path, properties_only=True) for run in pristine
               if not (run.known_hang or run.lost_update)]
    assert checked and not [f for r in checked for f in r.findings if f.kind == "metrics"]
    with plant("hit-stats"):
        runs = record_connector_runs(tmp_path / "fault", profile_examples(12, 20), seed=2, strict=False)
    kinds = {f.kind for run in runs for f in check_trace(run.path, properties_only=True).findings}
    assert "metrics" in kinds, kinds
