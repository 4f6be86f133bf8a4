"""``kvref mutants``: the mutant kill-rate campaign.

Runs the checks (spec vs proof formulas, explorer, block-pool machine, scheduler machine, manager
machines, the manager and scheduler machines paired with vLLM, proofs) against every mutant of the catalogue and prints which check killed each. Exit status 1 if the
kill rate is below ``--min-rate`` or the clean reference fails a check.

``--subset ci`` runs the CI subset (one mutant per fault family, a few minutes on 2 cores);
the default is the whole catalogue. See docs/mutants.md.

``--target vllm`` measures the other direction: source faults in the installed vLLM's own
KV-cache code (applied to an overlay copy, never to the installed files), each run through
``kvref verify --against vllm`` on the vLLM-facing checks; it reports which check caught each
fault and how fast, and exits 1 when the recall of the bug faults is below the goal (95 %, or
``--min-rate``) or a neutral refactor is flagged. ``--generated N`` runs N faults generated
mechanically from vLLM's KV-cache modules instead of the catalogue (mutation operators at sites
sampled by ``--seed``, optionally only in ``--modules``): an unbiased sample, reported apart from
the recall goal because a survivor may be an equivalent mutant (#22). See docs/vllm_mutants.md.
"""

from __future__ import annotations

import argparse


def add_parser(sub: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    p = sub.add_parser("mutants", help="mutant kill-rate campaign", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", metavar="MUTANT", help="run only these mutants")
    p.add_argument("--checks", nargs="+", metavar="CHECK",
                   help="checks to run, in order, by their kvref verify names (default: the campaign's own, "
                        "those available)")
    p.add_argument("--budget", type=int, default=100, help="examples per machine run (default 100)")
    p.add_argument("--subset", choices=("all", "ci"), default="all", help="which mutants (default all)")
    p.add_argument("--all-checks", action="store_true", help="run every check on every mutant (overlap)")
    p.add_argument("--no-proof-variants", action="store_true",
                   help="leave out the proofs' formula variants (kvref.proofs.variants)")
    p.add_argument("--min-rate", type=float, default=0.0, help="fail below this kill rate (0..1)")
    p.add_argument("--list", action="store_true", help="list the catalogue and exit")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    p.add_argument("--markdown", action="store_true", help="print a Markdown table (docs/mutants.md)")
    p.add_argument("--target", choices=("reference", "vllm"), default="reference",
                   help="mutate kvref's reference (default) or the installed vLLM's source (docs/vllm_mutants.md)")
    g = p.add_argument_group("--target vllm")
    g.add_argument("--faults", metavar="ID,...", help="run only these source faults (comma-separated ids)")
    g.add_argument("--class", dest="fault_class", metavar="CLASS,...",
                   help="run only these classes: historic, classic, neutral (comma-separated)")
    g.add_argument("--profile", choices=("fast", "ci", "nightly"), default="fast",
                   help="kvref verify profile each fault is checked with (default fast)")
    g.add_argument("--seed", type=int, default=0, help="kvref verify seed (default 0)")
    g.add_argument("--fault-timeout", type=float, default=None, metavar="S",
                   help="wall-clock limit per fault (default 300 s fast, 900 ci, 3600 nightly)")
    g.add_argument("--from-json", metavar="FILE", help="render a saved --json result instead of running")
    g.add_argument("--generated", type=int, default=None, metavar="N",
                   help="run N faults generated mechanically from vLLM's KV-cache modules (mutation operators "
                        "at sites sampled by --seed, class 'generated'; #22) instead of the catalogue")
    g.add_argument("--modules", metavar="PATH,...",
                   help="with --generated: sample only these modules (relative to the vllm package, e.g. "
                        "v1/core/block_pool.py; default: every module of kvref/data/reach_modules.toml)")
    from kvref.ray_runner import add_argument as add_ray_argument

    add_ray_argument(p)  # --ray [ADDRESS]: mutants / faults as Ray units (#27, docs/ray.md)
    return p


def _check_arguments(args: argparse.Namespace) -> None:
    """Budgets and rates bounded before anything runs (``--budget 0`` used to fail deep inside
    Hypothesis, ``--budget 10**30`` to run forever, ``--min-rate 2`` to fail every campaign)."""
    import math

    from kvref.cli.arguments import MAX_BUDGET, check_count, check_seconds
    from kvref.spec.errors import InvalidFieldError

    check_count("--budget", args.budget, minimum=1, maximum=MAX_BUDGET, why="examples per machine run")
    if not math.isfinite(args.min_rate) or not 0.0 <= args.min_rate <= 1.0:
        raise InvalidFieldError("--min-rate", args.min_rate, "a kill rate in [0, 1]")
    check_seconds("--fault-timeout", getattr(args, "fault_timeout", None))
    for flag, value in (("--generated", getattr(args, "generated", None)), ("--modules", getattr(args, "modules", None))):
        if value is not None and args.target != "vllm":  # faults generated from vLLM's source, #22
            raise InvalidFieldError(flag, value, "used with --target vllm")


def run(args: argparse.Namespace) -> int:
    import json

    _check_arguments(args)
    if args.target == "vllm":
        return run_vllm(args)

    from kvref.checks import run_mutant_campaign
    from kvref.models.mutants.catalogue import CATALOGUE, CI_SUBSET, all_mutants

    mutants = all_mutants()
    # names checked before anything, --list included (a typo used to list everything and exit 0)
    from kvref.checks import check_named
    from kvref.spec.errors import InvalidFieldError

    try:
        listed = [CATALOGUE[n] for n in args.only] if args.only else list(CATALOGUE)  # unknown: InvalidFieldError
    except InvalidFieldError as exc:  # name the flag the value came from (it said "mutant='nosuch'", issue #25)
        raise InvalidFieldError("--only", exc.value, f"a mutant name of the catalogue ({len(CATALOGUE)}; "
                                                     "kvref mutants --list names them)") from None
    for c in args.checks or ():
        try:
            check_named(c)
        except InvalidFieldError as exc:  # name the flag the value came from
            raise InvalidFieldError("--checks", c, exc.allowed) from None
    if args.list:
        if args.json:  # --json: stdout holds one JSON document, --list included
            print(json.dumps([{"name": m.name, "kind": m.kind, "layer": m.layer, "available": m.available(),
                               "description": m.description, "vllm_bug": m.vllm_bug} for m in listed]))
            return 0
        for m in listed:
            print(f"{m.name:36} {m.kind:9} {m.layer:9} {'' if m.available() else '(n/a) '}{m.description}"
                  + (f" [{m.vllm_bug}]" if m.vllm_bug else ""))
        return 0
    if args.only:
        mutants = [CATALOGUE[n] for n in args.only]
    elif args.subset == "ci":
        mutants = [m for m in mutants if m.name in CI_SUBSET]
    from kvref.progress import Progress

    progress = Progress(f"mutants ({len(mutants)})", start_after=2.0)
    done = {"n": 0, "killed": 0}

    def on_result(r) -> None:  # a line per finished mutant (stderr), once the run is a few seconds old
        done["n"] += 1
        done["killed"] += bool(r.killed)
        progress.status = (f"{done['n']} done, {done['killed']} killed; last: {r.mutant.name} "
                           + (f"killed by {r.killed_by}" if r.killed else "SURVIVED") + f" in {r.seconds:.1f} s")
        progress.update(progress.status, force=True)

    ray_errors: dict = {}
    if args.ray is not None:  # #27: the clean reference, then each mutant, as Ray units
        import sys

        from kvref.ray_mutants import run_reference_mutants
        from kvref.ray_runner import describe, start

        from kvref.ray_runner import stop

        info = start(args.ray)
        print(describe(info), file=sys.stderr, flush=True)
        try:
            res, ray_errors = run_reference_mutants(mutants, args.checks, args.budget, args.all_checks,
                                                    not args.no_proof_variants and not args.only, on_result)
        finally:
            stop(info)
    else:
        with progress.heartbeat("checking the clean reference first (every check must pass it)"):
            res = run_mutant_campaign(mutants, checks=args.checks, budget=args.budget, all_checks=args.all_checks,
                                      proof_variants=not args.no_proof_variants and not args.only,
                                      progress=on_result)
    if res.baseline_failures:
        print("the clean reference fails a check; no mutant was run:")
        for k, v in res.baseline_failures.items():
            print(f"  {k}: {v}")
        return 1
    if args.json:
        print(json.dumps({"kill_rate": res.kill_rate, "reference_kill_rate": res.reference_kill_rate,
                          "seconds": round(res.seconds, 1), "checks": res.checks,
                          "mutants": res.to_rows()}))
    elif args.markdown:
        print(res.summary() + "\n")
        print(res.to_markdown())
    else:
        print(res.render())
    if ray_errors:  # a unit whose worker died twice (or that raised) is no survivor and no pass
        import sys

        for k, v in ray_errors.items():
            print(f"error on Ray: {k}: {v}", file=sys.stderr)
        return 1
    return 0 if res.reference_kill_rate >= args.min_rate else 1


def run_vllm(args: argparse.Namespace) -> int:
    """``kvref mutants --target vllm``: the vLLM source-fault campaign (kvref.vllm_campaign)."""
    import json
    import sys

    from kvref.models.mutants.vllm_source.catalogue import FAULTS
    from kvref.spec.errors import InvalidFieldError
    from kvref.vllm_campaign import RECALL_GOAL, VLLM_CHECKS, CampaignResult, run_campaign, select_faults

    if args.from_json is not None:
        from kvref.cli.input import read_json

        data = read_json("--from-json", args.from_json, "saved --json result")
        if not isinstance(data, dict):
            raise InvalidFieldError("--from-json", args.from_json, "a saved --json result (a JSON object at top "
                                                                   f"level, not {type(data).__name__})")
        try:
            res = CampaignResult.from_dict(data, FAULTS)  # generated faults: rebuilt from their rows
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:  # a field of the wrong shape
            raise InvalidFieldError("--from-json", args.from_json,
                                    f"a saved --json result ({type(exc).__name__}: {exc})") from None
        return _print_vllm_result(res, args, RECALL_GOAL)
    import math

    if args.fault_timeout is not None and not (math.isfinite(args.fault_timeout) and args.fault_timeout > 0):
        raise InvalidFieldError("--fault-timeout", args.fault_timeout, "a positive number of seconds")
    if not (math.isfinite(args.min_rate) and 0.0 <= args.min_rate <= 1.0):
        raise InvalidFieldError("--min-rate", args.min_rate, "a rate between 0 and 1")
    if args.seed < 0:
        raise InvalidFieldError("--seed", args.seed, "an int >= 0")
    def split(flag: str, value: str | None) -> list[str] | None:
        items = [x.strip() for x in value.split(",") if x.strip()] if value is not None else None
        if items == []:  # '' or ',' named no fault: not "every fault" (a campaign of hours)
            raise InvalidFieldError(flag, value, "one or more comma-separated names (kvref mutants --target vllm --list)")
        return items

    if args.modules is not None and args.generated is None:
        raise InvalidFieldError("--modules", args.modules, "used with --generated N")
    pool = list(FAULTS)
    if args.generated is not None:  # #22: the unbiased sample; --seed picks it (and seeds verify)
        from kvref.cli.arguments import check_count
        from kvref.vllm_campaign import generated_faults

        check_count("--generated", args.generated, minimum=1, maximum=10_000, why="generated faults")
        generated = generated_faults(args.generated, args.seed, split("--modules", args.modules))
        pool = generated if args.faults is None and args.fault_class is None else pool + generated
    faults = select_faults(pool, split("--faults", args.faults), split("--class", args.fault_class))
    if args.list:
        if args.json:
            print(json.dumps([{"id": f.id, "kind": f.kind, "path": f.path, "description": f.description,
                               "bug": f.bug} for f in faults]))
            return 0
        for f in faults:
            print(f"{f.id:40} {f.kind:8} {f.path:58} {f.description}" + (f" [{f.bug}]" if f.bug else ""))
        return 0
    if not faults:
        print("no fault selected", file=sys.stderr)
        return 2
    quiet = args.json or args.markdown
    if args.ray is not None:  # #27: each fault as a Ray unit
        from kvref.ray_mutants import run_vllm_faults
        from kvref.ray_runner import describe, start

        from kvref.ray_runner import stop

        info = start(args.ray)
        print(describe(info), file=sys.stderr if quiet else sys.stdout, flush=True)
        try:
            res = run_vllm_faults(faults, tuple(args.checks) if args.checks else VLLM_CHECKS, args.profile,
                                  args.seed, args.fault_timeout,
                                  lambda line: print(line, file=sys.stderr if quiet else sys.stdout, flush=True))
        finally:
            stop(info)
        return _print_vllm_result(res, args, RECALL_GOAL)
    res = run_campaign(faults, checks=tuple(args.checks) if args.checks else VLLM_CHECKS, profile=args.profile,
                       seed=args.seed, timeout=args.fault_timeout, progress=lambda line: print(line, file=sys.stderr if quiet else sys.stdout, flush=True))
    return _print_vllm_result(res, args, RECALL_GOAL)


def _print_vllm_result(res, args: argparse.Namespace, goal: float) -> int:
    import json

    if args.json:
        print(json.dumps(res.to_dict()))
    elif args.markdown:
        print(res.summary() + "\n")
        print(res.summary_markdown() + "\n")
        print(res.to_markdown())
    else:
        print(res.render())
    return 0 if res.ok(args.min_rate or goal) else 1

