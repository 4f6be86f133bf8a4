"""The offloading connector's metrics over an interval: vLLM's ``aggregate`` + ``reduce`` of a
trace's per-step stats payloads vs the reference's fold of its own per-step stats (#22).

Per step, conform-offload-worker already compares vLLM's stats with the reference's. What the
metrics endpoint and the log line report is the merge of an interval of them: counters summed,
gauges the latest, histograms concatenated (``_count``/``_sum``), the config ``info`` kept from
the last payload that carried one and never cleared by a later payload without. Here the trace's
payloads are merged with vLLM's class, in runs cut at random points (per-worker / per-interval
partial merges) and then run by run, and the reduced numbers must equal
:func:`~kvref.impl.reference.offload.offload_stats.reduce_steps` over the reference's steps; a
payload whose metric has no type, or an unknown one, must be refused by both calls.
"""

from __future__ import annotations

import random
from typing import Any, Sequence

from kvref.impl.reference.offload.offload_stats import METRIC_KINDS, PREFIX, TIMINGS, reduce_steps


def _vllm_view(reduced: dict[str, Any], compared: set[str]) -> dict[str, Any]:
    out = {}
    for name in compared:
        full = PREFIX + name
        for key in (full, f"{full}_count", *(() if name in TIMINGS else (f"{full}_sum",))):
            if key in reduced:
                out[key] = reduced[key]
    return out


def compare_interval(ref_steps: Sequence[dict[str, Any]], payloads: Sequence[dict[str, Any]],
                     compared: set[str], rng: random.Random) -> str | None:
    """None when vLLM's merged, reduced stats equal the reference's fold; else the difference."""
    from kvref.impl.vllm.offload_stats import aggregate_and_reduce, refuses_untyped

    compared = set(compared) & set(METRIC_KINDS)
    cuts = rng.sample(range(1, max(2, len(payloads))), min(3, max(0, len(payloads) - 1)))
    got = aggregate_and_reduce(payloads, cuts)
    want = {k: v for k, v in reduce_steps(ref_steps).items()
            if any(k in (PREFIX + n, f"{PREFIX}{n}_count", f"{PREFIX}{n}_sum") for n in compared)}
    mine = _vllm_view(got["reduced"], compared)
    if mine != want:
        keys = sorted(set(mine) | set(want))
        diff = {k: (want.get(k), mine.get(k)) for k in keys if want.get(k) != mine.get(k)}
        return f"the interval's reduced stats differ (reference, vLLM) over {len(payloads)} payloads cut at {cuts}: {diff}"
    if not got["sections_are_payload"]:
        return "metric_sections() does not return the merged payload's own type and value sections"
    infos = [p.get("info") for p in payloads if p.get("info") is not None]
    if got["info"] != (infos[-1] if infos else None):
        return f"the merged config info is {got['info']!r}, the last payload's that carried one is {infos[-1:]!r}"
    empty = not any(p.get("data") or p.get("info") is not None for p in payloads)
    if got["empty"] != empty:
        return f"the merged stats report is_empty={got['empty']} over payloads {'all' if empty else 'not all'} empty"
    with_data = [p for p in payloads if p.get("data")]
    if with_data:
        payload = rng.choice(with_data)
        key = rng.choice(sorted(payload["data"]))
        bad = rng.choice((None, "summary"))
        refused = refuses_untyped(payload, key, bad)
        if refused != (True, True):
            return (f"a payload whose metric {key} has {'no type' if bad is None else 'type ' + bad!r} was "
                    f"{'accepted' if not refused[0] else 'refused'} by aggregate and "
                    f"{'accepted' if not refused[1] else 'refused'} by reduce (both must refuse it, naming it)")
    return None
