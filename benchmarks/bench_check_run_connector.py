"""What ``kvref check-run`` and ``--properties-only`` catch on generated KV-connector runs (issue #28).

``record DIR``: for each planted fault (the demo faults of ``kvref/impl/vllm/demo_faults.py`` but
``short-lookahead``, which needs a drafter, plus ``unfenced-free``: vLLM's
``_request_blocks_can_be_freed`` always yes, i.e. ``defer_block_free``'s step fence ignored) and
pristine, record ``--examples`` generated connector runs of vLLM's own scheduler
(``models/run_check/connector_runs.py``, seed 2) into ``DIR/<fault>``.

``check DIR``: check every recorded run (the machine's known vLLM hangs and lost updates left out)
with replay and with ``--properties-only``; print per fault the runs and how many each flags. Run it
with ``PYTHONPATH`` pointing at an older kvref tree to measure that checker on the same traces.

    .venv/bin/python benchmarks/bench_check_run_connector.py record /tmp/conn --examples 40
    .venv/bin/python benchmarks/bench_check_run_connector.py check /tmp/conn
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
from collections import Counter


def record(root: str, examples: int) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvref.impl.vllm.demo_faults import FAULTS, plant
    from kvref.models.run_check.connector_runs import record_connector_runs

    shutil.rmtree(root, ignore_errors=True)
    for fault in ("pristine", "unfenced-free") + tuple(f for f in FAULTS if f != "short-lookahead"):
        d = os.path.join(root, fault)
        if fault == "unfenced-free":
            orig = Scheduler._request_blocks_can_be_freed
            Scheduler._request_blocks_can_be_freed = lambda self, request: True
            try:
                runs = record_connector_runs(d, examples, seed=2, strict=False)
            finally:
                Scheduler._request_blocks_can_be_freed = orig
        else:
            with plant(None if fault == "pristine" else fault):
                runs = record_connector_runs(d, examples, seed=2, strict=False)
        with open(os.path.join(d, "skip.txt"), "w") as f:
            f.writelines(os.path.basename(r.path) + "\n" for r in runs if r.known_hang or r.lost_update)


def check(root: str) -> None:
    from kvref.models.run_check import check_trace

    print("| fault | runs | check-run (replay) | --properties-only |\n|---|---:|---:|---:|")
    for d in sorted(glob.glob(os.path.join(root, "*"))):
        skip = set(open(os.path.join(d, "skip.txt")).read().split())
        c: Counter = Counter()
        for p in sorted(glob.glob(os.path.join(d, "*.kvtrace.gz"))):
            if os.path.basename(p) in skip:
                continue
            r = check_trace(p)
            if r.empty:
                continue
            c["runs"] += 1
            c["replay"] += not r.ok
            c["props"] += not check_trace(p, properties_only=True).ok
        print(f"| {os.path.basename(d)} | {c['runs']} | {c['replay']} | {c['props']} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("record", "check"))
    ap.add_argument("root")
    ap.add_argument("--examples", type=int, default=40)
    a = ap.parse_args()
    from kvref.quiet import quiet_third_party

    quiet_third_party(False)
    record(a.root, a.examples) if a.what == "record" else check(a.root)


if __name__ == "__main__":
    main()
