"""Explorer states/s and state-machine steps/s (BENCHMARKS.md, "Explorer and state machines").

    .venv/bin/python benchmarks/bench_models.py [--quick] [--no-vllm]

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
    from kvref.models.explorer import explore
    from kvref.models.explorer_kv import SCOPES, KVSystem
    from kvref.models.explorer_toy import ToyPool

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

    class PicklePerAction(KVSystem):  # the naive copy: pickle the source again for every action
        @staticmethod
        def _copy(s):
            t = pickle.loads(pickle.dumps(s, protocol=pickle.HIGHEST_PROTOCOL))
            t._blob = None
            t.scheduler._in_flight = {id(o): o for o in t.scheduler._in_flight.values()}
            return t

    from dataclasses import replace

    r = explore(KVSystem(replace(SCOPES["twins"], symmetry=False)))
    rows.append(("reference, scope twins (3 identical requests)", r.states, r.transitions, r.depth, r.seconds,
                 r.states_per_second))
    r = explore(KVSystem(SCOPES["twins"]))
    rows.append(("reference, scope twins, symmetry-reduced", r.states, r.transitions, r.depth, r.seconds,
                 r.states_per_second))
    from kvref.models.explorer_offload import OFFLOAD_SCOPES, OffloadSystem

    sc = OFFLOAD_SCOPES["offload"]
    r = explore(OffloadSystem(sc), max_depth=sc.max_depth, check_deadlocks=False)
    rows.append((f"reference SimpleCPU offload, depth {sc.max_depth} (bounded)", r.states, r.transitions, r.depth,
                 r.seconds, r.states_per_second))
    # copy strategies side by side: best of 3 alternating runs each on scope full
    best: dict[str, Any] = {}
    for _ in range(3):
        for label, cls in (("pickle the source once per expansion", KVSystem),
                           ("pickle the source again per action", PicklePerAction)):
            r = explore(cls(SCOPES["full"]))
            if label not in best or r.seconds < best[label].seconds:
                best[label] = r
    for label, r in best.items():
        rows.append((f"reference, scope full, {label} (best of 3)", r.states, r.transitions, r.depth, r.seconds,
                     r.states_per_second))
    return rows


def bench_machines(examples: int, with_vllm: bool) -> list[tuple]:
    from hypothesis import HealthCheck, settings
    from hypothesis.stateful import run_state_machine_as_test

    from kvref.models.block_pool_machine import make_block_pool_machine
    from kvref.models.single_type_manager_machine import CONFIGS, VLLM_CONFIGS, make_manager_machine

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
    args = ap.parse_args(argv)
    scopes = ["default"] if args.quick else ["default", "full", "large"]
    print("| system | states | transitions | depth | seconds | states/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, st, tr, d, sec, sps in bench_explorer(scopes):
        print(f"| {name} | {st:,} | {tr:,} | {d} | {sec:.2f} | {sps:,.0f} |")
    print()
    print("| machine | steps | seconds | steps/s |")
    print("|---|---:|---:|---:|")
    for label, steps, sec, sps in bench_machines(20 if args.quick else 100, not args.no_vllm):
        print(f"| {label} | {steps:,} | {sec:.2f} | {sps:,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
