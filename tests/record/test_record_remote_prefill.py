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


def test_hisparse_deferred_loads_raise_no_false_finding(tmp_path):
    """A HiSparse host pool defers async loads behind the step in flight: their blocks and their
    lookup reach the trace only when the fence passes. The run properties flagged a leaked block,
    a block reused while needed or stats that disagree on 6 of 17 pristine runs (seed 2); they now
    leave those checks to a replay, which names the feature it cannot follow."""
    require_vllm()
    runs = record_connector_runs(tmp_path, profile_examples(6, 12), seed=2, lifecycle=True, hisparse=True)
    checked = 0
    for run in runs:
        r = check_trace(run.path, check_invariants_every=1)
        if r.empty or run.known_hang or run.lost_update:
            continue
        assert r.num_findings == 0 and r.crash is None, (run.path, [f.message for f in r.findings[:3]])
        assert r.divergence is None and r.stopped_because == "deferred_async_loads", (run.path, r.stopped_because)
        checked += 1
    assert checked >= 2, checked
