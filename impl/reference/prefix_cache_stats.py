"""Prefix-cache statistics (vLLM ``PrefixCacheStats``, ``vllm/v1/metrics/stats.py``): what the
metrics endpoint reports as prefix-cache queries and hits.

The KV cache manager keeps one object while ``log_stats`` is on. The scheduler records a request
when it is *admitted* (``record_prefix_cache_stats``: an unscheduled lookup is not counted), never
for a request that skipped the lookup (``skip_reading_prefix_cache``); ``make_prefix_cache_stats``
hands the object out and starts a fresh one; a successful ``reset_prefix_cache`` sets ``reset``.
A request preempted before counts under the ``preempted_*`` fields only, so a re-admission does
not inflate the hit rate of new requests.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvref.spec.errors import check_int


@dataclass
class PrefixCacheStats:
    """Counters since the last ``make_prefix_cache_stats`` (vLLM's fields and names).

    ``hits_by_source`` is filled only by connector stats (the tier that supplied the hits); the KV
    cache manager's own stats never fill it.
    """

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    hits_by_source: dict[str, int] = field(default_factory=dict)

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        """Count one admitted request: its tokens are the queries, its prefix-cache hit the hits."""
        check_int("num_tokens", num_tokens, minimum=0)
        check_int("num_hits", num_hits, minimum=0)
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
            return
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hits

    def to_plain(self) -> dict[str, Any]:
        """Every field, as compared across implementations."""
        return asdict(self)

    def check_invariants(self) -> None:
        assert 0 <= self.hits <= self.queries and 0 <= self.preempted_hits <= self.preempted_queries, f"K2: {self}"
        assert self.requests >= 0 and self.preempted_requests >= 0, f"K2: {self}"
