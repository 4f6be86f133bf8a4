"""Explorer states/s and state-machine steps/s (BENCHMARKS.md, "Explorer and state machines").

    .venv/bin/python benchmarks/bench_models.py [--quick] [--no-vllm] [--explorer-only]
    .venv/bin/python benchmarks/bench_models.py --workers [N ...]   # one process vs N workers
    .venv/bin/python benchmarks/bench_models.py --breakdown   # where a state's time goes; the ceiling

Everything is measured in one run on the same machine, so the ratios between rows are the
figures to read (absolute numbers depend on the machine and its load).
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import time
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the machines call reset_prefix_cache on busy pools


def bench_explorer(scopes: list[str]) -> list[tuple]:
    from kvref.models.explorer.engine import explore
    from kvref.models.explorer.kv import SCOPES, KVSystem
    from kvref.models.explorer.toy import ToyPool

    explore(KVSystem(SCOPES["tight"]))  # warm-up: imports and first-use caches stay out of the timings
    rows = []
    toy = ToyPool(num_blocks=40, needs=(3, 3, 3, 2, 2, 4, 5), preempt=True, symmetry=False)
    r = explore(toy)
    rows.append(("toy pool (7 requests, 40 blocks)", r.states, r.transitions, r.depth, r.seconds, r.states_per_second))
    r = explore(ToyPool(num_blocks=40, needs=(3, 3, 3, 2, 2, 4, 5), preempt=True, symmetry=True))
    rows.append(("toy pool, symmetry-reduced", r.states, r.transitions, r.depth, r.seconds, r.states_per_second))
    for name in scopes:
        r = explore(KVSystem(SCOPES[name]))
        rows.append((f"reference, scope {name}", r.states, r.transitions, r.depth, r.seconds, r.states_per_second))

    from dataclasses import replace

    r = explore(KVSystem(replace(SCOPES["twins"], symmetry=False)))
    rows.append(("reference, scope twins (3 identical requests)", r.states, r.transitions, r.depth, r.seconds,
                 r.states_per_second))
    r = explore(KVSystem(SCOPES["twins"]))
    rows.append(("reference, scope twins, symmetry-reduced", r.states, r.transitions, r.depth, r.seconds,
                 r.states_per_second))
    from kvref.models.explorer.simple_cpu import OFFLOAD_SCOPES, OffloadSystem

    sc = OFFLOAD_SCOPES["offload"]
    r = explore(OffloadSystem(sc), max_depth=sc.max_depth, check_deadlocks=False)
    rows.append((f"reference SimpleCPU offload, depth {sc.max_depth} (bounded)", r.states, r.transitions, r.depth,
                 r.seconds, r.states_per_second))
    from kvref.models.explorer.simple_cpu import explore_offload

    r = explore_offload("offload-lazy")
    assert r.complete
    rows.append(("reference SimpleCPU offload, scope offload-lazy (every state)", r.states, r.transitions, r.depth,
                 r.seconds, r.states_per_second))
    from kvref.models.explorer.offloading_connector import explore_connector

    r = explore_connector("connector")
    rows.append(("reference OffloadingConnector, scope connector, depth 9 (bounded)", r.states, r.transitions,
                 r.depth, r.seconds, r.states_per_second))
    r = explore_connector("connector-complete")
    assert r.complete
    rows.append(("reference OffloadingConnector, scope connector-complete (every state)", r.states, r.transitions,
                 r.depth, r.seconds, r.states_per_second))
    rows += bench_before_after(["default", "full", "large", "twins"] if "large" in scopes else ["default", "full"])
    return rows


class _GcUntouched:
    """Stands in for the ``gc`` module inside the engine: thresholds stay at Python's defaults."""

    def __init__(self) -> None:
        import gc

        self._gc = gc

    def get_threshold(self):
        return self._gc.get_threshold()

    def set_threshold(self, *args) -> None:
        pass


def _before_system():
    """The explorer as it was before issue 6's speed-ups, for side-by-side rows in one run.

    Copies by pickling the whole state (steps in flight and shadow contents included, no shared
    configs) once per expansion and unpickling it for *every* action (no in-place last step),
    and keys states with the former ``_key`` (every part recomputed for each renaming).
    """
    from kvref.models.explorer.kv import KVSystem

    class Before(KVSystem):
        step_consuming = None  # the engine then copies for the last action too

        def _copy(self, s):
            blob = s._blob
            if blob is None:
                blob = s._blob = pickle.dumps(s, protocol=pickle.HIGHEST_PROTOCOL)
            t = pickle.loads(blob)
            t._blob = None
            t.scheduler._in_flight = {id(o): o for o in t.scheduler._in_flight.values()}
            return t

        def key(self, s):
            if not self.perms:
                return self._old_key(s, None)
            return min((self._old_key(s, ren) for ren in self.perms), key=repr)

        def _old_key(self, s, ren):
            sched = s.scheduler
            kv = sched.kv_cache_manager.manager
            pool = kv.block_pool
            n = (lambda rid: rid) if ren is None else ren.__getitem__
            arrived = s.arrived if ren is None else tuple(
                s.arrived[self.ids.index(old)] for old in sorted(ren, key=lambda o: self.ids.index(ren[o])))
            reqs = tuple(sorted(
                (n(rid), r.status.value, r.num_computed_tokens, r.num_in_flight_tokens, r.num_output_placeholders,
                 r.num_stale_output_tokens, bool(getattr(r, "drop_stale_output", False)), len(r.output_token_ids),
                 r.num_preemptions, bool(getattr(r, "is_prefill_chunk", False)))
                for rid, r in sched.requests.items()))
            index = tuple(sorted(
                (k, (v.block_id,) if not isinstance(v, dict) else tuple(v))
                for k, v in pool.cached_block_hash_to_block._cache.items()))
            managers = tuple(
                (tuple(sorted((n(rid), tuple(b.block_id for b in tbl)) for rid, tbl in m.req_to_blocks.items())),
                 tuple(sorted((n(rid), c) for rid, c in m.num_cached_block.items())))
                for m in kv.coordinator.single_type_managers)
            flight = tuple(tuple((n(x.request_id), x.num_scheduled_tokens, x.num_computed_tokens,
                                  x.is_prefill_chunk) for x in out.scheduled) for out in s.in_flight)
            content = tuple(sorted(s.content.items()))
            return (arrived, tuple(n(r.request_id) for r in sched.waiting),
                    tuple(n(r.request_id) for r in sched.running), reqs, pool.free_block_ids(), index, managers,
                    flight, content)

    return Before


def bench_before_after(scopes: list[str], repeats: int = 3) -> list[tuple]:
    """Before/after rows per scope: best of ``repeats`` alternating runs each (one process)."""
    from dataclasses import replace

    from kvref.models.explorer import engine
    from kvref.models.explorer.kv import SCOPES, KVSystem

    before_cls = _before_system()
    rows = []
    for name in scopes:
        variants = [(name, SCOPES[name])]
        if name == "twins":
            variants = [("twins, no symmetry", replace(SCOPES[name], symmetry=False)),
                        ("twins, symmetry-reduced", SCOPES[name])]
        for label, scope in variants:
            best: dict[str, Any] = {}
            for _ in range(repeats):
                real_gc = engine.gc
                engine.gc = _GcUntouched()  # type: ignore[assignment]
                try:
                    rb = engine.explore(before_cls(scope))
                finally:
                    engine.gc = real_gc
                ra = engine.explore(KVSystem(scope))
                assert (rb.states, rb.transitions, rb.depth) == (ra.states, ra.transitions, ra.depth)
                for tag, r in (("before", rb), ("after", ra)):
                    if tag not in best or r.seconds < best[tag].seconds:
                        best[tag] = r
            for tag in ("before", "after"):
                r = best[tag]
                rows.append((f"reference, scope {label}: {tag} (best of {repeats})", r.states, r.transitions,
                             r.depth, r.seconds, r.states_per_second))
    return rows


def bench_workers(scopes: list[str], workers: list[int], repeats: int = 3) -> list[tuple]:
    """One process vs the parallel search (``explore(..., workers=N)``): best of ``repeats``
    alternating runs each, same states asserted. The rows say how many CPUs the machine has."""
    from kvref.models.explorer.engine import explore
    from kvref.models.explorer.kv import SCOPES, KVSystem
    from kvref.models.explorer.search import resolve_workers

    cpus = resolve_workers("auto")
    rows = []
    for name in scopes:
        best: dict[int, Any] = {}
        for _ in range(repeats):
            for w in [1] + workers:
                r = explore(KVSystem(SCOPES[name]), workers=w)
                if w in best:
                    assert (r.states, r.transitions) == (best[w].states, best[w].transitions)
                if w not in best or r.seconds < best[w].seconds:
                    best[w] = r
        for w in [1] + workers:
            r = best[w]
            label = "1 process" if w == 1 else f"{w} workers"
            rows.append((f"reference, scope {name}: {label} on {cpus} CPUs (best of {repeats})", r.states,
                         r.transitions, r.depth, r.seconds, r.states_per_second))
    return rows


def bench_breakdown(scopes: list[str], repeats: int = 3) -> list[tuple]:
    """Where one process spends a state's time (issue 6's 20,000 states/s), per KV scope: the
    reference's own calls (``Scheduler.schedule`` / ``update_from_output`` / ``add_request`` /
    ``finish_requests``, timed as ``_step`` minus the oracles), the content oracle, the invariant
    checks (``check``: every ``check_invariants()`` + the window oracle), copies, keys, and the
    rest (the engine). ``ceiling`` is states/s if copies, keys and the engine cost nothing: the
    reference + its checks alone. Best of ``repeats`` runs (by total seconds)."""
    import time

    from kvref.models.explorer.engine import explore
    from kvref.models.explorer.kv import SCOPES, KVSystem

    clock = time.perf_counter
    explore(KVSystem(SCOPES["tight"]))  # warm-up: imports and first-use caches stay out of the timings
    rows = []
    for name in scopes:
        best = None
        for _ in range(repeats):
            system = KVSystem(SCOPES[name])
            acc = dict.fromkeys(("step", "oracle", "check", "copy", "key"), 0.0)

            def timed(fn, part):
                def run(*a):
                    t = clock()
                    try:
                        return fn(*a)
                    finally:
                        acc[part] += clock() - t
                return run
            system._step = timed(system._step, "step")
            system._write_and_check_hits = timed(system._write_and_check_hits, "oracle")
            system._drop_free_content = timed(system._drop_free_content, "oracle")
            system.check = timed(system.check, "check")
            system._copy = timed(system._copy, "copy")
            system.key = timed(system.key, "key")
            r = explore(system)
            if best is None or r.seconds < best[0].seconds:
                best = (r, dict(acc))
        r, acc = best
        n = r.states
        reference = acc["step"] - acc["oracle"]
        us = {k: 1e6 * v / n for k, v in acc.items()}
        rest = 1e6 * r.seconds / n - us["step"] - us["check"] - us["copy"] - us["key"]
        rows.append((name, n, r.transitions, r.seconds, r.states_per_second, 1e6 * reference / n, us["oracle"],
                     us["check"], us["copy"], us["key"], rest, n / (reference + acc["oracle"] + acc["check"])))
    return rows


def bench_machines(examples: int, with_vllm: bool) -> list[tuple]:
    from hypothesis import HealthCheck, settings
    from hypothesis.stateful import run_state_machine_as_test

    from kvref.models.machines.block_pool import make_block_pool_machine
    from kvref.models.machines.single_type_manager import CONFIGS, VLLM_CONFIGS, make_manager_machine

    cfg = settings(max_examples=examples, stateful_step_count=30, derandomize=True, database=None, deadline=None,
                   suppress_health_check=list(HealthCheck))
    runs = [("block pool: reference", lambda: make_block_pool_machine("reference")),
            ("manager (hybrid): reference", lambda: make_manager_machine(CONFIGS[2]))]
    if with_vllm:
        import vllm  # noqa: F401 - import cost outside the timing

        runs += [("block pool: reference vs vLLM", lambda: make_block_pool_machine("reference", "vllm")),
                 ("manager (hybrid): reference vs vLLM", lambda: make_manager_machine(VLLM_CONFIGS[1], "reference", "vllm"))]
    rows = []
    for label, make in runs:
        machine = make()
        t0 = time.perf_counter()
        run_state_machine_as_test(machine, settings=cfg)
        dt = time.perf_counter() - t0
        rows.append((label, machine.steps, dt, machine.steps / dt))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--explorer-only", action="store_true", help="skip the state-machine rows")
    ap.add_argument("--workers", type=int, nargs="*", default=None, metavar="N",
                    help="only the one-process vs N-worker explorer rows (default N: 2 and the CPU count)")
    ap.add_argument("--breakdown", action="store_true",
                    help="only where one process spends a state's time, per scope (and the ceiling)")
    args = ap.parse_args(argv)
    if args.breakdown:
        print("| scope | states | transitions | seconds | states/s | reference µs/state | content oracle | "
              "checks | copies | key | engine | ceiling: reference + checks alone, states/s |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for name, st, tr, sec, sps, ref, orc, chk, cp, key, rest, ceil in bench_breakdown(
                ["default", "full", "large"]):
            print(f"| {name} | {st:,} | {tr:,} | {sec:.2f} | {sps:,.0f} | {ref:.0f} | {orc:.0f} | {chk:.0f} | "
                  f"{cp:.0f} | {key:.0f} | {rest:.0f} | {ceil:,.0f} |")
        return 0
    if args.workers is not None:
        from kvref.models.explorer.search import resolve_workers

        counts = sorted(set(args.workers or [2, resolve_workers("auto")]) - {1})
        print("| system | states | transitions | depth | seconds | states/s |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, st, tr, d, sec, sps in bench_workers(["full", "large"], counts):
            print(f"| {name} | {st:,} | {tr:,} | {d} | {sec:.2f} | {sps:,.0f} |")
        return 0
    scopes = ["default"] if args.quick else ["default", "full", "large"]
    print("| system | states | transitions | depth | seconds | states/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, st, tr, d, sec, sps in bench_explorer(scopes):
        print(f"| {name} | {st:,} | {tr:,} | {d} | {sec:.2f} | {sps:,.0f} |")
    if args.explorer_only:
        return 0
    print()
    print("| machine | steps | seconds | steps/s |")
    print("|---|---:|---:|---:|")
    for label, steps, sec, sps in bench_machines(20 if args.quick else 100, not args.no_vllm):
        print(f"| {label} | {steps:,} | {sec:.2f} | {sps:,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
