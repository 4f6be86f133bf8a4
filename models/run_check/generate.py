"""Synthetic run traces written by the reference itself (benchmarks, tests without vLLM).

The reference scheduler runs an engine loop (vLLM's ``step_with_batch_queue`` shape: schedule
while a batch slot is free, else settle the oldest batch) over a random workload — arrivals with
shared prefixes, aborts, stop tokens — and every call is written in the run-trace format, as the
recording scheduler would have written it. Such a trace must check clean (the reference agrees
with itself), which makes it the baseline for the streaming benchmark (1,000,000 steps) and for
tests that edit one record and expect the divergence at that record.
"""

from __future__ import annotations

import random
from collections import deque

from kvref.impl.interface import PoolConfig
from kvref.impl.reference.scheduler import Scheduler
from kvref.impl.scheduler_types import SchedulerConfig
from kvref.impl.request import Request, RequestStatus
from kvref.impl.run_trace.format import FORMAT, VERSION, encode_tokens, sched_record
from kvref.impl.run_trace.writer import TraceWriter

from kvref.models.machines.scheduler import FakeModel
from .replay import reference_rows


def _spec_record(spec) -> dict:
    d = {"type": type(spec).__name__, "block_size": spec.block_size}
    for name in ("sliding_window", "attention_chunk_size", "extra_retained_tokens", "mamba_cache_mode"):
        if getattr(spec, name, None) is not None:
            d[name] = getattr(spec, name)
    return d


def header_for(pool: PoolConfig, config: SchedulerConfig, producer: str = "kvref reference") -> dict:
    """A trace header describing a reference setup (the recorder's header, minus vLLM's extras)."""
    from kvref.spec.version import KVREF_VERSION as __version__
    from kvref.spec.version import MODELLED_VLLM_VERSION as VLLM_VERSION

    return {
        "format": FORMAT, "version": VERSION,
        "producer": {"vllm": VLLM_VERSION, "kvref": __version__, "scheduler_cls": producer},
        "anonymized": False,
        "pool": {"num_blocks": pool.num_blocks, "max_model_len": pool.max_model_len,
                 "scheduler_block_size": pool.scheduler_block_size, "hash_block_size": pool.hash_block_size,
                 "max_in_flight_tokens": pool.max_in_flight_tokens, "enable_caching": pool.enable_caching,
                 "watermark": pool.watermark, "use_eagle": pool.use_eagle,
                 "groups": [{"layers": list(g.layer_names), "spec": _spec_record(g.kv_cache_spec)}
                            for g in pool.groups]},
        "scheduler": {"max_num_batched_tokens": config.max_num_batched_tokens,
                      "max_num_scheduled_tokens": config.scheduled_tokens_cap,
                      "max_num_seqs": config.max_num_seqs,
                      "long_prefill_token_threshold": config.long_prefill_token_threshold,
                      "enable_chunked_prefill": config.enable_chunked_prefill, "policy": config.policy,
                      "scheduler_reserve_full_isl": config.scheduler_reserve_full_isl,
                      "async_scheduling": config.async_scheduling, "async_class": config.async_scheduling,
                      "prefill_schedule_interval": config.prefill_schedule_interval,
                      "long_prefill_token_threshold_adaptive": config.long_prefill_token_threshold_adaptive,
                      "max_num_active_seqs": config.max_num_active_reqs},
        "unmodelled": [],
    }


def _update(step: int, out, mo, fin) -> dict:
    """An ``update`` record as a model runner reports it: every scheduled id, [] for prefill chunks."""
    ids = [s.request_id for s in out.scheduled]
    return {"t": "update", "step": step, "ids": ids, "sampled": [mo.sampled_token_ids.get(i, []) for i in ids],
            "fin": fin}


def generate_trace(path: str, pool: PoolConfig, config: SchedulerConfig, *, steps: int, seed: int = 0,
                   arrival_prob: float = 0.3, abort_prob: float = 0.01, max_live: int | None = None,
                   max_tokens: int = 24, background: bool = True) -> int:
    """Write a ``steps``-step trace of the reference serving a random workload; returns records written."""
    rng = random.Random(seed)
    sched = Scheduler(pool, config)
    model = FakeModel()
    w = TraceWriter(path, header_for(pool, config), background=background)
    prefixes = [[rng.randrange(1, 1000) for _ in range(pool.max_model_len)] for _ in range(3)]
    live: dict[str, Request] = {}
    in_flight: deque = deque()
    max_live = max_live or 2 * config.max_num_seqs
    depth = config.max_concurrent_batches
    n_req = step = 0

    def settle() -> None:
        """The oldest step in flight comes back: update, record the finishes it caused."""
        k, out = in_flight.popleft()
        mo = model.output(out)
        sched.update_from_output(out, mo)
        fin = []
        for s in out.scheduled:
            r = live.get(s.request_id)
            if r is not None and r.status == RequestStatus.FINISHED:
                fin.append([s.request_id, r.finish_reason])
                del live[s.request_id]
                model.num_sampled.pop(s.request_id, None)
        rec = _update(k, out, mo, fin)
        rec["free"] = sched.kv_cache_manager.get_num_free_blocks()
        w.write(rec)

    while step < steps:
        if len(live) < max_live and rng.random() < arrival_prob:
            length = rng.randint(1, max(1, min(pool.max_model_len - 1, 4 * pool.scheduler_block_size * 4)))
            shared = rng.randint(0, length) if rng.random() < 0.6 else 0
            prompt = prefixes[rng.randrange(3)][:shared] + [rng.randrange(1, 1000) for _ in range(length - shared)]
            r = Request(f"r{n_req}", prompt, max_tokens=rng.randint(1, max_tokens), priority=rng.randint(0, 2),
                        arrival_time=float(n_req), stop_token_ids=(7,) if rng.random() < 0.2 else ())
            n_req += 1
            sched.add_request(r)
            live[r.request_id] = r
            w.write({"t": "add", "id": r.request_id, "prompt": encode_tokens(prompt), "max_tokens": r.max_tokens,
                     "stop": list(r.stop_token_ids), "salt": None, "priority": r.priority, "arrival": r.arrival_time})
        if live and rng.random() < abort_prob:
            rid = rng.choice(list(live))
            sched.finish_requests([rid])
            del live[rid]
            w.write({"t": "abort", "ids": [rid], "status": "FINISHED_ABORTED",
                     "free": sched.kv_cache_manager.get_num_free_blocks()})
        if len(in_flight) < depth and (sched.has_unfinished_requests() or not in_flight):
            out = sched.schedule()
            in_flight.append((step, out))
            rec = sched_record(step, reference_rows(out), sorted(out.preempted_req_ids), sorted(out.finished_req_ids))
            rec["free"] = sched.kv_cache_manager.get_num_free_blocks()  # format version 3
            if out.preempted_req_ids:  # the reference preempts only for KV blocks
                rec["pre_why"] = {rid: "kv" for rid in sorted(out.preempted_req_ids)}
            w.write(rec)
            step += 1
            if len(in_flight) < depth and sched.has_unfinished_requests():
                continue
        settle()
    while in_flight:
        settle()
    w.close({"t": "end", "steps": step, "records": w.num_records + 1})
    return w.num_records
