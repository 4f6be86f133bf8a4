"""KV-connector runs of vLLM's real scheduler, recorded and replayed by ``kvref check-run`` (issue #28).

Generated runs (the connector machine's draws: sync and async loads, lookups that answer "not yet",
loads finishing late, failing as a whole or in some blocks under both failure policies, sends that
keep a finished request's blocks, aborts, prefix-cache resets with and without the connector's,
vLLM's MultiConnector over two children) are recorded through ``scheduler_cls`` with kvref's
scripted connector built by vLLM's own factory; the replay answers the reference's connector
questions from the trace and must agree on every one. A fault planted into vLLM's connector path is
found; a replay that does not get the recorded answers cannot agree.
"""

from __future__ import annotations

import gzip
import json
from collections import Counter

import pytest
from kvref.models.run_check import check_trace
from kvref.models.run_check.connector_runs import record_connector_runs

from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm



@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    require_vllm()
    runs = record_connector_runs(tmp_path_factory.mktemp("connector-runs"), profile_examples(30, 60), seed=3)
    return [r for r in runs if r.shows or r.path.stat().st_size > 0]


def _rewrite(src, dst, edit) -> None:
    with gzip.open(src, "rt") as f:
        lines = [json.loads(x) for x in f]
    out = [lines[0]] + [edit(rec) for rec in lines[1:]]
    with gzip.open(dst, "wt") as f:
        for rec in out:
            if rec is not None:
                f.write(json.dumps(rec) + "\n")


def test_every_generated_connector_run_agrees_with_the_reference(recorded):
    shows: Counter = Counter()
    followed = 0
    modes: set[bool] = set()
    for run in recorded:
        r = check_trace(run.path, check_invariants_every=1)
        if run.lost_update:
            # the generator stopped between taking a step off the batch queue and settling it: the
            # trace schedules again over an unsettled step, which check-run refuses
            assert r.divergence is None or "refuses" in r.divergence.message, run.path
            continue
        if r.empty or run.known_hang:
            continue  # known_hang: vLLM 0.33.0 hangs there itself (the machine's drain names it)
        assert r.divergence is None, f"{run.path}: " + r.divergence.table()
        assert r.crash is None and r.num_findings == 0, (run.path, r.findings[:3])
        # every run is followed: a connector that supports divergent local hybrid hits on a multi-group
        # pool without Mamba was named unmodelled and skipped before (#28); vLLM's lookup there is
        # get_computed_blocks's, and the reference asks get_computed_blocks_for_connector as vLLM does
        assert r.followed, (run.path, r.stopped_because)
        followed += 1
        modes.add(bool(r.header["scheduler"]["async_class"]))
        assert r.steps_compared == r.summary["steps"]
        shows.update(run.shows)
        conn, groups = r.header["connector"], r.header["pool"]["groups"]
        shows["divergent_multi_group"] += bool(conn.get("divergent_local_hybrid_hits") and len(groups) > 1
                                               and run.shows["m"])
        # the block properties hold on connector runs too (#28): blocks a connector keeps past their
        # request (delayed sends, loads aborted mid-flight) and deferred frees behind a step fence
        # are counted, so conservation and reuse are checked, not switched off
        assert r.summary["block_checks"] == "on", r.summary["block_checks"]
        for kind, n in r.summary["connector_holds"].items():
            shows["held_" + kind] += n
        assert r.ok
    assert followed >= len(recorded) * 3 // 4
    assert shows["divergent_multi_group"] > 0, dict(shows)
    # (fenced frees: tests/record/test_connector_block_properties.py draws the async consumer runs)
    assert shows["held_sending"] and shows["held_recving"], dict(shows)
    assert modes == {False, True}, "both vLLM's Scheduler and its AsyncScheduler (deferred frees) replayed"
    # the replayed runs reach every connector path the recorder writes: lookups answered "not
    # yet", async loads finishing, failing as a whole and in blocks, delayed frees and their
    # sends, error finishes (the "fail" policy), has_pending_block_frees, connector cache resets,
    # MultiConnector children, the connector's stats, aborts while a load is in flight
    for key in ("m_none", "m_async", "kvo_r", "kvo_f", "kvo_i", "f_delay", "kvo_s", "fin_error", "p", "r", "multi",
                "reset", "stats_external_hits", "stats_connector_reset", "abort_mid_load"):
        assert shows[key] > 0, (key, dict(shows))


def test_a_replay_that_ignores_the_recorded_answers_diverges(recorded, tmp_path):
    """Without the ``kv`` answers (or with one answer, or the connector's hit count, changed) the
    replay cannot agree."""
    run = max(recorded, key=lambda r: r.shows["m"] + r.shows["a"])
    assert run.shows["a"] > 0
    stripped = tmp_path / "stripped.kvtrace.gz"
    _rewrite(run.path, stripped, lambda rec: {k: v for k, v in rec.items() if k != "kv"})
    r = check_trace(stripped)
    assert r.divergence is not None and "connector was driven differently" in r.divergence.message
    assert r.verdict == "FINDINGS"

    # one external hit one token longer than the connector answered: the allocation differs
    changed = {"done": False}

    def bump(rec):
        for e in rec.get("kv") or ():
            if e[0] == "m" and e[3] and not changed["done"]:
                e[3] += 1
                changed["done"] = True
        return rec

    # the connector's prefix-cache stats the metrics endpoint shows: one external hit more
    counted = {"done": False}

    def one_more_hit(rec):
        stats = rec.get("stats") or {}
        if stats.get("ch") and not counted["done"]:
            stats["ch"] += 1
            counted["done"] = True
        return rec

    run_stats = next(r for r in recorded if r.shows["stats_external_hits"])
    miscounted = tmp_path / "miscounted.kvtrace.gz"
    _rewrite(run_stats.path, miscounted, one_more_hit)
    r = check_trace(miscounted)
    assert r.divergence is not None and "ch: recorded" in r.divergence.message

    bumped = tmp_path / "bumped.kvtrace.gz"
    _rewrite(run.path, bumped, bump)
    assert changed["done"]
    r = check_trace(bumped)
    assert r.divergence is not None, "a changed connector answer went unnoticed"


def test_a_multiconnector_that_composes_its_children_wrongly_is_found(recorded, tmp_path):
    """The children's recorded answers are checked against vLLM's MultiConnector rules."""
    run = next(r for r in recorded if r.shows["multi"] and r.shows["m_async"])
    changed = {"done": False}

    def swap(rec):
        for e in rec.get("kv") or ():
            if e[0] == "m" and e[5] and e[3] and not changed["done"]:
                e[5] = [[0, False] for _ in e[5]]  # no child had a hit, yet the composition loads
                changed["done"] = True
        return rec

    dst = tmp_path / "multi.kvtrace.gz"
    _rewrite(run.path, dst, swap)
    assert changed["done"]
    r = check_trace(dst)
    assert r.divergence is not None and "MultiConnector" in r.divergence.message


def test_a_planted_connector_fault_in_vllm_is_found(tmp_path, monkeypatch):
    """vLLM's scheduler forgets to free a request's blocks when its connector reports the send
    finished (a leak on the delayed-free path): check-run names the step."""
    require_vllm()
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler._update_from_kv_xfer_finished

    def leaky(self, kv_connector_output):
        kv_connector_output.finished_sending = set()  # the sends finish, the blocks are never freed
        return original(self, kv_connector_output)

    monkeypatch.setattr(Scheduler, "_update_from_kv_xfer_finished", leaky)
    # the leak also breaks the machine's own drain check: the runs up to that one are kept
    runs = record_connector_runs(tmp_path, profile_examples(12, 20), seed=2, strict=False)
    monkeypatch.undo()
    hit = [r for r in runs if r.shows["kvo_s"]]
    assert hit, "no generated run finished a send"
    followed = 0
    for run in hit:
        r = check_trace(run.path)
        followed += 1
        assert r.divergence is not None, f"{run.path}: the leak went unnoticed"
        assert r.divergence.call == "update_from_output" and "free-block count" in r.divergence.message
        assert r.verdict == "FINDINGS"
    assert followed > 0


def test_anonymized_connector_runs_agree(tmp_path):
    """The connector's answers name the anonymous ids, so an anonymized connector run replays too."""
    require_vllm()
    runs = record_connector_runs(tmp_path, profile_examples(6, 10), seed=5, anonymize=True)
    checked = 0
    for run in runs:
        r = check_trace(run.path, check_invariants_every=1)
        if r.empty or run.known_hang or run.lost_update:
            continue
        assert r.header["anonymized"] and r.ok and r.followed, (run.path, r.divergence and r.divergence.table())
        checked += run.shows["m"] > 0
    assert checked > 0


def test_a_version_3_connector_trace_is_checked_by_the_properties(recorded, tmp_path):
    """A connector trace without the answers (what format 3 wrote) is not replayed: the properties
    check it, and it is not a finding."""
    run = max(recorded, key=lambda r: r.shows["a"])
    src = tmp_path / "v3.kvtrace.gz"
    with gzip.open(run.path, "rt") as f:
        lines = [json.loads(x) for x in f]
    header = dict(lines[0], version=3, unmodelled=lines[0]["unmodelled"] + ["kv_connector"])
    del header["connector"]
    keep = [{k: v for k, v in rec.items() if k not in ("kv", "kvo")} for rec in lines[1:]]
    for rec in keep:
        for k in [k for k in (rec.get("stats") or {}) if k.startswith("c")]:
            del rec["stats"][k]
    with gzip.open(src, "wt") as f:
        for rec in [header] + keep:
            f.write(json.dumps(rec) + "\n")
    r = check_trace(src)
    assert not r.followed and "kv_connector" in r.stopped_because and r.divergence is None
    assert r.num_findings == 0 and r.verdict == "properties hold"


@pytest.mark.parametrize("fault", ["leak-on-refusal", "wrong-hit-length"])
def test_a_demo_fault_planted_into_vllm_shows_in_connector_runs(fault, tmp_path):
    """The demo's faults (kvref.impl.vllm.demo_faults, vLLM's KV-cache classes monkeypatched for the
    block) manifest in connector runs too, and check-run reports them as divergences."""
    require_vllm()
    from kvref.impl.vllm.demo_faults import plant

    with plant(fault):
        runs = record_connector_runs(tmp_path, profile_examples(12, 12), seed=2, strict=False)
    found = [run for run in runs if check_trace(run.path).divergence is not None]
    assert found, f"{fault}: no divergence in {len(runs)} connector runs"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_run_with_vllms_own_offloading_connector_is_replayed(async_scheduling, tmp_path, monkeypatch):
    """vLLM's real OffloadingConnector (CPU tier) inside its scheduler: loads back from the CPU tier
    (async, "ask again"), external hits in the metrics; the replay agrees step by step. A promotion
    that drops the last loaded block (a bug planted into vLLM's _update_waiting_for_remote_kv) is a
    divergence."""
    require_vllm()
    from kvref.models.run_check.connector_runs import trace_shows
    from kvref.impl.vllm.record_offload import record_offloading_run
    from vllm.v1.core.sched.scheduler import Scheduler

    path = record_offloading_run(tmp_path / "offload.kvtrace.gz", seed=1, async_scheduling=async_scheduling)
    r = check_trace(path, check_invariants_every=1)
    assert r.ok and r.followed and r.steps_compared == r.summary["steps"], r.divergence and r.divergence.table()
    assert r.header["connector"]["classes"] == ["OffloadingConnector"]
    shows = trace_shows(path)
    assert shows["m_async"] > 0 and shows["kvo_r"] > 0 and shows["stats_external_hits"] > 0, dict(shows)

    original = Scheduler._update_waiting_for_remote_kv

    def drops_a_block(self, request):
        failed = request.request_id in self.failed_recving_kv_req_ids
        original(self, request)
        if not failed and request.num_computed_tokens >= 2 * self.block_size:
            request.num_computed_tokens -= self.block_size

    monkeypatch.setattr(Scheduler, "_update_waiting_for_remote_kv", drops_a_block)
    bad = record_offloading_run(tmp_path / "planted.kvtrace.gz", seed=1, async_scheduling=async_scheduling)
    monkeypatch.undo()
    r = check_trace(bad)
    assert r.divergence is not None and r.divergence.call == "schedule" and r.verdict == "FINDINGS"


def test_an_answer_longer_than_the_request_is_a_finding_not_a_traceback(recorded, tmp_path):
    """A connector answering more tokens than the request holds (vLLM asserts on it) is reported at
    its step, whatever the reference's own checks say."""
    run = max(recorded, key=lambda r: r.shows["m_async"])
    changed = {"done": False}

    def too_long(rec):
        for e in rec.get("kv") or ():
            if e[0] == "m" and e[3] and not changed["done"]:
                e[3] += 10_000
                changed["done"] = True
        return rec

    dst = tmp_path / "too-long.kvtrace.gz"
    _rewrite(run.path, dst, too_long)
    assert changed["done"]
    r = check_trace(dst)
    assert r.divergence is not None and r.verdict == "FINDINGS"
