"""What vLLM's ``Scheduler.make_stats`` reports about KV-connector traffic (#22).

With ``log_stats`` and a KV connector, vLLM 0.33.0's ``SchedulerStats`` carries, beside the local
prefix-cache stats:

* ``num_kv_fetch_reqs_by_stage``: requests with an async KV load, by stage (``_kv_fetch_stages``,
  ``_set_kv_fetch_stage``): ``waiting_to_start`` when the admission look-up finds an async hit
  (and stays so while the allocation fails), ``in_progress`` once its blocks are allocated and the
  load started, ``completed_waiting`` when the worker reports it finished while the request still
  waits, and no stage once it runs or is freed;
* ``num_skipped_waiting_reqs``: the waiting requests the scan skipped since they last ran
  (``deferred_waiting``: loads in flight, lookups the connector cannot answer yet, stale output),
  which ``num_waiting_reqs`` leaves out;
* ``connector_prefix_cache_stats``: the external hits recorded when an admission's blocks are
  allocated (queries = the tokens past the local hit, hits = the external tokens; preempted
  requests apart), reset by each ``make_stats`` and flagged by a connector reset.

Pure bookkeeping over :class:`~kvref.impl.reference.scheduler_connector.ConnectorState` (no import
of it: that module imports this one).
"""

from __future__ import annotations

from typing import Iterable

from kvref.impl.request import Request

# vLLM's KV_FETCH_STAGES (vllm/v1/metrics/stats.py), in its order
KV_FETCH_WAITING_TO_START = "waiting_to_start"
KV_FETCH_IN_PROGRESS = "in_progress"
KV_FETCH_COMPLETED_WAITING = "completed_waiting"
KV_FETCH_STAGES = (KV_FETCH_WAITING_TO_START, KV_FETCH_IN_PROGRESS, KV_FETCH_COMPLETED_WAITING)

#: the connector ``PrefixCacheStats`` fields compared (``hits_by_source`` aside: the scripted
#: connector names no tier)
CONNECTOR_PREFIX_CACHE_STATS_FIELDS = ("reset", "requests", "queries", "hits", "preempted_requests",
                                       "preempted_queries", "preempted_hits")


def new_connector_prefix_cache_stats() -> dict:
    """A fresh ``PrefixCacheStats`` (all counters zero, not reset)."""
    return {f: False if f == "reset" else 0 for f in CONNECTOR_PREFIX_CACHE_STATS_FIELDS}


def set_kv_fetch_stage(st, request_id: str, stage: str | None) -> None:
    """vLLM ``_set_kv_fetch_stage``: move ``request_id`` to ``stage`` (None: out of the tally)."""
    assert stage is None or stage in KV_FETCH_STAGES, stage
    st.kv_fetch_stages.pop(request_id, None)
    if stage is not None:
        st.kv_fetch_stages[request_id] = stage


def record_connector_prefix_cache_stats(st, request: Request, num_queries: int, num_hits: int) -> None:
    """vLLM ``connector_prefix_cache_stats.record`` at admission (only for a non-zero query)."""
    s = st.connector_prefix_cache_stats
    prefix = "preempted_" if request.num_preemptions > 0 else ""
    s[prefix + "requests"] += 1
    s[prefix + "queries"] += num_queries
    s[prefix + "hits"] += num_hits


def flag_connector_reset(st) -> None:
    """A successful connector cache reset marks the stats in progress (``.reset = True``)."""
    st.connector_prefix_cache_stats["reset"] = True


def connector_stats(st, waiting_ids: Iterable[str]) -> dict:
    """The connector part of ``make_stats`` (which starts a fresh connector ``PrefixCacheStats``).

    ``waiting_ids``: every request in the waiting queues (``waiting`` and ``kv_holding_waiting``);
    a skipped request stays deferred until it runs or finishes, so the deferred ones are those
    skipped since they last ran that still wait."""
    counts = dict.fromkeys(KV_FETCH_STAGES, 0)
    for stage in st.kv_fetch_stages.values():
        counts[stage] += 1
    prefix_stats, st.connector_prefix_cache_stats = st.connector_prefix_cache_stats, new_connector_prefix_cache_stats()
    return {"num_skipped_waiting_reqs": len(st.deferred_waiting & set(waiting_ids)),
            "num_kv_fetch_reqs_by_stage": counts,
            "connector_prefix_cache_stats": prefix_stats}


def check_invariants(st, live_ids: Iterable[str]) -> None:
    """Q13: staged requests are live; the stage tally never counts a finished request."""
    live = set(live_ids)
    stray = set(st.kv_fetch_stages) - live
    assert not stray, f"Q13: KV-fetch stages of requests no longer held: {sorted(stray)}"
    assert all(v in KV_FETCH_STAGES for v in st.kv_fetch_stages.values()), \
        f"Q13: unknown KV-fetch stage in {st.kv_fetch_stages}"
    s = st.connector_prefix_cache_stats
    assert all(s[f] >= 0 for f in CONNECTOR_PREFIX_CACHE_STATS_FIELDS if f != "reset"), f"Q13: negative counter {s}"
    assert s["hits"] <= s["queries"] and s["preempted_hits"] <= s["preempted_queries"], \
        f"Q13: more connector hits than queries {s}"
