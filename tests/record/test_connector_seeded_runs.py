"""Generated KV-connector runs honour their seed, and pristine vLLM holds every property on the runs
other seeds draw (issue #28).

``record_connector_runs`` ran Hypothesis derandomized, which draws from the test's digest and
ignores a forced seed: every seed recorded the same runs. With the seed honoured, seeds 5 and 9 drew
runs where pristine vLLM 0.33.0 broke block conservation by the properties' count (replay agreed).
Each was a gap in the properties or the trace, not in vLLM; three runs are kept as data:

* ``connector_stale_in_flight``: a prefix-cache reset preempts a running request whose step is in
  flight (async scheduling); that step's output is stale when it settles after the request resumed,
  and vLLM frees windowed blocks on ``num_computed_tokens - num_in_flight_tokens``, so the stale
  step must not count as processed (it freed a sliding-window block vLLM still held).
* ``connector_refused_window``: ``allocate_slots`` frees a windowed group's skipped blocks before it
  refuses; the running request it refused stays unscheduled (the connector's pending frees stopped
  the preemption) but gave blocks up. The recorder now writes ``sched.refused``.
* ``connector_whole_hit_replay``: a request whose asynchronous load *succeeded* is asked its
  connector again (its one loaded token is replayed: ``num_computed_tokens`` back to 0) and keeps
  its blocks; only a load that failed with no valid token frees them before the new lookup.
* ``connector_failed_load_order`` (seed 16; a replay divergence): a load that failed under the
  ``fail`` policy is finished as an error *and* named in ``finished_recving`` after another
  request's; the replay ranked the error finishes first, so the two loads' blocks went back to the
  pool in the other order than vLLM's ``finished_recving`` iteration.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from kvref.models.run_check import check_trace
from kvref.models.run_check.connector_runs import record_connector_runs

from tests.vllm_env import require_vllm

DATA = Path(__file__).parent / "data"

pytestmark = pytest.mark.vllm


def _body(path: Path) -> list[str]:
    """A trace's records after its header (the header names the process and the time)."""
    with gzip.open(path, "rt") as f:
        return f.read().splitlines()[1:]


def test_the_seed_chooses_the_generated_connector_runs(tmp_path):
    require_vllm()
    first = record_connector_runs(tmp_path / "a", 4, seed=1, steps=12)
    again = record_connector_runs(tmp_path / "b", 4, seed=1, steps=12)
    other = record_connector_runs(tmp_path / "c", 4, seed=2, steps=12)
    assert [_body(r.path) for r in first] == [_body(r.path) for r in again]
    # derandomized, every seed recorded these same runs
    assert [_body(r.path) for r in first] != [_body(r.path) for r in other]


@pytest.mark.parametrize("seed", [5, 9])
def test_pristine_vllm_holds_every_property_on_other_seeds(tmp_path, seed):
    """The seeds whose runs exposed the three gaps above; a fixed example count (the first runs of
    a seed are the same whatever the profile)."""
    require_vllm()
    runs = record_connector_runs(tmp_path, 60, seed=seed)
    checked = 0
    for run in runs:
        if run.known_hang or run.lost_update:
            continue
        r = check_trace(run.path, check_invariants_every=1)
        if r.empty:
            continue
        assert r.divergence is None, f"{run.path}: " + r.divergence.table()
        assert r.num_findings == 0, (run.path, r.findings[:3])
        checked += 1
    assert checked >= len(runs) // 2


def _check(name: str, edit=None, tmp_path=None):
    path = DATA / name
    if edit is not None:
        with gzip.open(path, "rt") as f:
            lines = [json.loads(x) for x in f]
        path = tmp_path / name
        with gzip.open(path, "wt") as f:
            for rec in [lines[0]] + [edit(rec) for rec in lines[1:]]:
                f.write(json.dumps(rec) + "\n")
    return check_trace(path, check_invariants_every=1)


def _records(name: str) -> list[dict]:
    with gzip.open(DATA / name, "rt") as f:
        return [json.loads(x) for x in f][1:]


@pytest.mark.parametrize("name", ["connector_stale_in_flight.kvtrace.gz", "connector_refused_window.kvtrace.gz",
                                  "connector_whole_hit_replay.kvtrace.gz", "connector_failed_load_order.kvtrace.gz"])
def test_kept_pristine_connector_runs_agree_and_hold_every_property(name):
    r = _check(name)
    assert r.followed and r.divergence is None and r.crash is None, r.stopped_because
    assert r.summary["block_checks"] == "on"
    assert r.num_findings == 0, r.findings


def test_the_stale_step_run_has_a_reset_preempting_a_request_with_a_step_in_flight():
    recs = _records("connector_stale_in_flight.kvtrace.gz")
    steps_in_flight = set()
    found = False
    for rec in recs:
        if rec["t"] == "sched" and rec["ids"]:
            steps_in_flight.add(rec["step"])
        elif rec["t"] == "update":
            steps_in_flight.discard(rec["step"])
        elif rec["t"] == "reset" and rec.get("running") and steps_in_flight:
            found = True
    assert found


def test_refused_requests_give_up_their_skipped_window_blocks(tmp_path):
    """The recorded refusals are what keeps the count exact: without them conservation names a
    block vLLM freed as still held."""
    assert any(rec.get("refused") for rec in _records("connector_refused_window.kvtrace.gz"))

    def strip(rec):
        rec.pop("refused", None)
        return rec

    r = _check("connector_refused_window.kvtrace.gz", strip, tmp_path)
    assert r.divergence is None
    assert [f.kind for f in r.findings] == ["conservation"] and "freed while held" in r.findings[0].message


def test_a_successful_load_asked_again_keeps_its_blocks():
    recs = _records("connector_whole_hit_replay.kvtrace.gz")
    loaded, asked_again = set(), set()
    for rec in recs:
        for e in rec.get("kv") or ():
            if e[0] == "m" and e[1] in loaded:
                asked_again.add(e[1])
        kvo = rec.get("kvo") or {}
        loaded.update(kvo.get("r", ()))
        assert not kvo.get("f") and not kvo.get("i")  # no load failed in this run
    assert asked_again


def test_the_failed_load_run_finishes_an_error_also_named_after_another_finished_load():
    for rec in _records("connector_failed_load_order.kvtrace.gz"):
        kvo = rec.get("kvo") or {}
        errors = [rid for rid, why in rec.get("fin") or () if why == "error"]
        recv = kvo.get("r") or []
        if any(rid in recv and recv.index(rid) > 0 for rid in errors):
            return
    raise AssertionError("no error finish named in finished_recving after another request")


def test_one_order_keeps_every_list_order():
    from kvref.models.run_check.connector import _merged_order

    assert _merged_order([["r1", "r3"], [], ["r3"]]) == ["r1", "r3"]
    assert _merged_order([["a", "b"], ["c"], ["d", "a"]]) == ["c", "d", "a", "b"] or \
        _merged_order([["a", "b"], ["c"], ["d", "a"]]).index("d") < _merged_order([["a", "b"], ["c"], ["d", "a"]]).index("a")
    # the lists disagree: the transfer list's order wins
    out = _merged_order([["b", "a"], [], ["a", "c", "b"]])
    assert out.index("b") < out.index("a") < out.index("c") and sorted(out) == ["a", "b", "c"]


def test_the_self_reservation_hang_is_a_named_starvation_finding():
    """Seed 3's async-consumer runs (tests/record/test_connector_block_properties.py): r2's async
    load fails whole under the recompute policy, the MultiConnector's other child offers an async
    load again, and vLLM 0.33.0 refuses it against r2's own reservation in _inflight_prefills for
    three schedule calls until r2 is aborted (docs/coverage.md, findings). A real hang of vLLM, so
    a finding; the replay agrees (the reference mirrors it)."""
    r = _check("connector_self_reservation_hang.kvtrace.gz")
    assert r.followed and r.divergence is None
    assert [f.kind for f in r.findings] == ["starvation"]
    assert "self-reservation hang: r2's async load failed whole" in r.findings[0].message
    assert r.findings[0].step == 5
