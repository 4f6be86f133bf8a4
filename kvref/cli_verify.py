"""``kvref verify``: run every check with sensible defaults, show progress, print a table.

Exit status 0 only when no check failed or errored. ``--json`` prints machine-readable results,
``--junit-xml FILE`` writes a JUnit report for CI, ``--against vllm`` makes conformance against
the installed vLLM mandatory (the use case of a vLLM developer checking their own checkout),
``--mutants`` adds the mutant kill-rate campaign.
"""

from __future__ import annotations

import argparse
import sys
import time


def add_parser(sub: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    from .verify import CHECKS

    p = sub.add_parser("verify", help="run the proofs, state machines, explorer and conformance checks",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", metavar="CHECK", choices=[c.name for c in CHECKS],
                   help="run only these checks (default: all default-on checks)")
    p.add_argument("--skip", nargs="+", metavar="CHECK", default=[], choices=[c.name for c in CHECKS],
                   help="skip these checks")
    p.add_argument("--profile", choices=("fast", "ci", "nightly"), default="fast",
                   help="effort of the randomized checks (default: fast, a few minutes on a laptop)")
    p.add_argument("--against", choices=("vllm",), default=None,
                   help="make conformance against the installed vLLM mandatory (fail if it is missing)")
    p.add_argument("--mutants", action="store_true", help="also run the mutant kill-rate campaign")
    p.add_argument("--device", default=None, help="torch device for the differential check (default: cuda if present, else cpu)")
    p.add_argument("--out", default="counterexamples", help="where counterexamples and reproducers go")
    p.add_argument("--json", action="store_true", help="print results as JSON instead of a table")
    p.add_argument("--junit-xml", metavar="FILE", help="also write a JUnit XML report")
    p.add_argument("--seed", type=int, default=0, help="seed of the randomized checks (replayable)")
    return p


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .report import ERROR, to_json, render_table, write_junit_xml
    from .verify import VerifyContext, select_checks

    ctx = VerifyContext(profile=args.profile, against=args.against, device=args.device, out_dir=args.out,
                        seed=args.seed)
    checks = select_checks(only=args.only, skip=args.skip, mutants=args.mutants, against=args.against)
    console = Console(stderr=True)
    results = []
    with console.status("starting") as status:
        for i, check in enumerate(checks, 1):
            status.update(f"[{i}/{len(checks)}] {check.name}: {check.description}")
            t0 = time.perf_counter()
            try:
                result = check.run(ctx)
            except Exception as exc:  # a check that crashes is reported, the others still run
                from .report import CheckResult
                result = CheckResult(check.name, ERROR, f"{type(exc).__name__}: {exc}")
            result.seconds = time.perf_counter() - t0
            results.append(result)
            console.log(f"{check.name}: {result.status} ({result.seconds:.1f}s) {result.summary}")
    if args.junit_xml:
        write_junit_xml(results, args.junit_xml)
    if args.json:
        print(to_json(results))
    else:
        out = Console()
        out.print(render_table(results))
        for r in results:
            if r.failing:
                for line in r.details[:20]:
                    out.print(f"  {r.name}: {line}", markup=False)
                for a in r.artifacts:
                    out.print(f"  {r.name}: counterexample in {a}", markup=False)
            elif r.artifacts:
                import os

                where = sorted({os.path.dirname(a) or "." for a in r.artifacts})
                out.print(f"  {r.name}: {len(r.artifacts)} reproducer file(s) (expected: historic bugs re-found) "
                          f"in {', '.join(where)}; `kvref replay FILE` re-runs one", markup=False)
    return 1 if any(r.failing for r in results) else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run(add_parser(argparse.ArgumentParser().add_subparsers()).parse_args()))
