"""Per-tier lookup counts and delays (vLLM ``tiering/metrics.py``, the lookup half).

A chunk query is counted once per (request, tier, key) when the tier *resolves* it (HIT or MISS),
until the request is first scheduled (its allocation: later lookups are re-checks, not new
queries). A RETRY starts the key's async clock; its resolution then also observes the async delay
(now minus the time of the first RETRY). Every counted resolution observes its own (sync) lookup
duration. HIT_PENDING is neither.
"""

from __future__ import annotations

from collections import Counter

from ..keys import LookupResult, OffloadKey

M = "vllm:kv_offload_tiering_"


class LookupMetrics:
    def __init__(self, clock) -> None:
        self.clock = clock
        # req_id -> None once allocated, else {tier label: {key: async start or None (counted)}}
        self.requests: dict[str, dict[tuple, dict[OffloadKey, float | None]] | None] = {}
        self.counters: Counter = Counter()

    def on_new_request(self, req_id: str) -> None:
        self.requests[req_id] = {}

    def on_request_allocated(self, req_id: str) -> None:
        if req_id in self.requests:
            self.requests[req_id] = None

    def on_request_finished(self, req_id: str) -> None:
        self.requests.pop(req_id, None)

    def on_lookup(self, req_id: str, key: OffloadKey, label: tuple, result: LookupResult, duration: float) -> None:
        if req_id not in self.requests:
            self.requests[req_id] = {}
        observed = self.requests[req_id]
        if observed is None:
            return
        if result in (LookupResult.HIT, LookupResult.MISS):
            seen = observed.setdefault(label, {})
            start = seen.get(key)
            if key in seen and start is None:
                return
            seen[key] = None
            self.counters[f"{M}chunk_queries:{label}"] += 1
            if result is LookupResult.HIT:
                self.counters[f"{M}chunk_hits:{label}"] += 1
            self.counters[f"{M}lookup_sync_delay_seconds:{label}_count"] += 1
            self.counters[f"{M}lookup_sync_delay_seconds:{label}_sum"] += duration
            if start is not None:
                self.counters[f"{M}lookup_async_delay_seconds:{label}_count"] += 1
                self.counters[f"{M}lookup_async_delay_seconds:{label}_sum"] += self.clock() - start
        elif result is LookupResult.RETRY:
            observed.setdefault(label, {}).setdefault(key, self.clock() - duration)

    def take(self) -> Counter:
        out, self.counters = self.counters, Counter()
        return out
