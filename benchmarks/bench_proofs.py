"""Time the Z3 theorems and the counterexample search for every historic variant, in one run.

    .venv/bin/python benchmarks/bench_proofs.py            # markdown tables for BENCHMARKS.md
    .venv/bin/python benchmarks/bench_proofs.py --repeat 3 # best of 3 per item

Goals (issue 5): all theorems proved in < 30 s total; each historic counterexample found in < 5 s.
The "/ goal" columns are the measured time divided by the goal (< 1 meets it).
"""

from __future__ import annotations

import argparse
import os
import platform
import time

from kvref.proofs import HISTORIC, THEOREMS, check_bounds_needed, prove_theorem


def best_of(fn, repeat):
    best, out = None, None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, load average {load:.1f}\n")

    print("| theorem | result | lemmas | time | / 30 s goal |")
    print("|---|---|---|---|---|")
    total = 0.0
    for t in THEOREMS:
        dt, r = best_of(lambda: prove_theorem(t), args.repeat)
        total += dt
        print(f"| {t.id} {t.name} | {r.status} | {len(r.lemmas)} | {dt:.2f} s | {dt / 30:.3f} |")
    print(f"| **all** | | | **{total:.2f} s** | **{total / 30:.2f}** |\n")

    print("| variant (vLLM refs) | breaks | result | time to counterexample | / 5 s goal |")
    print("|---|---|---|---|---|")
    worst = 0.0
    for v in HISTORIC:
        dt, r = best_of(lambda: prove_theorem(v.theorem, v), args.repeat)
        worst = max(worst, dt)
        print(f"| {v.name} ({', '.join(v.refs)}) | {v.theorem} | {r.status} | {dt:.2f} s | {dt / 5:.2f} |")
    print(f"| **slowest** | | | **{worst:.2f} s** | **{worst / 5:.2f}** |\n")

    print("| needed bound (sibling) | result | time |")
    print("|---|---|---|")
    for t in THEOREMS:
        for r in check_bounds_needed(t):
            print(f"| {t.id}/{r.claim} | {r.status} | {r.seconds:.2f} s |")


if __name__ == "__main__":
    main()
