"""Requests that never read the prefix cache (prompt logprobs: vLLM's ``skip_reading_prefix_cache``)
are recorded (``add.skip_read``) and replayed, not a reason to stop following (issue #28)."""

from __future__ import annotations

import gzip
import json
import os
import random

import pytest
from kvref.models.run_check import check_trace

from tests.record.traces import hybrid_setup
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


def _record(path, seed: int, connector=None) -> int:
    """vLLM's recording Scheduler serving requests that share a prefix, one in three skipping the
    prefix cache; returns how many skipping requests were admitted while their prefix was cached.
    ``connector``: kvref's scripted connector, holding every prompt's first 16 tokens (async loads)."""
    require_vllm()
    from kvref.impl.vllm.record import recorded_vllm_scheduler
    from kvref.impl.vllm.scheduler import VllmEnv

    pool, cfg = hybrid_setup(num_blocks=48)
    os.environ["KVREF_RECORD"] = str(path)
    try:
        driver = recorded_vllm_scheduler(pool, cfg, VllmEnv(), connector=connector)
    finally:
        os.environ.pop("KVREF_RECORD", None)
    s, v = driver.scheduler, driver._v
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 50) for _ in range(24)]
    skipped_over_hits = 0
    try:
        for step in range(150):
            if step < 110 and rng.random() < 0.35:
                skip = rng.random() < 0.35
                sp = v["SamplingParams"](max_tokens=rng.randint(1, 6), ignore_eos=True, skip_reading_prefix_cache=skip)
                prompt = prefix[:rng.randint(8, 24)] + [rng.randrange(1, 50) for _ in range(rng.randint(1, 12))]
                req = v["VRequest"](request_id=f"r{step}", prompt_token_ids=prompt, sampling_params=sp,
                                    pooling_params=None, arrival_time=float(step), block_hasher=driver._hasher)
                if connector is not None:
                    from kvref.impl.reference.scheduler_connector import ExternalHit

                    connector.set_hit(f"r{step}", ExternalHit(num_tokens=16, load_async=True))
                if skip:  # would a request that reads the cache hit here? (a probe, never added)
                    probe = v["VRequest"](request_id="probe", prompt_token_ids=prompt,
                                          sampling_params=v["SamplingParams"](max_tokens=1, ignore_eos=True),
                                          pooling_params=None, arrival_time=float(step), block_hasher=driver._hasher)
                    skipped_over_hits += s.kv_cache_manager.get_computed_blocks(probe)[1] > 0
                s.add_request(req)
            so = s.schedule()
            rids = list(so.num_scheduled_tokens)
            sampled = [[rng.randrange(1, 50)] if not s.requests[r].is_prefill_chunk else [] for r in rids]
            mro = v["ModelRunnerOutput"](req_ids=rids, req_id_to_index={r: i for i, r in enumerate(rids)},
                                         sampled_token_ids=sampled)
            if connector is not None:  # the worker: every async load lands at the next update
                from kvref.impl.reference.scheduler_connector import KVConnectorOutput
                from kvref.impl.vllm.connector import to_vllm_output

                mro.kv_connector_output = to_vllm_output(KVConnectorOutput(
                    finished_recving=tuple(sorted(connector.pending_loads))))
            s.update_from_output(so, mro)
    finally:
        driver.close()
    return skipped_over_hits


def test_requests_that_skip_the_prefix_cache_are_replayed(tmp_path):
    path = tmp_path / "skip.kvtrace.gz"
    skipped_over_hits = _record(path, seed=3)
    with gzip.open(path, "rt") as f:
        lines = [json.loads(x) for x in f]
    adds = [r for r in lines[1:] if r["t"] == "add"]
    assert any(r.get("skip_read") for r in adds) and not any(r.get("x") for r in adds)
    assert skipped_over_hits > 0  # a skipping request whose prefix vLLM had cached: the skip shows
    r = check_trace(path, check_invariants_every=1)
    assert r.ok and r.followed and r.steps_compared == 150, r.divergence and r.divergence.table()
    assert r.summary["prefix_hits"] > 0

    # the replay uses the flag: without it the reference finds the hits vLLM skipped
    unflagged = tmp_path / "unflagged.kvtrace.gz"
    with gzip.open(unflagged, "wt") as f:
        for rec in lines:
            rec.pop("skip_read", None)
            f.write(json.dumps(rec) + "\n")
    assert check_trace(unflagged).divergence is not None


def test_a_connector_hit_of_a_request_that_skips_the_cache_is_ignored(tmp_path):
    """vLLM asks the connector for a skipping request and ignores the answer; the reference does too."""
    from kvref.impl.reference.scheduler_connector import ScriptedConnector

    path = tmp_path / "skip-connector.kvtrace.gz"
    _record(path, seed=4, connector=ScriptedConnector())
    with gzip.open(path, "rt") as f:
        lines = [json.loads(x) for x in f][1:]
    skip = {r["id"] for r in lines if r["t"] == "add" and r.get("skip_read")}
    ignored = [e for r in lines for e in r.get("kv") or () if e[0] == "m" and e[1] in skip and e[3]]
    loaded = [e for r in lines for e in r.get("kv") or () if e[0] == "a" and e[3] > 0]
    assert ignored and loaded  # answers vLLM ignored, and loads it took for the other requests
    r = check_trace(path, check_invariants_every=1)
    assert r.ok and r.followed, r.divergence and r.divergence.table()
