"""What vLLM's metrics endpoint reports, computed from scheduling decisions (issue #28).

vLLM's ``update_from_output`` returns a ``SchedulerStats`` per step (``make_stats()``, shown by the
metrics endpoint and the periodic log): ``kv_cache_usage`` (``1 - free / (num_blocks - 1)``: the
null block is never usable) and the ``PrefixCacheStats`` gathered since the previous stats —
``requests``/``queries``/``hits`` for fresh admissions, ``preempted_*`` for resumed requests. A
request counts once, *at admission* (``Scheduler.schedule``: "Record at admission so unscheduled
lookups are not counted"): ``queries`` is its token count then (``request.num_tokens``), ``hits``
its local prefix-cache hit (``num_computed_tokens`` before the step), and only when prefix caching
is on. The reference's KV cache manager has no stats of its own, so they are computed here from
the reference's decisions (the replay) or from the recorded ones (the run properties).
"""

from __future__ import annotations

from collections import Counter


def usage(num_free: int, num_blocks: int) -> float:
    """vLLM ``BlockPool.get_usage``: the share of usable blocks (the null block excluded) not free."""
    total = num_blocks - 1
    return 0.0 if total <= 0 else 1.0 - num_free / total


def hit_before_replay(window: int, num_computed_tokens: int) -> int:
    """The local prefix hit behind a fresh admission that starts at ``num_computed_tokens`` under
    SWA bounded replay (a replay window of ``window`` tokens, 0: none; no KV connector): vLLM counts
    the hit as found (``record_prefix_cache_stats(request, num_new_local_computed_tokens)`` runs on
    the count ``_mark_prefix_replay`` did not rewind), and a kept hit is longer than the window, so
    it is the start plus the window; a dropped hit (no longer than the window) counted 0 and the
    request starts at 0 (#28, session 20)."""
    from kvref.spec.errors import check_int

    check_int("window", window, minimum=0)
    check_int("num_computed_tokens", num_computed_tokens, minimum=0)
    return num_computed_tokens + window if window and num_computed_tokens else num_computed_tokens


class PrefixCacheTally:
    """Prefix-cache stats since the last ``update_from_output`` (vLLM ``PrefixCacheStats``)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.counts: Counter = Counter()

    def admitted(self, resumed: bool, num_tokens: int, num_hit_tokens: int) -> None:
        """A request left the waiting queue with ``num_hit_tokens`` computed from the cache."""
        if not self.enabled:
            return
        prefix = "p" if resumed else ""
        c = self.counts
        c["preq" if resumed else "req"] += 1
        c[prefix + "q"] += num_tokens
        c[prefix + "h"] += num_hit_tokens

    def take(self) -> dict:
        """The stats an ``update_from_output`` reports, and a fresh start (``make_prefix_cache_stats``)."""
        out = {k: self.counts.get(k, 0) for k in ("req", "q", "h", "preq", "pq", "ph")}
        self.counts = Counter()
        return out


def compare_stats(recorded: dict, expected: dict, keys=("req", "q", "h", "preq", "pq", "ph")) -> list[str]:
    """The keys where a recorded ``stats`` object differs from the expected one, as ``key: a != b``."""
    return [f"{k}: recorded {recorded[k]}, expected {expected[k]}" for k in keys
            if k in recorded and k in expected and recorded[k] != expected[k]]


def usage_differs(recorded: float, expected: float) -> bool:
    return abs(float(recorded) - expected) > 1e-9
