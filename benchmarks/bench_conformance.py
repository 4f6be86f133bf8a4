"""Steps/s of the KV-cache-manager conformance machine: reference alone, vLLM alone, the pairing.

Every row runs the same generator with the same budget (derandomized, so a row is reproducible;
Hypothesis seeds it from the machine's name, so rows see different traces of the same kind):

    .venv/bin/python benchmarks/bench_conformance.py [--examples 200] [--steps 40] [--torch]

Columns: steps (rule executions = ops), wall seconds of the whole Hypothesis run, steps/s, and the
seconds spent inside each implementation (its calls, ``check_invariants`` and observation).
"""

from __future__ import annotations

import argparse
import gc
import os
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def run(kinds: tuple[str, ...], examples: int, steps: int) -> dict:
    from hypothesis import HealthCheck, settings
    from hypothesis.stateful import run_state_machine_as_test

    from kvref.models.machines.kv_cache_manager import kv_cache_manager_machine

    group_sets = ("fa", "fa+fa", "fa+swa", "fa+chunked", "fa+swa+swa", "swa", "fa+mamba")
    machine = kv_cache_manager_machine(kinds, group_sets=group_sets, eagle=False)
    t = time.perf_counter()
    run_state_machine_as_test(machine, _min_steps=min(steps - 1, 31), settings=settings(
        max_examples=examples, stateful_step_count=steps, derandomize=True, database=None, deadline=None,
        suppress_health_check=list(HealthCheck)))
    dt = time.perf_counter() - t
    st = machine.stats
    return dict(kinds="+".join(kinds), steps=st.ops_applied, seconds=dt, harness=st.seconds_in_harness,
                inside={k: round(v, 2) for k, v in st.seconds_by_kind.items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=200)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--torch", action="store_true", help="also run reference+torch")
    args = ap.parse_args()
    from kvref.impl.vllm.kv_cache_manager import _vllm

    _vllm()  # import vLLM before timing anything
    gc.collect()
    rows = [("reference",), ("vllm",), ("reference", "vllm")]
    if args.torch:
        rows.append(("reference", "torch"))
    results = [run(k, args.examples, args.steps) for k in rows]
    print("| implementations | steps | seconds | steps/s | steps/s in the harness | seconds inside each |")
    print("|---|---:|---:|---:|---:|---|")
    for r in results:
        print(f"| {r['kinds']} | {r['steps']:,} | {r['seconds']:.1f} | {r['steps'] / r['seconds']:,.0f} | "
              f"{r['steps'] / r['harness']:,.0f} | {r['inside']} |")


if __name__ == "__main__":
    main()
