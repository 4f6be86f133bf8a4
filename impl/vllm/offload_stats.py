"""vLLM's ``OffloadingConnectorStats`` merged over an interval and reduced, as its logger does (#22).

The engine gets one stats payload per step (per worker) from the offloading connector; across the
IPC hop a payload travels as its self-describing ``data`` dict and is rebuilt by the connector
class, ``OffloadingConnector.build_kv_connector_stats(data)`` (what vLLM's stats logger does).
The logger merges an interval's payloads with
``aggregate`` and reports ``reduce()``. :func:`aggregate_and_reduce` does exactly that with
vLLM's class over payloads a trace produced, merging consecutive runs first (workers' / steps'
partial sums) and then the runs, in order, so the reference's fold
(:func:`kvref.impl.reference.offload.offload_stats.reduce_steps`) can be compared with it.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence



def aggregate_and_reduce(payloads: Sequence[dict[str, Any]], cuts: Sequence[int]) -> dict[str, Any]:
    """``payloads`` (each a stats ``data`` dict, in step order) cut at ``cuts`` into runs; each run
    aggregated into a fresh stats object, then the runs into one. Returns its ``reduce()``, its
    ``info``, whether it is empty, and how many merges were of an empty payload."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    bounds = [0, *sorted(c for c in cuts if 0 < c < len(payloads)), len(payloads)]
    build = OffloadingConnector.build_kv_connector_stats
    total = build()
    empty_merges = 0
    for lo, hi in zip(bounds, bounds[1:]):
        run = build()
        run = run.aggregate(build())  # a worker with nothing to report: no change
        for data in payloads[lo:hi]:
            other = build(copy.deepcopy(data))  # rebuilt after the IPC hop
            empty_merges += other.is_empty()
            run = run.aggregate(other)
        empty_merges += run.is_empty()
        total = total.aggregate(run)
    types, values = total.metric_sections()  # what a manager walks: the payload's own sections
    return {"reduced": total.reduce(), "info": total.data.get("info"), "empty": total.is_empty(),
            "empty_merges": empty_merges,
            "sections_are_payload": types is total.data["types"] and values is total.data["data"]}


def refuses_untyped(payload: dict[str, Any], key: str, bad_type: str | None) -> tuple[bool, bool]:
    """A payload whose metric ``key`` has no type (``bad_type`` None) or an unknown one: does
    ``aggregate`` refuse it, and does ``reduce`` (AssertionError naming the key either way)?"""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

    data = copy.deepcopy(payload)
    if bad_type is None:
        data["types"].pop(key, None)
    else:
        data["types"][key] = bad_type
    refused = []
    for call in (lambda: OffloadingConnectorStats().aggregate(OffloadingConnectorStats(data=copy.deepcopy(data))),
                 lambda: OffloadingConnectorStats(data=copy.deepcopy(data)).reduce()):
        try:
            call()
        except AssertionError as exc:
            refused.append(key in str(exc))
        else:
            refused.append(False)
    return refused[0], refused[1]
