"""``kvref prove [THEOREM...] [--variant NAME]``: the Z3 theorems, as a table.

Every theorem is decided over unbounded integers; "proved" only when Z3 answers ``unsat`` for the
negated claim, a timeout is "unknown". With ``--variant`` the theorem a historic bug (or a
deliberately broken formula) breaks is re-run under it: the counterexample is printed as a
configuration and written as a ready-to-run pytest reproducer under ``--out``. Exit status is 0 only
when every theorem run is proved.
"""

from __future__ import annotations

import argparse
import json


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "prove", help="prove the KV-cache theorems with Z3 (or find counterexamples under a variant)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("theorems", nargs="*", metavar="THEOREM",
                   help="theorem ids or names (T1..T11); default: all, or the one --variant breaks")
    p.add_argument("--variant", default=None, metavar="NAME",
                   help="run under a historic / broken variant (see --list)")
    p.add_argument("--out", default="counterexamples", metavar="DIR",
                   help="where counterexample reproducer files go (default: ./counterexamples)")
    p.add_argument("--timeout", type=float, default=20.0, metavar="SECONDS",
                   help="Z3 timeout per query; a timeout is reported as 'unknown' (default 20)")
    p.add_argument("--list", action="store_true", help="list theorems and variants and exit")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    return p


def _list(as_json: bool = False) -> int:
    """Theorems and variants. The names are what one types (``--variant NAME``), so they are never
    cut: their column keeps its full width and the descriptions fold instead; ``--json`` lists the
    same for scripts."""
    from rich.console import Console
    from rich.table import Table

    from kvref.proofs import THEOREMS, VARIANTS

    if as_json:
        print(json.dumps({
            "theorems": [{"id": th.id, "name": th.name, "title": th.title} for th in THEOREMS],
            "variants": [{"name": v.name, "kind": v.kind, "breaks": v.theorem, "refs": list(v.refs)}
                         for v in VARIANTS]}, indent=2))
        return 0
    console = Console()
    t = Table(title="theorems", title_justify="left")
    t.add_column("id", no_wrap=True)
    t.add_column("name", no_wrap=True, min_width=max(len(th.name) for th in THEOREMS))
    t.add_column("title", overflow="fold")
    for th in THEOREMS:
        t.add_row(th.id, th.name, th.title)
    console.print(t)
    v = Table(title="variants (kvref prove --variant NAME)", title_justify="left")
    v.add_column("name", no_wrap=True, min_width=max(len(var.name) for var in VARIANTS))
    v.add_column("kind", overflow="fold")
    v.add_column("breaks", no_wrap=True)
    v.add_column("vLLM refs", overflow="fold")
    for var in VARIANTS:
        v.add_row(var.name, var.kind, var.theorem, ", ".join(var.refs))
    console.print(v)
    return 0


def run(args) -> int:
    from kvref.proofs import PROVED, run_all
    if args.list:
        return _list(args.json)
    from kvref.cli.arguments import check_seconds, check_writable_dir

    # inf/nan/huge used to crash converting to Z3's milliseconds, after the theorems were built
    check_seconds("--timeout", args.timeout, allow_none=False)
    if args.variant is not None:  # a variant writes reproducers: the folder is probed first
        check_writable_dir("--out", args.out)
    from kvref.progress import Progress

    what = f"theorems under variant {args.variant}" if args.variant else "theorems"
    with Progress("prove").heartbeat(f"deciding the {what} with Z3 (a timeout is reported as unknown)"):
        results = run_all(args.theorems or None, variant=args.variant, out_dir=args.out,
                          timeout_ms=int(args.timeout * 1000))
    if args.json:
        print(json.dumps([{
            "theorem": r.theorem, "name": r.name, "formulas": r.formulas, "status": r.status,
            "seconds": round(r.seconds, 3), "counterexample": r.counterexample, "failing_claim": r.failing_claim,
            "reproducer": r.reproducer,
            "lemmas": [{"claim": c.claim, "status": c.status, "seconds": round(c.seconds, 3)} for c in r.lemmas],
        } for r in results], indent=2))
    else:
        _print_table(results, args.variant)
    return 0 if all(r.status == PROVED for r in results) else 1


def _print_table(results, variant) -> None:
    from rich.console import Console
    from rich.table import Table

    style = {"proved": "green", "counterexample": "bold red", "unknown": "yellow"}
    console = Console()
    table = Table(title=f"kvref prove ({variant or 'reference'})")
    table.add_column("theorem", style="bold")
    table.add_column("result")
    table.add_column("time", justify="right")
    table.add_column("lemmas", justify="right")
    table.add_column("title", overflow="fold")
    for r in results:
        proved = sum(c.status == "proved" for c in r.lemmas)
        table.add_row(f"{r.theorem} {r.name}", f"[{style.get(r.status, '')}]{r.status}[/]", f"{r.seconds:.2f}s",
                      f"{proved}/{len(r.lemmas)}", r.title)
    console.print(table)
    console.print(f"total {sum(r.seconds for r in results):.2f}s")
    for r in results:
        if r.counterexample is not None:
            console.print(f"\n[bold red]{r.theorem} counterexample[/] (claim {r.failing_claim}):")
            console.print(r.detail, markup=False, highlight=False)
            if r.reproducer:
                console.print(f"reproducer: {r.reproducer}")
        elif r.status == "unknown":
            console.print(f"\n[yellow]{r.theorem} unknown[/]: {r.detail}")


def verify_check(ctx):
    """A ``kvref verify`` check: every theorem proved, every historic variant refuted.

    A counterexample to a theorem is a finding, and its reproducer is always written under
    ``ctx.out_dir``. The historic variants are *expected* to be refuted: their reproducers are
    written only on request (``kvref verify --write-reproducers``), so a passing run leaves nothing
    behind. Register as ``Check("proofs", ..., verify_check)``."""
    import time

    from kvref.proofs import COUNTEREXAMPLE, HISTORIC, PROVED, run_all
    from kvref.report import FAILED, PASSED, UNKNOWN, CheckResult

    start = time.perf_counter()
    results = run_all()
    for r in results:
        if r.counterexample is not None:
            from kvref.proofs import write_reproducer

            write_reproducer(r, ctx.ensure_out_dir(), None)
    details = [f"{r.theorem} {r.name}: {r.status} ({r.seconds:.2f}s)" for r in results]
    artifacts = [r.reproducer for r in results if r.reproducer]
    missed = []
    for v in HISTORIC:
        [r] = run_all(variant=v.name, out_dir=ctx.ensure_out_dir() if ctx.write_reproducers else None)
        details.append(f"variant {v.name} -> {r.theorem}: {r.status} ({r.seconds:.2f}s)")
        if r.status != COUNTEREXAMPLE:
            missed.append(v.name)
        if r.reproducer:
            artifacts.append(r.reproducer)
    seconds = time.perf_counter() - start
    not_proved = [r.theorem for r in results if r.status != PROVED]
    if any(r.status == COUNTEREXAMPLE for r in results) or missed:
        status, summary = FAILED, f"not proved: {not_proved}; variants not refuted: {missed}"
    elif not_proved:
        status, summary = UNKNOWN, f"solver gave up on {not_proved}"
    else:
        status = PASSED
        summary = (f"{len(results)} theorems proved; {len(HISTORIC)} historic bugs refuted"
                   + (" with reproducers" if ctx.write_reproducers else ""))
    return CheckResult("proofs", status, summary, seconds=seconds, details=details, artifacts=artifacts,
                       examined=len(results) + len(HISTORIC))
