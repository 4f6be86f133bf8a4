"""``kvref replay FILE``: replay a saved KV-cache-manager trace against implementations side by side.

A trace (``"format": "kvref-trace"``, see :mod:`kvref.models.trace`) is what the conformance state
machine saves when two implementations disagree or one breaks an invariant. Replaying it applies
the same ops to fresh managers of ``--kinds`` (default ``reference,vllm``; ``reference`` alone
needs no vLLM) and prints the first divergence. Exit status: 0 no divergence, 1 divergence.
"""

from __future__ import annotations

import argparse


def add_parser(sub: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    p = sub.add_parser("replay", help="replay a saved trace against reference/vLLM/torch side by side",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", metavar="FILE", help="trace JSON saved by a failing state-machine run")
    p.add_argument("--kinds", default="reference,vllm",
                   help="comma-separated implementations: reference, vllm, torch (default: reference,vllm)")
    p.add_argument("--verbose", "-v", action="store_true", help="print every op as it is applied")
    return p


def run(args: argparse.Namespace) -> int:
    from kvref.impl.interface import manager_kinds
    from kvref.models.differential import Divergence, Harness
    from kvref.models.trace import Trace
    from kvref.spec.errors import InvalidFieldError

    kinds = [k for k in args.kinds.split(",") if k]
    for k in kinds:
        if k not in manager_kinds():
            raise InvalidFieldError("--kinds", k, "one of " + ", ".join(manager_kinds()))
    trace = Trace.load(args.trace)
    h = Harness(trace.pool_config, kinds)
    try:
        for i, op in enumerate(trace.ops):
            res = h.apply(op)
            if args.verbose:
                print(f"#{i:3d} {op}{'  (skipped)' if res.skipped else ''}")
    except Divergence as exc:
        print(f"DIVERGENCE ({','.join(kinds)}): {exc}")
        return 1
    print(f"OK: {len(trace.ops)} ops ({h.num_skipped} skipped) on {','.join(kinds)}: no divergence, "
          "all invariants hold")
    return 0
