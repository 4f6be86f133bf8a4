"""The cost of one ``--ray`` unit that does nothing (issue #27): what a campaign pays per unit on
top of its work, to predict a campaign's time on N machines (BENCHMARKS.md, "Ray").

Starts a local Ray cluster on 127.0.0.1 (``--cpus``, default 2), runs ``--units`` no-op units
through :func:`kvref.ray_runner.run_units` (each in a fresh worker process with the driver's
Hypothesis inputs, as every ``--ray`` unit) and prints the cluster's start time, the first
unit's round trip, and the mean time per unit of the batch.

    .venv/bin/python benchmarks/bench_ray_units.py --units 20
"""

from __future__ import annotations

import argparse
import os
import time


def noop() -> int:
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--units", type=int, default=20)
    p.add_argument("--cpus", type=int, default=2)
    args = p.parse_args()
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray

    from kvref.ray_runner import Unit, loopback_only, run_units

    loopback_only(ray)
    t0 = time.perf_counter()
    ray.init(num_cpus=args.cpus, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             logging_level="warning")
    started = time.perf_counter() - t0
    t1 = time.perf_counter()
    first = run_units([Unit(0, noop)])
    one = time.perf_counter() - t1
    assert first.outcomes[0].ok
    t2 = time.perf_counter()
    run = run_units([Unit(i, noop) for i in range(args.units)])
    batch = time.perf_counter() - t2
    assert all(o.ok for o in run.outcomes)
    ray.shutdown()
    print(f"cluster start {started:.1f} s; one no-op unit {one:.2f} s; {args.units} no-op units on {args.cpus} "
          f"CPU(s) {batch:.1f} s = {batch / args.units:.2f} s per unit ({batch * args.cpus / args.units:.2f} "
          "CPU-s per unit)")


if __name__ == "__main__":
    main()
