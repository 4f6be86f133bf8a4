"""Record runs of vLLM's real ``Scheduler`` / ``AsyncScheduler``, selected through
``scheduler_cls`` exactly as a server selects them, with the package's demo engine and fake model
(:mod:`kvref.models.run_check.demo`, what ``kvref demo record`` runs); check them with the reference.

Workloads: hybrid sliding-window pools with prefix hits, chunked-local pools, preemption storms
on the smallest pool startup accepts, async scheduling. On pristine vLLM every trace agrees step
by step; with #39734's gate re-introduced into the installed vLLM, ``check-run`` reports the
divergence at the step the long request should have been admitted, and the starvation property
fires on its own.
"""

from __future__ import annotations

import gzip
import os
import random
import subprocess
import sys

import pytest
from kvref.models.run_check import check_trace
from kvref.models.machines.scheduler import Lockstep, RequestSpec

from kvref import cli
from tests.models.test_startup_liveness import uncapped_sliding_window_admission
from tests.record.traces import ATTN, hybrid_setup, read_lines
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm():
    return require_vllm()


@pytest.fixture(scope="module")
def env(vllm):
    from kvref.impl.vllm.scheduler import VllmEnv

    return VllmEnv()


PREFIX = tuple(range(100, 200))


def record_run(path, pool, cfg, env, *, seed=0, ops=250, arrival=0.3, shared=0.5, max_len=None, abort=0.02,
               monkeypatch=None, anonymize=False, scheduler_cls=None):
    """Serve a random workload on a recording vLLM scheduler with the package's demo engine
    (:class:`kvref.models.run_check.demo.DemoEngine`: vLLM's step_with_batch_queue, a seeded fake
    model); vLLM's scheduler invariants are checked after every engine step. Returns the driver."""
    from kvref.impl.vllm.record import recorded_vllm_scheduler
    from kvref.models.run_check.demo import DemoEngine

    os.environ["KVREF_RECORD"] = str(path)
    os.environ["KVREF_RECORD_ANONYMIZE"] = "1" if anonymize else "0"
    try:
        target = recorded_vllm_scheduler(pool, cfg, env, scheduler_cls=scheduler_cls)
    finally:
        os.environ.pop("KVREF_RECORD", None)
        os.environ.pop("KVREF_RECORD_ANONYMIZE", None)
    engine = DemoEngine(target, pool, cfg, seed=seed)
    client = engine.client()
    rng = random.Random(seed)
    max_len = max_len or pool.max_model_len - 1
    for engine.tick in range(ops):
        if rng.random() < arrival:
            length = rng.randint(1, max_len)
            k = rng.randint(0, min(length, len(PREFIX))) if rng.random() < shared else 0
            client.add(PREFIX[:k] + tuple(rng.randrange(1, 50) for _ in range(length - k)), rng.randint(1, 10),
                       priority=rng.randint(0, 2), request_id=f"r{engine.num_added}")
        live = client.live()
        if live and rng.random() < abort:
            client.abort(rng.choice(live))
        engine.step()
        target.scheduler.check_invariants()
    target.close()
    return target


def _chunked_setup(async_scheduling=False):
    from kvref.impl.interface import PoolConfig
    from kvref.impl.scheduler_types import SchedulerConfig
    from kvref.spec.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheGroupSpec,
    )

    groups = (KVCacheGroupSpec(("full",), FullAttentionSpec(block_size=4, **ATTN)),
              KVCacheGroupSpec(("local",), ChunkedLocalAttentionSpec(block_size=4, attention_chunk_size=8, **ATTN)))
    cfg = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=3, async_scheduling=async_scheduling,
                          long_prefill_token_threshold=8)
    pool = PoolConfig(num_blocks=36, groups=groups, max_model_len=64, scheduler_block_size=4, hash_block_size=4,
                      max_in_flight_tokens=cfg.max_in_flight_tokens)
    return pool, cfg


def _half_block_window_setup():
    """FA in 8-token blocks beside a 5-token window in 2-token blocks (session 18, #28): hits align
    to 8 tokens, so vLLM caches only each 8-token segment's last two window blocks, and the hybrid
    coordinator caches only whole 8-token blocks; the free-queue check follows both."""
    from kvref.impl.interface import PoolConfig
    from kvref.impl.scheduler_types import SchedulerConfig
    from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec

    groups = (KVCacheGroupSpec(("full",), FullAttentionSpec(block_size=8, **ATTN)),
              KVCacheGroupSpec(("swa",), SlidingWindowSpec(block_size=2, sliding_window=5, **ATTN)))
    cfg = SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=3)
    pool = PoolConfig(num_blocks=40, groups=groups, max_model_len=64, scheduler_block_size=8, hash_block_size=2,
                      max_in_flight_tokens=cfg.max_in_flight_tokens)
    return pool, cfg


def _sparse_retention_setup():
    """A hybrid window pool under sparse prefix-cache retention (one window tail per 8 tokens): the
    header's interval configures the replay (session 18, #28: replayed as dense before, these runs
    diverged within a few steps)."""
    from dataclasses import replace

    pool, cfg = hybrid_setup(num_blocks=48, window=5)
    return replace(pool, prefix_cache_retention_interval=8), cfg


WORKLOADS = {
    "hybrid-swa-prefix-hits": lambda: hybrid_setup(num_blocks=48),
    "hybrid-swa-half-blocks": _half_block_window_setup,
    "hybrid-swa-sparse-retention": _sparse_retention_setup,
    "hybrid-swa-async": lambda: hybrid_setup(num_blocks=40, async_scheduling=True),
    "preemption-storm": lambda: hybrid_setup(num_blocks=None, max_num_seqs=5),
    "preemption-storm-async": lambda: hybrid_setup(num_blocks=None, max_num_seqs=5, async_scheduling=True),
    "chunked-local-threshold": _chunked_setup,
}


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_a_recorded_vllm_run_agrees_with_the_reference_step_by_step(name, env, tmp_path):
    pool, cfg = WORKLOADS[name]()
    path = tmp_path / f"{name}.kvtrace.gz"
    driver = record_run(path, pool, cfg, env, seed=len(name), arrival=0.45 if "storm" in name else 0.3)
    expected = "RecordingAsyncScheduler" if cfg.async_scheduling else "RecordingScheduler"
    assert type(driver.scheduler).__name__ == expected  # resolved from the scheduler_cls string
    header = read_lines(path)[0]
    assert header["scheduler"]["async_class"] is cfg.async_scheduling and header["unmodelled"] == []
    assert [g["spec"]["type"] for g in header["pool"]["groups"]] == [type(g.kv_cache_spec).__name__ for g in pool.groups]
    # what the free-queue check needs on sliding-window pools (session 18, #28): dense retention,
    # each manager's hit alignment (the scheduler block here) and EAGLE block drop
    assert header["pool"]["prefix_cache_retention_interval"] == pool.prefix_cache_retention_interval
    assert [(g["cache_hit_alignment_tokens"], g["drops_eagle_block"]) for g in header["pool"]["groups"]] == \
        [(pool.scheduler_block_size, False)] * len(pool.groups)
    assert header["pool"]["cache_round_tokens"] == pool.scheduler_block_size  # every workload is hybrid
    r = check_trace(path, check_invariants_every=1)
    assert r.divergence is None, r.divergence.table()
    assert r.ok and r.followed and r.steps_compared == r.summary["steps"] > 100 and not r.truncated
    s = r.summary
    if pool.prefix_cache_retention_interval is None:
        assert "sliding-window" not in s["free_order_check"] and "Mamba" not in s["free_order_check"]
    else:
        assert s["free_order_check"].startswith("off: sparse prefix-cache retention")
    assert sum(s["finished"].values()) > 10
    if "prefix" in name:
        assert s["prefix_hits"] > 0
    if "storm" in name:
        assert s["preemptions"] > 0 and s["resumes"] > 0


def test_reintroduced_39734_is_reported_at_the_step_it_changes(env, tmp_path, monkeypatch, vllm, capsys):
    """The pre-#40946 gate charges the sliding-window group for the whole sequence while startup
    sized it by the window: a long request that startup accepted is never admitted."""
    from kvref.impl.vllm.record import recorded_vllm_scheduler

    pool, cfg = hybrid_setup(num_blocks=None, window=8, block_size=4, max_model_len=256, budget=16)
    short = [RequestSpec(f"s{i}", tuple(range(1, 20 + i)), 3, 0, float(i)) for i in range(3)]
    long = RequestSpec("long", tuple(range(1, 251)), 2, 0, 9.0)
    for patched in (False, True):
        if patched:
            uncapped_sliding_window_admission(monkeypatch, vllm)
        path = tmp_path / f"run-{patched}.kvtrace.gz"
        monkeypatch.setenv("KVREF_RECORD", str(path))
        holder = {}
        ls = Lockstep(pool, cfg, {"vllm": lambda p, c: holder.setdefault("t", recorded_vllm_scheduler(p, c, env))})
        for spec in short:
            ls.add(spec)
        while ls.unfinished() or ls.num_in_flight():
            ls.engine_step()
        arrival_step = ls.num_schedules
        ls.add(long)
        for _ in range(30):
            ls.engine_step()
        holder["t"].close()
        r = check_trace(path)
        if not patched:
            assert r.ok and r.followed and r.summary["finished"] == {"length": 4}
            continue
        assert r.divergence is not None and r.divergence.call == "schedule"
        assert r.divergence.step == arrival_step  # the first schedule after the long request arrived
        assert r.divergence.recorded == [] and [row[0] for row in r.divergence.reference] == ["long"]
        assert [f.kind for f in r.findings] == ["starvation"] and "long" in r.findings[0].message
        assert r.steps_compared == arrival_step
        assert cli.main(["check-run", str(path), "--out", str(tmp_path / "cex")]) == 1
        out = capsys.readouterr().out
        assert "DIVERGENCE" in out and "[starvation]" in out
        [repro] = (tmp_path / "cex").glob("*.kvtrace.gz")
        r2 = check_trace(repro)
        assert r2.divergence is not None and r2.divergence.step == arrival_step
        # properties alone (what a user with a newer vLLM would run) still see the hang
        assert [f.kind for f in check_trace(path, properties_only=True).findings] == ["starvation"]


def test_anonymized_recording_hides_prompts_and_still_agrees(env, tmp_path):
    pool, cfg = hybrid_setup(num_blocks=48, async_scheduling=True)
    path = tmp_path / "anon.kvtrace.gz"
    record_run(path, pool, cfg, env, seed=3, ops=150, anonymize=True)
    lines = read_lines(path)
    assert lines[0]["anonymized"] is True
    from kvref.impl.run_trace import decode_tokens

    adds = [rec for rec in lines if rec.get("t") == "add"]
    assert adds and all(rec["id"].startswith("r") for rec in adds)
    first = decode_tokens(adds[0]["prompt"])
    assert first[0] == 0  # renumbered: PREFIX starts at 100, random tokens at >= 1
    r = check_trace(path, check_invariants_every=1)
    assert r.ok and r.followed, r.divergence and r.divergence.table()
    assert any("anonymized" in n for n in r.notes)


def test_the_synchronous_class_under_async_scheduling_is_flagged_not_diverged(env, tmp_path):
    pool, cfg = hybrid_setup(num_blocks=40, async_scheduling=True)
    path = tmp_path / "mismatch.kvtrace.gz"
    record_run(path, pool, cfg, env, seed=1, ops=60, scheduler_cls="kvref.record.RecordingScheduler")
    r = check_trace(path)
    assert not r.followed and "async_scheduling_mismatch" in r.stopped_because and r.divergence is None


def test_a_missing_output_path_is_a_clear_error(env, monkeypatch):
    from kvref.impl.vllm.record import recorded_vllm_scheduler
    from kvref.spec.errors import InvalidFieldError

    monkeypatch.delenv("KVREF_RECORD", raising=False)
    pool, cfg = hybrid_setup()
    with pytest.raises(InvalidFieldError, match="KVREF_RECORD"):
        recorded_vllm_scheduler(pool, cfg, env)


def test_importing_the_public_alias_does_not_import_vllm():
    code = ("import sys, kvref.record; assert 'vllm' not in sys.modules, 'vllm imported'; "
            "import kvref.cli.check_run, kvref.models.run_check; assert 'vllm' not in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_the_trace_is_gzip_and_readable_while_the_server_runs(env, tmp_path, monkeypatch):
    from kvref.impl.vllm.record import recorded_vllm_scheduler

    path = tmp_path / "live.kvtrace.gz"
    monkeypatch.setenv("KVREF_RECORD", str(path))
    pool, cfg = hybrid_setup()
    holder = {}
    ls = Lockstep(pool, cfg, {"vllm": lambda p, c: holder.setdefault("t", recorded_vllm_scheduler(p, c, env))})
    ls.add(RequestSpec("a", tuple(range(1, 30)), 5, 0, 0.0))
    for _ in range(4):
        ls.engine_step()
    holder["t"].scheduler.kvref_flush()
    r = check_trace(path, live=True)  # still running: read up to the last flushed record
    assert r.truncated and r.ok and r.summary["steps"] >= 2 and r.verdict == "agrees so far"
    # without --live a trace with no end record is INCOMPLETE, never "agrees" (issue #28)
    r = check_trace(path)
    assert r.incomplete and not r.ok and r.verdict == "INCOMPLETE"
    holder["t"].close()
    assert gzip.open(path).read() and not check_trace(path).truncated


@pytest.mark.parametrize("ids, fast", [
    (["plain-0", "plain-1", 'quote"d', "back\\slash", "tab\tid", "ünïcödé", "plain-2"], False),
    (["plain-0", "ünïcödé", "日本語-1", "plain-2"], True),  # printable, no quote or backslash: written as is
])
def test_an_id_that_needs_json_escaping_switches_the_recorder_to_the_encoder(env, tmp_path, monkeypatch, ids, fast):
    """The recorder joins request ids between quotes as they are, having checked each id once when its
    request arrived; the first id that needs escaping sends every later record through the encoder."""
    from kvref.impl.vllm.record import recorded_vllm_scheduler

    path = tmp_path / "odd-ids.kvtrace.gz"
    monkeypatch.setenv("KVREF_RECORD", str(path))
    pool, cfg = hybrid_setup(num_blocks=48, async_scheduling=True)
    holder = {}
    ls = Lockstep(pool, cfg, {"vllm": lambda p, c: holder.setdefault("t", recorded_vllm_scheduler(p, c, env))})
    for i, rid in enumerate(ids):
        ls.add(RequestSpec(rid, tuple(range(1, 12 + 3 * i)), 4, 0, float(i)))
        for _ in range(3):
            ls.engine_step()
    assert holder["t"].scheduler._kvref_fast is fast
    while ls.unfinished() or ls.num_in_flight():
        ls.engine_step()
    holder["t"].close()
    lines = read_lines(path)
    assert {rec["id"] for rec in lines if rec.get("t") == "add"} == set(ids)
    r = check_trace(path, check_invariants_every=1)
    assert r.ok and r.followed and r.summary["finished"] == {"length": len(ids)}, r.divergence and r.divergence.table()
