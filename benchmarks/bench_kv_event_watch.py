"""Events/s through ``kvref watch``'s decoder and watcher (no sockets): how far the checker is from
being the bottleneck of a live stream.

    .venv/bin/python benchmarks/bench_kv_event_watch.py [--batches 2000] [--decoder generic|vllm]

The payloads are real event streams: the reference KV cache manager (full attention, 16-token
blocks, 64 blocks) with events on, one batch per request (shared prefixes, so hits and evictions),
encoded as vLLM's publisher encodes a ``KVEventBatch`` (msgpack array, default-valued optional fields
omitted). Prints batches, events, MB and events/s for decode + feed, and checks the run found
nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

#: fields vLLM's structs declare without a default: always on the wire (omit_defaults skips the rest)
_REQUIRED = {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
             "lora_name"}


def payloads(num_batches: int) -> list[bytes]:
    import msgspec

    from kvref.impl.interface import PoolConfig
    from kvref.impl.reference.kv_cache_manager import KVCacheManager
    from kvref.impl.reference.kv_events import event_to_plain
    from kvref.impl.request import Request
    from kvref.spec import EngineConfig, plan_kv_cache
    from kvref.spec.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype="float32")
    # one layer planned as startup plans it, with a fixed block count (--num-gpu-blocks-override)
    plan = plan_kv_cache({"l": spec}, EngineConfig(block_size=16, max_model_len=512, num_gpu_blocks_override=64), 0)
    cfg = PoolConfig.from_plan(plan, enable_kv_cache_events=True)
    mgr = KVCacheManager(cfg)
    enc = msgspec.msgpack.Encoder()
    out = []
    for step in range(num_batches):
        r = Request(f"r{step}", [step % 7] * 64 + list(range(step % 50, step % 50 + 100)))
        blocks, hit, _ = mgr.get_computed_blocks(r)
        if mgr.allocate_slots(r, r.num_tokens - hit, hit, blocks if hit else None) is not None:
            mgr.free(r)
        events = [{k: v for k, v in event_to_plain(e).items() if v is not None or k in _REQUIRED}
                  for e in mgr.take_events()]
        out.append(enc.encode([float(step), events, 0]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=2000)
    ap.add_argument("--decoder", default="generic", choices=("generic", "vllm"))
    args = ap.parse_args()

    from kvref.impl.vllm.kv_events import make_decoder
    from kvref.models.kv_events.watch import EventStreamWatcher

    data = payloads(args.batches)
    decode = make_decoder(args.decoder)
    w = EventStreamWatcher()
    t = time.perf_counter()
    for seq, p in enumerate(data):
        b = decode(p)
        w.feed(seq, b.ts, b.events, b.data_parallel_rank, digest=hashlib.blake2b(p, digest_size=16).digest())
    dt = time.perf_counter() - t
    n = sum(w.events_by_type.values())
    assert w.num_findings == 0, w.summary()
    print(f"{args.decoder}: {len(data)} batches, {n} events ({w.events_by_type}), "
          f"{sum(map(len, data)) / 1e6:.1f} MB in {dt:.2f} s: {n / dt:,.0f} events/s, {len(data) / dt:,.0f} batches/s")


if __name__ == "__main__":
    main()
