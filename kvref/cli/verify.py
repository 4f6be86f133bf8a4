"""``kvref verify``: run every check with sensible defaults, show progress, print a table.

Exit status 0 only when no check failed or errored. ``--json`` prints machine-readable results,
``--junit-xml FILE`` writes a JUnit report for CI, ``--against vllm`` makes conformance against
the installed vLLM mandatory (the use case of a vLLM developer checking their own checkout),
``--mutants`` adds the mutant kill-rate campaign. ``--reach [DIR]`` measures which of vLLM's KV-cache
code the checks executed and ``--changed-since REF`` which functions of a change they ran
(docs/reach.md): a stale reach exclusion or a changed function no check ran is exit 1.

Exit status: 0 every check passed (or was skipped/unknown/accepted), 1 a check failed or errored,
2 bad input (an unwritable ``--out``/``--junit-xml``, a broken ``--baseline``, ...; checked before
any check runs), 130 interrupted. On Ctrl-C the check running is stopped (the Z3 proofs too), and
the table, ``--json`` and ``--junit-xml`` reports are still written, with ``"interrupted": true``
and the checks that did finish.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def add_parser(sub: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    from ..checks import CHECKS

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
    p.add_argument("--baseline", metavar="FILE",
                   help="findings accepted on purpose (a deliberate vLLM change): they no longer fail, and the "
                        "generated-trace checks keep searching past them for new ones")
    p.add_argument("--update-baseline", metavar="FILE",
                   help="write this run's findings into FILE (kept entries and their reasons stay)")
    p.add_argument("--write-reproducers", action="store_true",
                   help="also write the reproducers of the expected historic refutations (proofs)")
    p.add_argument("--shrink-seconds", type=float, default=None, metavar="S",
                   help="bound on shrinking one failing example (default: 15 fast, 45 ci, 300 nightly)")
    p.add_argument("-x", "--exitfirst", action="store_true", help="stop after the first failing check")
    p.add_argument("--split", type=int, default=1, metavar="N",
                   help="run each check with an example budget as N seed ranges (1/N of its examples each, "
                        "distinct deterministic seeds), merged into its row; with --ray a unit each (#27, docs/ray.md)")
    p.add_argument("--jobs", choices=("auto", "1", "2"), default="auto",
                   help="2: the checks that draw no Hypothesis constants (kvref.checks.AHEAD) run in a second "
                        "process beside the others, same inputs, same report; 1: every check in this process, "
                        "one after the other; auto (default): 2 where there are 2+ cores and the load average "
                        "is below the core count, else 1")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also show vLLM's, transformers' and torch's own log lines and warnings (quiet by default)")
    from ..reach import add_arguments as add_reach_arguments

    add_reach_arguments(p)  # --reach [DIR], --reach-exclusions, --changed-since (#22)
    from ..ray_runner import add_argument as add_ray_argument

    add_ray_argument(p)  # --ray [ADDRESS]: the checks as Ray units (#27, docs/ray.md)
    return p


def checked_meta(checks) -> dict:
    """What this run checked, for every report: kvref's version and, when a selected check drives
    vLLM, the installed vLLM (version, path, git commit — any version; kvref models 0.33.0)."""
    from kvref import VLLM_VERSION, __version__
    from kvref.impl.vllm.api import CHECK_AREAS

    meta: dict = {"kvref": {"version": __version__, "models_vllm": VLLM_VERSION}}
    if any(c.name in CHECK_AREAS for c in checks):
        from kvref.impl.vllm.installed import describe_installed_vllm

        meta["vllm"] = describe_installed_vllm().to_dict()
    return meta


def jobs_for(jobs: str) -> tuple[int, str]:
    """``--jobs``: 1 or 2, and ``auto``: 2 where a second process finds a core; with the line that
    says why (auto only). On a machine whose load average already reaches its core count the second
    process only shares the cores the first one had (session 17, load 4-6 on 2 cores: 9 % less
    wall, and the first failing check of a planted vLLM fault came later, 52 s against 23 s), so
    auto is 1 there."""
    if jobs != "auto":
        return int(jobs), ""
    cpus = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # not on this platform
        load = 0.0
    n = 2 if cpus >= 2 and load < cpus else 1
    return n, f"--jobs auto: {cpus} CPU(s), load average {load:.2f} -> {n} process(es)"


def check_arguments(args: argparse.Namespace) -> None:
    """Everything the run will write or wait for, checked before the first check runs (an
    unwritable report path used to fail after every check had run, and lose the results)."""
    from .arguments import check_seconds, check_writable_dir, check_writable_file

    check_writable_dir("--out", args.out)
    if args.junit_xml is not None:
        check_writable_file("--junit-xml", args.junit_xml)
    if args.update_baseline is not None:
        check_writable_file("--update-baseline", args.update_baseline)
    check_seconds("--shrink-seconds", args.shrink_seconds)
    from .arguments import check_count

    check_count("--split", getattr(args, "split", 1), minimum=1, maximum=1024, why="seed ranges per check")
    from ..reach import check_arguments as check_reach_arguments

    check_reach_arguments(args)
    from ..baseline import Baseline

    if args.baseline is not None:
        Baseline.load(args.baseline)
    if args.update_baseline is not None and os.path.exists(args.update_baseline):
        Baseline.load(args.update_baseline)  # merged into after the run: a broken one fails now, not then


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .arguments import JsonStdout
    from ..report import ERROR, CheckResult, to_json, render_table, write_junit_xml
    from ..check_context import VerifyContext
    from ..checks import select_checks
    from ..verify import run_check

    from ..baseline import Baseline

    check_arguments(args)
    ctx = VerifyContext(profile=args.profile, against=args.against, device=args.device, out_dir=args.out,
                        seed=args.seed, write_reproducers=args.write_reproducers, shrink_seconds=args.shrink_seconds)
    baseline = Baseline.load(args.baseline) if args.baseline is not None else Baseline()
    from .. import reach as reach_mod

    only = args.only or (reach_mod.default_checks() if reach_mod.enabled(args) else None)
    checks = select_checks(only=only, skip=args.skip, mutants=args.mutants, against=args.against)
    if not checks:  # a run of nothing said "ok" with exit 0 (issue #25)
        from kvref.spec.errors import InvalidFieldError

        raise InvalidFieldError("--skip", args.skip, "a selection that leaves at least one check to run "
                                                     f"(--only {' '.join(args.only or ['(defaults)'])} less --skip is empty)")
    from ..quiet import progress_console, quiet_third_party

    quiet_third_party(args.verbose)  # before any check imports vLLM
    console = progress_console()
    results = []
    interrupted = None  # the check that was running when Ctrl-C came
    json_out = JsonStdout(args.json)
    reach = reach_mod.ReachSession(args) if reach_mod.enabled(args) else None  # coverage.py around the checks
    ray_info = None
    if getattr(args, "ray", None) is not None:  # #27: connect and probe the workers before any check
        from kvref.spec.errors import InvalidFieldError

        if reach is not None:
            raise InvalidFieldError("--ray", args.ray, "a run without --reach/--changed-since (coverage is measured "
                                                       "in this process)")
        from ..ray_runner import describe, start

        ray_info = start(args.ray)
        console.log(describe(ray_info), markup=False)
    if reach is not None:
        reach.start()
    def log_row(result) -> None:
        console.log(f"{result.name}: {result.status} ({result.seconds:.1f}s) {result.summary}", markup=False)
        if result.failing:
            for line in [*result.details[:3], *(f"counterexample: {a}" for a in result.artifacts[:1])]:
                console.log(f"  {line}", markup=False)

    with json_out, console.status("starting") as status:
        split = getattr(args, "split", 1)
        if ray_info is not None and split > 1:  # #27: each check as seed-range units
            from ..ray_split import run_split_on_ray

            status.update(f"{len(checks)} check(s) in {split} seed ranges each on Ray")
            results, interrupted = run_split_on_ray(checks, ctx, baseline, bool(args.update_baseline), args.exitfirst,
                                                    split, lambda line: console.log(line, markup=False))
        elif ray_info is not None:
            from ..ray_verify import run_verify

            status.update(f"{len(checks)} check(s) on Ray")
            results, interrupted = run_verify(checks, ctx, baseline, bool(args.update_baseline), args.exitfirst,
                                              lambda line: console.log(line, markup=False))
        ahead = None  # #22: the checks kvref.checks.AHEAD names run in a second process meanwhile
        jobs, why = jobs_for(getattr(args, "jobs", "1")) if ray_info is None and split == 1 and reach is None \
            else (1, "")
        from ..checks import AHEAD

        if why and 0 < sum(c.name in AHEAD for c in checks) < len(checks):  # said where it decides something
            console.log(why, markup=False)
        if jobs > 1:
            from ..verify_ahead import run_verify_ahead, start_ahead

            def early(result) -> None:  # a finding is said when it is made; its row comes in order
                console.log(f"{result.name}: {result.status} ({result.seconds:.1f}s) {result.summary} "
                            "(said now; its row follows in the checks' order)", markup=False)

            ahead = start_ahead(checks, ctx, args.baseline, bool(args.update_baseline), args.verbose, early,
                                args.exitfirst)
        if ahead is not None:
            def run_here(check):
                return run_check(check, ctx, baseline, collect=bool(args.update_baseline))

            def started(i, check):
                status.update(f"[{i}/{len(checks)}] {check.name}: {check.description}")
                if not sys.stderr.isatty():
                    console.log(f"[{i}/{len(checks)}] {check.name}: started", markup=False)

            def report(result) -> bool:
                for note in ahead.notes:
                    console.log(f"second process: {note}", markup=False)
                ahead.notes.clear()
                log_row(result)
                return result.failing and args.exitfirst

            results, interrupted = run_verify_ahead(checks, ahead, run_here, report, started, early)
            if interrupted is not None:
                console.log(f"{interrupted.name}: interrupted; {len(checks) - len(results)} check(s) not run; "
                            "writing the partial report", markup=False)
        for i, check in enumerate(checks if ray_info is None and ahead is None else (), 1):
            status.update(f"[{i}/{len(checks)}] {check.name}: {check.description}")
            if not sys.stderr.isatty():  # no spinner in a CI log: say what is running
                console.log(f"[{i}/{len(checks)}] {check.name}: started", markup=False)
            t0 = time.perf_counter()
            if reach is not None:
                reach.enter(check.name)
            try:
                if split > 1:  # #27: the check as N seed ranges, merged (kvref.ray_split)
                    from ..ray_split import run_split

                    result = run_split(check, ctx, baseline, bool(args.update_baseline), split)
                else:
                    result = run_check(check, ctx, baseline, collect=bool(args.update_baseline))
            except KeyboardInterrupt:
                from .interrupt import acknowledge

                acknowledge()  # taken: the partial report is written, not interrupted again
                interrupted = CheckResult(check.name, ERROR, "interrupted (Ctrl-C) before it finished",
                                          seconds=time.perf_counter() - t0)
                results.append(interrupted)
                console.log(f"{check.name}: interrupted; {len(checks) - i} check(s) not run; writing the "
                            "partial report", markup=False)
                break
            results.append(result)
            log_row(result)
            if result.failing and args.exitfirst:
                break
    not_run = [c.name for c in checks[len(results):]] if interrupted else []
    if ray_info is not None:
        from ..ray_runner import stop

        stop(ray_info)  # cancelled units are rows of their own; the report names the workers
        not_run = [r.name for r in results if r is not interrupted and r.summary.startswith("interrupted")]
    if args.update_baseline and interrupted is None:
        from kvref.impl.vllm.installed import describe_installed_vllm

        where = describe_installed_vllm().describe() if "vllm" in checked_meta(checks) else ""
        old = Baseline.load(args.update_baseline) if os.path.exists(args.update_baseline) else Baseline()
        new = old.with_findings(results, where)
        new.save(args.update_baseline)
        console.log(f"baseline {args.update_baseline}: {len(new.entries) - len(old.entries)} finding(s) added, "
                    f"{len(new.entries)} in all; write the reason of each before committing it")
    if reach is not None:  # the reach (and changed-since) rows, after the baseline: they are no findings
        if interrupted is None:
            results += reach.finish(results)
        else:
            reach.abort()
    if interrupted is None:
        meta = checked_meta(checks)
    else:  # a partial report says so, and what did not run; vLLM is described only if it was used
        meta = {**checked_meta(checks[:len(results)]), "interrupted": True, "not_run": not_run}
    if ray_info is not None:
        meta["ray"] = ray_info
    if args.junit_xml:
        write_junit_xml(results, args.junit_xml, meta)
    if reach is not None and reach.meta:  # every module and function: JSON only (the rows carry the figure)
        meta["reach"] = reach.meta
    if args.json:
        json_out.emit(to_json(results, meta))
    else:
        out = Console()
        vllm = meta.get("vllm")
        caption = None
        if vllm:
            from kvref.impl.vllm.installed import VllmInstall

            fields = {k: v for k, v in vllm.items() if k in VllmInstall.__dataclass_fields__}
            caption = "checked against " + VllmInstall(**fields).describe()
        out.print(render_table(results, caption=caption))
        if ray_info is not None:
            from ..ray_runner import describe

            out.print(describe(ray_info), markup=False)
        if reach is not None:
            reach.print_tables(out)
        for r in results:
            if r.failing:
                for line in r.details[:20]:
                    out.print(f"  {r.name}: {line}", markup=False)
                for a in r.artifacts:
                    out.print(f"  {r.name}: counterexample in {a}", markup=False)
            elif r.artifacts:

                where = sorted({os.path.dirname(a) or "." for a in r.artifacts})
                out.print(f"  {r.name}: {len(r.artifacts)} reproducer file(s) (expected: historic bugs re-found) "
                          f"in {', '.join(where)}; `kvref replay FILE` re-runs one", markup=False)
        if interrupted is not None:
            out.print(f"INTERRUPTED during {interrupted.name}: partial results; not run: "
                      f"{', '.join(not_run) or 'none'}", markup=False)
    if interrupted is not None:
        args.report_written = True
        raise KeyboardInterrupt  # kvref.cli.main: exit 130, after the partial reports are written
    if any(r.failing for r in results):
        return 1
    from ..report import nothing_checked

    if nothing_checked(results):  # every check skipped: nothing was examined, never "clean" (issue #25)
        from kvref.cli import EXIT_NOTHING_CHECKED

        print(f"NOTHING CHECKED: every selected check was skipped (exit {EXIT_NOTHING_CHECKED})",
              file=sys.stderr if args.json else sys.stdout)
        return EXIT_NOTHING_CHECKED
    return 0


if __name__ == "__main__":  # pragma: no cover - ``kvref verify`` itself: the same checks and exit statuses
    from kvref.cli import main

    sys.exit(main(["verify", *sys.argv[1:]]))
