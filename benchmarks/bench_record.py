"""What recording a vLLM run costs, and how fast ``kvref check-run`` reads a long trace.

    .venv/bin/python benchmarks/bench_record.py overhead [--steps 1500] [--repeats 3]
    .venv/bin/python benchmarks/bench_record.py check [--steps 1000000]

``overhead``: vLLM's real ``Scheduler`` and ``AsyncScheduler`` against kvref's recording classes,
side by side in one process, on the same deterministic workload (Llama-like pool: one full-attention
group, 16-token blocks, 8,192 blocks, ``max_model_len`` 4,096, budget 2,048 tokens, up to 128
running requests; half the prompts share a 512-token system prefix; 100-1,500 unique prompt tokens;
32-256 output tokens; a fake model samples one token per request per step). Every class is timed
over ``schedule()`` + ``update_from_output()`` + ``add_request()`` (the calls the recorder wraps),
``--repeats`` times, alternating, minimum kept, as the engine thread's CPU time
(``time.thread_time``: other processes on a shared machine do not count). The headline figure is the recorder's own time on the engine thread (the wrapped calls minus vLLM's calls inside them, measured in the same run:
free of the noise an A/B difference picks up on a shared machine) relative to vLLM's
``schedule()`` + ``update_from_output()`` + ``add_request()``; beside it the writer thread's CPU
(gzip, off the engine thread) and the plain A/B difference of the two classes' CPU time (noisier:
two runs, not one).

``check``: writes a ``--steps``-step trace with the reference (hybrid full + sliding-window pool,
async scheduling, arrivals, aborts, preemptions), then checks it with ``kvref check-run``'s
function in a fresh process, reporting steps/s and peak RSS (``resource.getrusage``); a trace a
tenth as long is checked the same way to show memory does not grow with the trace. For scale it
first measures vLLM's own ``AsyncScheduler`` steps per CPU-second (``schedule()`` +
``update_from_output()`` + ``add_request()`` on the same setup, fake model: a lower bound on what
vLLM spends per step; on a GPU each step also runs the model). Results print as they come.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


# ---- overhead ------------------------------------------------------------------------------------
def _llama_like():
    from kvref.impl.interface import PoolConfig
    from kvref.impl.scheduler_types import SchedulerConfig
    from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    def setup(is_async: bool):
        cfg = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=128, async_scheduling=is_async)
        groups = (KVCacheGroupSpec(tuple(f"layer{i}" for i in range(32)),
                                   FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")),)
        pool = PoolConfig(num_blocks=8192, groups=groups, max_model_len=4096, scheduler_block_size=16,
                          hash_block_size=16, max_in_flight_tokens=cfg.max_in_flight_tokens)
        return pool, cfg
    return setup


def _workload(seed: int, n: int):
    rng = random.Random(seed)
    system = [rng.randrange(1, 32000) for _ in range(512)]
    reqs = []
    for i in range(n):
        unique = [rng.randrange(1, 32000) for _ in range(rng.randint(100, 1500))]
        prompt = (system + unique) if rng.random() < 0.5 else unique
        reqs.append((f"req-{i}", prompt, rng.randint(32, 256)))
    return reqs


def _serve(driver, workload, steps: int, is_async: bool, max_live: int = 160) -> dict:
    """Drive vLLM's scheduler like the engine core (batch queue of depth 2 with async)."""
    from collections import deque

    v = driver._v
    s = driver.scheduler
    VRequest, SamplingParams, MRO = v["VRequest"], v["SamplingParams"], v["ModelRunnerOutput"]
    hasher = driver._hasher
    rng = random.Random(1)
    pending = deque(workload)
    depth = 2 if is_async else 1
    queue: deque = deque()
    t_calls = 0.0
    cpu0 = time.process_time()
    wall0 = time.perf_counter()
    done = 0
    # the engine thread's CPU time: other processes on a shared machine do not count (on a 2-core
    # machine at load 9, wall-clock medians skew: short calls run between preemptions, long ones not)
    perf = time.thread_time
    while done < steps:
        while pending and len(s.running) + len(s.waiting) < max_live:
            rid, prompt, max_tokens = pending.popleft()
            req = VRequest(request_id=rid, prompt_token_ids=prompt,
                           sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                           pooling_params=None, arrival_time=time.time(), block_hasher=hasher)
            t = perf()
            s.add_request(req)
            t_calls += perf() - t
        t = perf()
        so = s.schedule()
        t_calls += perf() - t
        # what the model runner samples for this step: one token unless the step is a prefill chunk
        queue.append((so, [not s.requests[r].is_prefill_chunk for r in so.num_scheduled_tokens]))
        done += 1
        if len(queue) < depth:
            continue
        so, samples = queue.popleft()
        rids = list(so.num_scheduled_tokens)
        sampled = [[rng.randrange(1, 32000)] if k else [] for k in samples]
        mro = MRO(req_ids=rids, req_id_to_index={r: i for i, r in enumerate(rids)}, sampled_token_ids=sampled)
        t = perf()
        s.update_from_output(so, mro)
        t_calls += perf() - t
    return {"calls_s": t_calls, "wall_s": time.perf_counter() - wall0, "cpu_s": time.process_time() - cpu0}


_INNER = {"s": 0.0}
_WRITER = {"s": 0.0}


def _instrument() -> None:
    """Time vLLM's own calls *inside* the recorder (its ``super()`` calls) and the writer thread.

    Wrapping ``Scheduler.schedule`` / ``update_from_output`` / ``add_request`` at class level
    catches both the plain classes' calls and the recorder's ``super()`` calls, so for a recording
    class (outer - inner) is exactly the recorder's own time on the engine thread, free of the
    run-to-run noise a shared machine adds to an A/B difference. The writer thread's CPU time is
    summed from ``time.thread_time`` around each chunk it encodes, compresses and writes.
    """
    from kvref.impl.run_trace.writer import TraceWriter
    from vllm.v1.core.sched.scheduler import Scheduler

    perf = time.thread_time
    for name in ("schedule", "update_from_output", "add_request"):
        orig = getattr(Scheduler, name)

        def timed(self, *a, _orig=orig, **k):
            t = perf()
            try:
                return _orig(self, *a, **k)
            finally:
                _INNER["s"] += perf() - t
        setattr(Scheduler, name, timed)
    orig_chunk = TraceWriter._write_chunk

    def timed_chunk(self, records, _orig=orig_chunk):
        t = time.thread_time()
        try:
            return _orig(self, records)
        finally:
            _WRITER["s"] += time.thread_time() - t
    TraceWriter._write_chunk = timed_chunk


def overhead(steps: int, repeats: int) -> list[dict]:
    from kvref.impl.vllm.record import recorded_vllm_scheduler
    from kvref.impl.vllm.scheduler import VllmEnv

    _instrument()

    env = VllmEnv()
    setup = _llama_like()
    workload = _workload(0, 20000)
    rows = []
    tmp = tempfile.mkdtemp(prefix="kvref_bench_record_")
    for is_async in (False, True):
        pool, cfg = setup(is_async)
        plain_cls = "vllm.v1.core.sched.async_scheduler.AsyncScheduler" if is_async else \
            "vllm.v1.core.sched.scheduler.Scheduler"
        rec_cls = "kvref.record.RecordingAsyncScheduler" if is_async else "kvref.record.RecordingScheduler"
        best: dict[str, dict] = {}
        for rep in range(repeats):
            for label, cls in (("plain", plain_cls), ("recording", rec_cls)):
                os.environ["KVREF_RECORD"] = os.path.join(tmp, f"run-{is_async}-{rep}.kvtrace.gz")
                driver = recorded_vllm_scheduler(pool, cfg, env, scheduler_cls=cls)
                _INNER["s"] = _WRITER["s"] = 0.0
                r = _serve(driver, workload, steps, is_async)
                r["inner_s"] = _INNER["s"]
                driver.scheduler.shutdown()
                r["writer_cpu_s"] = _WRITER["s"]
                if label == "recording":
                    r["trace_bytes"] = os.path.getsize(os.environ["KVREF_RECORD"])
                if label not in best or r["calls_s"] < best[label]["calls_s"]:
                    best[label] = r
        p, q = best["plain"], best["recording"]
        # the recorder's own CPU = calls - vLLM inside them, net of the timing wrapper's cost (the
        # same difference on the plain class: a thread_time call is a ~4 us syscall on this VM)
        own = ((q["calls_s"] - q["inner_s"]) - (p["calls_s"] - p["inner_s"])) / steps
        vllm_step = q["inner_s"] / steps
        rows.append({
            "scheduler": "AsyncScheduler" if is_async else "Scheduler", "steps": steps,
            "vllm_ms_per_step": round(1000 * vllm_step, 3),
            "recorder_ms_per_step": round(1000 * own, 4),
            "recorder_overhead_pct": round(100 * own / vllm_step, 2),
            "writer_thread_cpu_pct": round(100 * q["writer_cpu_s"] / q["inner_s"], 2),
            "ab_plain_ms_per_step": round(1000 * p["calls_s"] / steps, 3),
            "ab_recording_ms_per_step": round(1000 * q["calls_s"] / steps, 3),
            "ab_overhead_pct": round(100 * (q["calls_s"] - p["calls_s"]) / p["calls_s"], 2),
            "ab_process_cpu_overhead_pct": round(100 * (q["cpu_s"] - p["cpu_s"]) / p["cpu_s"], 2),
            "trace_bytes_per_step": round(q["trace_bytes"] / steps),
        })
    os.environ.pop("KVREF_RECORD", None)
    return rows


# ---- streaming check --------------------------------------------------------------------------------
def _check_setup():
    from kvref.impl.interface import PoolConfig
    from kvref.impl.scheduler_types import SchedulerConfig
    from kvref.spec.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    attn = dict(num_kv_heads=1, head_size=8, dtype="float16")
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, async_scheduling=True)
    groups = (KVCacheGroupSpec(("full",), FullAttentionSpec(block_size=8, **attn)),
              KVCacheGroupSpec(("swa",), SlidingWindowSpec(block_size=8, sliding_window=32, **attn)))
    pool = PoolConfig(num_blocks=96, groups=groups, max_model_len=256, scheduler_block_size=8, hash_block_size=8,
                      max_in_flight_tokens=cfg.max_in_flight_tokens)
    return pool, cfg


_CHILD = """
import json, resource, sys, time
from kvref.models.run_check import check_trace
t, c = time.perf_counter(), time.process_time(); r = check_trace(sys.argv[1])
dt, dc = time.perf_counter() - t, time.process_time() - c
print(json.dumps({"ok": r.ok, "followed": r.followed, "steps": r.summary["steps"], "records": r.records,
                  "seconds": dt, "cpu_s": dc, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "summary": r.summary}))
"""


def _check_in_child(path: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, path], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _vllm_rate(steps: int) -> float:
    """vLLM's ``AsyncScheduler``: ``schedule()`` + ``update_from_output()`` + ``add_request()`` steps
    per second of engine-thread CPU on the check setup (fake model, CPU)."""
    from kvref.impl.vllm.record import recorded_vllm_scheduler
    from kvref.impl.vllm.scheduler import VllmEnv

    pool, cfg = _check_setup()
    _instrument()
    rng = random.Random(0)
    workload = [(f"r{i}", [rng.randrange(1, 1000) for _ in range(rng.randint(1, 128))], rng.randint(1, 24))
                for i in range(steps)]
    driver = recorded_vllm_scheduler(pool, cfg, VllmEnv(), scheduler_cls="vllm.v1.core.sched.async_scheduler.AsyncScheduler")
    r = _serve(driver, workload, steps, True, max_live=16)
    return steps / r["calls_s"]


def check(steps: int) -> dict:
    from kvref.models.run_check.generate import generate_trace

    pool, cfg = _check_setup()
    d = tempfile.mkdtemp(prefix="kvref_bench_check_")
    out = {}
    try:
        out["vllm_steps_per_cpu_s"] = round(_vllm_rate(5000))
    except ImportError as exc:  # pragma: no cover - no vLLM
        out["vllm_steps_per_cpu_s"] = f"vLLM not importable: {exc}"
    print(json.dumps({"vllm_steps_per_cpu_s": out["vllm_steps_per_cpu_s"]}), flush=True)
    for n in (steps // 10, steps):
        path = os.path.join(d, f"gen-{n}.kvtrace.gz")
        t = time.perf_counter()
        generate_trace(path, pool, cfg, steps=n, seed=1, arrival_prob=0.3, max_tokens=24)
        gen_s = time.perf_counter() - t
        r = _check_in_child(path)
        out[n] = {"steps": n, "trace_mib": round(os.path.getsize(path) / 2**20, 1), "records": r["records"],
                  "generate_s": round(gen_s, 1), "check_s": round(r["seconds"], 1), "check_cpu_s": round(r["cpu_s"], 1),
                  "check_steps_per_s": round(n / r["seconds"]), "check_steps_per_cpu_s": round(n / r["cpu_s"]),
                  "peak_rss_mib": round(r["peak_rss_mib"], 1),
                  "ok": r["ok"], "followed": r["followed"], "summary": r["summary"]}
        print(json.dumps(out[n]), flush=True)  # as soon as known: a long run is not lost to a later failure
        os.remove(path)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("overhead", "check"))
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    if a.what == "overhead":
        for row in overhead(a.steps or 1500, a.repeats):
            print(json.dumps(row))
    else:
        check(a.steps or 1_000_000)


if __name__ == "__main__":
    main()
