"""What the metrics endpoint / log line reports over an interval of the offloading connector's
per-step stats (vLLM ``OffloadingConnectorStats.aggregate`` then ``reduce``, #22).

vLLM's engine collects one stats payload per step (and per worker); the logger merges the payloads
of an interval with ``aggregate`` and turns the result into one number per series with ``reduce``:
a counter is the sum of the interval's increments, a gauge the *latest* value reported, a
histogram ``<name>_count`` (observations) and ``<name>_sum``. The per-step values here are the
reference scheduler's :meth:`OffloadingConnectorScheduler.get_stats` (names without the
``vllm:kv_offload_`` prefix); timing histograms hold counts there (kvref counts observations), so
only their ``_count`` is defined.
"""

from __future__ import annotations

from typing import Any, Iterable

from kvref.spec.errors import InvalidFieldError

PREFIX = "vllm:kv_offload_"

#: the kind of each metric the reference scheduler and CPU manager report
METRIC_KINDS: dict[str, str] = {
    "lookup_sync_delay_seconds": "histogram",
    "lookup_async_delay_seconds": "histogram",
    "allocation_failure": "counter",
    "cpu_cache_usage_perc": "gauge",
    "cpu_cache_write_usage_perc": "gauge",
    "cpu_cache_read_usage_perc": "gauge",
    "cpu_allocation_size": "histogram",
    "stores_skipped": "counter",
}

#: histograms of delays: the reference counts observations, it does not time them
TIMINGS = frozenset({"lookup_sync_delay_seconds", "lookup_async_delay_seconds"})


def reduce_steps(steps: Iterable[dict[str, Any]]) -> dict[str, int | float]:
    """The ``reduce`` of the ``aggregate`` of ``steps`` (in order), keyed like vLLM's (full metric
    names; histograms as ``_count``/``_sum``, timing histograms ``_count`` only). ``info`` and
    metrics outside :data:`METRIC_KINDS` are not reduced (vLLM's ``reduce`` drops ``info``)."""
    if not isinstance(steps, (list, tuple)):
        raise InvalidFieldError("steps", steps, "a list of per-step stats dicts")
    for i, step in enumerate(steps):  # all checked before anything is folded
        if not isinstance(step, dict):
            raise InvalidFieldError(f"steps[{i}]", step, "a dict of metric name -> value")
        for name, value in step.items():
            kind = METRIC_KINDS.get(name)
            number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
            if kind is None:
                continue
            if kind == "histogram" and name not in TIMINGS:
                if not isinstance(value, (list, tuple)) or not all(number(v) for v in value):
                    raise InvalidFieldError(f"steps[{i}][{name!r}]", value, "a list of observed numbers")
            elif not number(value):
                raise InvalidFieldError(f"steps[{i}][{name!r}]", value, f"a number (a {kind} value)")
    totals: dict[str, Any] = {}
    for step in steps:
        for name, value in step.items():
            kind = METRIC_KINDS.get(name)
            if kind is None:
                continue
            if kind == "counter":
                totals[name] = totals.get(name, 0) + value
            elif kind == "gauge":
                totals[name] = value
            elif name in TIMINGS:
                totals[name] = totals.get(name, 0) + value  # a count of observations
            else:
                totals.setdefault(name, []).extend(value)
    out: dict[str, int | float] = {}
    for name, value in totals.items():
        full = PREFIX + name
        if METRIC_KINDS[name] != "histogram":
            out[full] = value
        elif name in TIMINGS:
            out[f"{full}_count"] = value
        else:
            out[f"{full}_count"] = len(value)
            out[f"{full}_sum"] = sum(value)
    return out
