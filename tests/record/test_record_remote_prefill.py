"""Runs with ``kv_transfer_params`` (the decode side of a P/D split) are replayed by ``kvref
check-run`` (issue #28).

The recorder named every request carrying ``kv_transfer_params`` "unmodelled", so check-run stopped
following a P/D decoder's run at its first arrival. Those params are read by the KV connector, whose
answers the trace holds (format 4), and by vLLM's scheduler only for ``do_remote_prefill`` (a KV
fetch stage counted from arrival), which the ``add`` record now carries as ``remote``. Runs of the
connector lifecycle machine (async consumers, one arrival in three with ``do_remote_prefill``),
recorded from vLLM 0.33.0's scheduler, must be followed to the end and agree.
"""

from __future__ import annotations

import gzip
import json

import pytest

from kvref.models.run_check import check_trace
from kvref.models.run_check.connector_runs import record_connector_runs
from kvref.models.run_check.replay import _request
from kvref.spec.errors import InvalidFieldError
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


def _remote_adds(path) -> int:
    with gzip.open(path, "rt") as f:
        return sum(1 for line in f if '"t":"add"' in line and json.loads(line).get("remote") is True)


def test_decode_side_runs_are_followed_to_the_end(tmp_path):
    require_vllm()
    runs = record_connector_runs(tmp_path, profile_examples(6, 12), seed=1, lifecycle=True)
    followed = remote = 0
    for run in runs:
        r = check_trace(run.path, check_invariants_every=1)
        if r.empty or run.known_hang or run.lost_update:
            continue
        assert not any("kv_transfer" in u for u in r.setup.unmodelled), r.setup.unmodelled
        assert r.divergence is None, f"{run.path}: " + r.divergence.table()
        assert r.crash is None and r.num_findings == 0, (run.path, r.findings[:3])
        assert r.followed, (run.path, r.stopped_because)
        followed += 1
        remote += _remote_adds(run.path)
    assert followed >= 2 and remote > 0, (followed, remote)


def test_the_add_record_carries_do_remote_prefill():
    rec = {"t": "add", "id": "r0", "prompt": "AQAAAAIAAAA=", "max_tokens": 2, "stop": [], "salt": None,
           "priority": 0, "arrival": 0.0}
    assert _request(rec).do_remote_prefill is False
    assert _request({**rec, "remote": True}).do_remote_prefill is True


def test_lifecycle_recording_draws_its_own_setups(tmp_path):
    with pytest.raises(InvalidFieldError, match="lifecycle"):
        record_connector_runs(tmp_path, 1, lifecycle=True, pause=True)


def _deferred(path) -> int:
    """Async loads the connector heard of in an update (vLLM's _drain_deferred_loads: a deferred
    HiSparse load whose fence passed), counted from the trace."""
    with gzip.open(path, "rt") as f:
        return sum(sum(1 for e in json.loads(line).get("kv") or () if e[0] == "a")
                   for line in f if line.startswith('{"t":"update"'))


@pytest.fixture(scope="module")
def hisparse_runs(tmp_path_factory):
    """Lifecycle connector runs on a HiSparse host pool (seed 2), pristine and on a vLLM whose
    scheduler never defers a load (``defer_async_loads`` forced off after ``__init__``)."""
    require_vllm()
    from vllm.v1.core.sched.scheduler import Scheduler

    d = tmp_path_factory.mktemp("hisparse")
    n = profile_examples(6, 12)
    pristine = record_connector_runs(d / "pristine", n, seed=2, lifecycle=True, hisparse=True)
    real = Scheduler.__init__

    def init(self, *a, **k):
        real(self, *a, **k)
        self.defer_async_loads = False

    Scheduler.__init__ = init
    try:
        faulty = record_connector_runs(d / "faulty", n, seed=2, lifecycle=True, hisparse=True, strict=False)
    finally:
        Scheduler.__init__ = real
    return pristine, faulty


def test_hisparse_deferred_loads_are_replayed(hisparse_runs):
    """A HiSparse host pool defers async loads behind the step in flight (vLLM ``defer_async_loads``):
    the connector hears of such a load, and its stats count it, only in the update that processed
    its fence, while the local hit is counted at admission. The replay follows that (the header's
    ``connector.hisparse_host_pool``; session 20, #28): every pristine run agrees step by step, with
    deferred loads drained in updates, and the run properties raise no false finding (6 of 17 runs had
    one before session 19 made them leave those checks to the replay)."""
    pristine, _ = hisparse_runs
    checked = drained = 0
    for run in pristine:
        r = check_trace(run.path, check_invariants_every=1)
        if r.empty or run.known_hang or run.lost_update:
            continue
        with gzip.open(run.path, "rt") as f:
            header = json.loads(f.readline())
        assert header["connector"]["hisparse_host_pool"] is True and header["unmodelled"] == [], header
        assert r.followed and r.verdict == "agrees", (run.path, r.stopped_because, r.findings[:2],
                                                      r.divergence and r.divergence.table())
        assert r.num_findings == 0 and r.crash is None
        checked += 1
        drained += _deferred(run.path)
    assert checked >= 4 and drained >= 3, (checked, drained)


def test_a_hisparse_load_started_before_its_fence_is_flagged(hisparse_runs):
    """No false green: the same draws on a vLLM that starts every async load at once (the page a
    step in flight still reads may be overwritten) diverge where a load should have waited, and the
    run properties alone (``--properties-only``, what another vLLM version gets) say so too."""
    _, faulty = hisparse_runs
    flagged = [run for run in faulty if not run.known_hang and not run.lost_update
               and check_trace(run.path).divergence is not None]
    assert len(flagged) >= 2, [r.path for r in faulty]
    for run in flagged:
        kinds = {f.kind for f in check_trace(run.path, properties_only=True).findings}
        assert "load_fence" in kinds, (run.path, kinds)
