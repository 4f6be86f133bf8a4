"""``kvref verify --reach [DIR]`` and ``--changed-since REF``: which of vLLM's KV-cache code the
checks executed, and what a developer's change was checked by (issue #22). See docs/reach.md.

The pieces: the module list (:mod:`kvref.reach_modules`), coverage.py around the checks
(:mod:`kvref.reach_collect`), the per-module/function figures and the exclusions
(:mod:`kvref.reach_report`, :mod:`kvref.reach_exclusions`), the diff of the user's checkout
(:mod:`kvref.reach_changes`). This module wires them into ``kvref verify``:

* without ``--only``, ``--reach`` runs the default vLLM-facing checks (the others never run vLLM);
* the figure and the changed-since verdict are two more rows of the results (``reach``,
  ``changed-since``), so the table, ``--json`` and ``--junit-xml`` carry them, and the JSON's
  ``"reach"`` key carries every module and function;
* ``reach`` fails when an exclusion is stale or a listed glob matches nothing (the figure would be
  wrong); ``changed-since`` fails when a changed function was never executed and is not excluded
  ("kvref did not check this change"): a change nothing checked is not a passed check.
"""

from __future__ import annotations

import argparse
import json
import os

from .report import FAILED, PASSED, SKIPPED, CheckResult

#: where ``--reach`` writes its reports when no folder is given
DEFAULT_DIR = "kvref-reach"
REACH = "reach"
CHANGED = "changed-since"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reach", nargs="?", const=DEFAULT_DIR, default=None, metavar="DIR",
                   help="measure which of the installed vLLM's KV-cache code the checks execute (coverage.py, "
                        f"branch mode): per module and function in the table and --json, HTML in DIR (default "
                        f"{DEFAULT_DIR}/); without --only, runs the default vLLM-facing checks")
    p.add_argument("--reach-exclusions", metavar="FILE", default=None,
                   help="the reviewed exclusion file (default: kvref's own, kvref/data/reach_exclusions.toml)")
    p.add_argument("--changed-since", metavar="REF", default=None,
                   help="with the installed vLLM in a git checkout: list every KV-cache function `git diff REF` "
                        "touches and whether, how often and under which check it ran (implies --reach)")


def enabled(args: argparse.Namespace) -> bool:
    return getattr(args, "reach", None) is not None or getattr(args, "changed_since", None) is not None


def check_arguments(args: argparse.Namespace) -> None:
    """Before any check runs: coverage.py installed, DIR writable, the exclusion file valid, vLLM
    located (not imported) and, for ``--changed-since``, in a git checkout where REF is a commit."""
    if not enabled(args):
        if getattr(args, "reach_exclusions", None) is not None:
            from kvref.spec.errors import InvalidFieldError

            raise InvalidFieldError("--reach-exclusions", args.reach_exclusions, "given with --reach or "
                                    "--changed-since")
        return
    from kvref.spec.errors import InvalidFieldError

    from .cli.arguments import check_writable_dir
    from .reach_exclusions import load_exclusions
    from .reach_modules import resolve_modules

    try:
        import coverage  # noqa: F401
    except ImportError as exc:
        raise InvalidFieldError("--reach", args.reach or DEFAULT_DIR, f"coverage.py installed ({exc})") from None
    if args.reach is None:
        args.reach = DEFAULT_DIR
    check_writable_dir("--reach", args.reach)
    load_exclusions(args.reach_exclusions)
    root = resolve_modules().root  # vLLM located (not imported)
    if args.changed_since is not None:
        from .reach_changes import checkout_of

        checkout_of(root, args.changed_since)


def default_checks() -> list[str]:
    """The checks ``--reach`` runs without ``--only``: the default vLLM-facing ones."""
    from .checks import vllm_checks

    return list(vllm_checks(default_only=True))


class ReachSession:
    """coverage.py around ``kvref verify``'s checks, and the reports after them."""

    def __init__(self, args: argparse.Namespace) -> None:
        from .reach_collect import CallCounter, ReachCollector
        from .reach_exclusions import load_exclusions
        from .reach_modules import resolve_modules

        self.out_dir = args.reach
        self.profile = args.profile
        self.modules = resolve_modules()
        self.exclusions = load_exclusions(args.reach_exclusions)
        self.plan = None
        if args.changed_since is not None:
            from .reach_changes import plan_changes

            self.plan = plan_changes(args.changed_since, self.modules.root, self.modules.by_rel())
        self.collector = ReachCollector(self.modules.files, os.path.join(self.out_dir, "data"))
        self.counter = CallCounter(self.plan.call_targets() if self.plan else {})
        self.checks: list[str] = []
        self.meta: dict = {}
        self._modules_report: list = []
        self._figure: dict = {}

    def start(self) -> None:
        self.collector.start()
        self.counter.start()

    def enter(self, check: str) -> None:
        self.checks.append(check)
        self.collector.enter(check)
        self.counter.enter(check)

    def abort(self) -> None:
        """Stop measuring (an interrupted run reports no reach: it would understate it)."""
        self.counter.stop()
        self.collector.stop()

    def finish(self, results: list[CheckResult]) -> list[CheckResult]:
        """Stop, write DIR's reports, return the ``reach`` (and ``changed-since``) rows; the JSON
        part is :attr:`meta`. When every check of ``results`` was skipped the rows are skipped too:
        a run that examined nothing stays "nothing checked" (exit 3), whatever the figure."""
        import time

        from .reach_report import (
            apply_exclusions,
            figure,
            figure_line,
            listing_markdown,
            modules_from_json,
            write_reports,
        )

        t0 = time.perf_counter()
        self.counter.stop()
        cov = self.collector.stop()
        raw = write_reports(cov, self.modules.files, self.out_dir)
        modules = modules_from_json(raw, self.modules.by_rel())
        stale = apply_exclusions(modules, self.exclusions)
        fig = figure(modules)
        self._modules_report, self._figure = modules, fig
        listing = os.path.join(self.out_dir, "functions.md")
        with open(listing, "w", encoding="utf-8") as fh:
            fh.write(listing_markdown(modules, fig, stale))
        self.meta = {
            "figure": fig, "line": figure_line(fig), "profile": self.profile, "checks": self.checks,
            "vllm_root": self.modules.root, "unmatched_globs": list(self.modules.unmatched),
            "imported_before_measurement": [self.modules.rel(f) for f in self.collector.imported_before],
            "stale_exclusions": [s.to_dict() for s in stale],
            "html": os.path.join(self.out_dir, "html", "index.html"),
            "functions_html": os.path.join(self.out_dir, "html", "function_index.html"),
            "listing": listing,
            "modules": [m.to_dict() for m in modules],
        }
        problems = [f"stale exclusion {s.module} {s.function}: {s.problem}" for s in stale]
        problems += [f"module glob {g} matches no file of this vLLM" for g in self.modules.unmatched]
        summary = figure_line(fig) + f"; per function: {listing}, HTML: {self.meta['html']}"
        rows = [CheckResult(REACH, FAILED if problems else PASSED,
                            (f"{len(problems)} problem(s) with the reach lists; " if problems else "") + summary,
                            details=problems)]
        if self.plan is not None:
            from .reach_changes import fill_results
            from .reach_changes import summary as changed_summary

            changed = fill_results(self.plan, modules, self.counter)
            missed, text = changed_summary(changed)
            self.meta["changed_since"] = {"ref": self.plan.ref, "commit": self.plan.commit, "checkout": self.plan.top,
                                          "not_checked": missed, "functions": [c.to_dict() for c in changed]}
            rows.append(CheckResult(CHANGED, FAILED if missed else PASSED, f"since {self.plan.ref}: {text}",
                                    details=[f"{c.module}:{c.name or '<module level>'} (line {c.first_line}, "
                                             f"changed {_ranges(c.changed_lines)}): {c.verdict()}"
                                             for c in changed]))
        with open(os.path.join(self.out_dir, "reach.json"), "w", encoding="utf-8") as fh:
            json.dump(self.meta, fh, indent=1)
        nothing_ran = all(r.status == SKIPPED for r in results)
        for r in rows:
            r.seconds = time.perf_counter() - t0
            if nothing_ran:
                r.status, r.summary = SKIPPED, f"no check ran, nothing measured: {r.summary}"
        return rows

    def print_tables(self, console) -> None:
        """The per-module table and the changed functions, under ``kvref verify``'s table."""
        from .reach_report import render_modules_table

        if not self._modules_report:
            return
        console.print(render_modules_table(self._modules_report, self._figure))
        changed = self.meta.get("changed_since")
        if changed:
            from rich.table import Table

            table = Table(title=f"changes since {changed['ref']} ({changed['commit'][:12]})")
            table.add_column("module (vllm/…)", overflow="fold")
            table.add_column("function", overflow="fold")
            table.add_column("changed lines", overflow="fold")
            table.add_column("verdict", overflow="fold")
            for c in changed["functions"]:
                style = "green" if c["checked"] else ("yellow" if c["excluded"] else "bold red")
                table.add_row(c["module"].removeprefix("vllm/"), c["function"], _ranges(c["changed_lines"]),
                              f"[{style}]{c['verdict']}[/]")
            console.print(table)


def _ranges(lines: list[int]) -> str:
    """``[3, 4, 5, 9]`` -> ``3-5, 9``."""
    out: list[str] = []
    for ln in sorted(lines):
        if out and ln == int(out[-1].split("-")[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{ln}"
        else:
            out.append(str(ln))
    return ", ".join(out) or "-"
