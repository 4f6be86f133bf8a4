"""``kvref demo``: try the real-run path on a laptop, without a GPU server.

``kvref demo record OUT.kvtrace.gz`` runs vLLM's own ``Scheduler`` / ``AsyncScheduler``, selected
through ``scheduler_cls`` from kvref's recording class exactly as ``vllm serve --scheduler-cls
kvref.record.RecordingAsyncScheduler`` selects it, with a fake model on CPU (tokens drawn from
``--seed``) over a realistic workload, and writes the run trace; ``kvref check-run OUT.kvtrace.gz``
then checks it. ``--fault NAME`` plants one behaviour class into vLLM's KV-cache code for the run
(monkeypatched in this process only) so you see what a divergence, a violated property or a
crash looks like::

    kvref demo record run.kvtrace.gz --workload preemption-storm
    kvref check-run run.kvtrace.gz                      # verdict: agrees
    kvref demo record bad.kvtrace.gz --fault leak-on-refusal
    kvref check-run bad.kvtrace.gz                      # DIVERGENCE at the step the block leaks

``kvref demo campaign`` records every workload with every fault and reports what ``check-run`` and
``--properties-only`` catch (BENCHMARKS.md). ``kvref demo publish ENDPOINT`` publishes vLLM's KV
events for ``kvref watch`` (``kvref/cli/demo_publish.py``).

Exit status (record): 0 the trace was written (also when the planted fault made vLLM raise: the
trace records the crash), 2 a bad option or an unwritable path, 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import time

#: ``kvref demo`` subcommands besides ``record`` (defined here): modules with ``add_parser(sub)`` and
#: ``run(args)``, registered when present. ``publish`` (KV events for ``kvref watch``) lives in its own
#: module.
DEMO_SUBCOMMAND_MODULES = ("kvref.cli.demo_publish",)


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("demo", help="try record/check-run (and watch) on a laptop: vLLM's own scheduler, a fake "
                                    "model", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    demo_sub = p.add_subparsers(dest="demo_command", metavar="DEMO_COMMAND")
    _add_record(demo_sub)
    _add_campaign(demo_sub)
    for name in DEMO_SUBCOMMAND_MODULES:
        if importlib.util.find_spec(name) is None:
            continue
        module = importlib.import_module(name)
        q = module.add_parser(demo_sub)
        q.set_defaults(_demo_run=module.run)
    return p


def _add_record(demo_sub) -> None:
    from kvref.models.run_check.demo import WORKLOADS

    from kvref.impl.vllm.demo_faults import FAULTS  # neither module imports vLLM until a fault is planted
    from kvref.impl.vllm.record_faults import FEATURE_FAULTS

    faults = (*FAULTS, *FEATURE_FAULTS)  # the feature faults manifest on their own workload (#28)
    q = demo_sub.add_parser("record", help="record vLLM's own scheduler serving a demo workload (a fake model)",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    q.add_argument("out", metavar="OUT", help="the trace to write (*.kvtrace.gz: gzip)")
    q.add_argument("--workload", default="prefix-sharing", choices=tuple(WORKLOADS),
                   help="; ".join(f"{w.name}: {w.description}" for w in WORKLOADS.values()))
    q.add_argument("--fault", default=None, choices=faults,
                   help="plant a fault into vLLM's KV-cache code for this run: a leaked block on refused admission, "
                        "a block freed too early, a wrong hit length, a skipped preemption reset, miscounted "
                        "prefix-cache stats, a crash, one lookahead slot or MTP runway token short; or a feature "
                        "fault: " + "; ".join(f"{k} ({w}): {d}" for k, (w, d) in FEATURE_FAULTS.items()))
    mode = q.add_mutually_exclusive_group()
    mode.add_argument("--async", dest="async_scheduling", action="store_true", default=True,
                      help="RecordingAsyncScheduler: vLLM's AsyncScheduler (the default, as vLLM's)")
    mode.add_argument("--sync", dest="async_scheduling", action="store_false",
                      help="RecordingScheduler: vLLM's synchronous Scheduler (--no-async-scheduling)")
    q.add_argument("--seed", type=int, default=0, help="draws the arrivals and the fake model's tokens (default 0)")
    q.add_argument("--ticks", type=int, default=200, metavar="N",
                   help="engine iterations with arrivals; the run then drains (default 200)")
    q.add_argument("--verbose", action="store_true", help="show vLLM's own log lines")
    q.set_defaults(_demo_run=run_record)


def _add_campaign(demo_sub) -> None:
    from kvref.models.run_check.demo import WORKLOADS

    q = demo_sub.add_parser("campaign", help="record every demo workload with each planted fault and report what "
                                             "check-run and --properties-only catch",
                            description="Record every demo workload (async and sync) pristine and with each planted "
                                        "fault, check each trace with check-run (replay) and --properties-only, and "
                                        "print the detection table (BENCHMARKS.md). Exit status: 0 every crash "
                                        "caught and no false alarm on a pristine run, 1 otherwise, 2 bad option, "
                                        "130 interrupted.")
    q.add_argument("--workloads", default=None, metavar="A,B",
                   help="comma-separated workloads (default: all: " + ", ".join(WORKLOADS) + ")")
    q.add_argument("--faults", default=None, metavar="A,B", help="comma-separated faults (default: all)")
    mode = q.add_mutually_exclusive_group()
    mode.add_argument("--async-only", action="store_true", help="only RecordingAsyncScheduler runs")
    mode.add_argument("--sync-only", action="store_true", help="only RecordingScheduler runs")
    q.add_argument("--seed", type=int, default=0, help="arrivals and tokens (default 0)")
    q.add_argument("--ticks", type=int, default=200, metavar="N", help="engine iterations with arrivals (default 200)")
    q.add_argument("--json", action="store_true", help="print every run and the summary as JSON")
    q.set_defaults(_demo_run=run_campaign)


def run_campaign(args: argparse.Namespace) -> int:
    from kvref.impl.vllm.demo_faults import FAULTS
    from kvref.models.run_check.demo import WORKLOADS
    from kvref.quiet import quiet_third_party
    from kvref.spec.errors import InvalidFieldError

    def names(text, known, flag):
        if text is None:
            return None
        got = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in got if t not in known]
        if not got or bad:
            raise InvalidFieldError(flag, text, "comma-separated names among " + ", ".join(known))
        return got

    workloads = names(args.workloads, tuple(WORKLOADS), "--workloads")
    from kvref.impl.vllm.record_faults import FEATURE_FAULTS

    faults = names(args.faults, (*FAULTS, *FEATURE_FAULTS), "--faults")  # the feature faults on request (#28)
    _check_seed_ticks(args)
    modes = (True,) if args.async_only else (False,) if args.sync_only else (True, False)
    quiet_third_party(False)
    from kvref.demo_campaign import run_campaign as campaign, summarize, table, to_json

    t0 = time.perf_counter()
    rows = campaign(workloads, faults, modes, seed=args.seed, ticks=args.ticks,
                    progress=lambda text: print(f"kvref demo campaign: {text}", file=sys.stderr, flush=True))
    summary = summarize(rows)
    if args.json:
        print(to_json(rows))
    else:
        print(table(summary))
        print(f"{len(rows)} runs recorded and checked in {time.perf_counter() - t0:.0f} s")
    t = summary["total"]
    ok = (t["crashes"] == t["crashes_caught"] and not summary["false_alarms_replay"]
          and not summary["false_alarms_properties"])
    return 0 if ok else 1


def _check_seed_ticks(args: argparse.Namespace) -> None:
    from kvref.spec.errors import InvalidFieldError

    if not 0 <= args.seed < 2**32:
        raise InvalidFieldError("--seed", args.seed, "an int in [0, 2**32)")
    if not 1 <= args.ticks <= 100_000:
        raise InvalidFieldError("--ticks", args.ticks, "an int in [1, 100000]")


def run(args: argparse.Namespace) -> int:
    demo_run = getattr(args, "_demo_run", None)
    if demo_run is None:
        from kvref.spec.errors import InvalidFieldError

        raise InvalidFieldError("DEMO_COMMAND", None, "record (or publish): kvref demo record OUT.kvtrace.gz")
    return demo_run(args)


def run_record(args: argparse.Namespace) -> int:
    from kvref.cli.arguments import check_writable_dir
    from kvref.quiet import quiet_third_party
    from kvref.spec.errors import InvalidFieldError

    _check_seed_ticks(args)
    import os

    folder = os.path.dirname(os.path.abspath(args.out))
    if not args.out or os.path.isdir(args.out) or not os.path.isdir(folder):
        raise InvalidFieldError("OUT", args.out, "a trace file path in an existing folder (e.g. run.kvtrace.gz)")
    check_writable_dir("OUT", folder)
    from kvref.impl.run_trace.writer import compression_for

    try:
        compression_for(args.out)
    except InvalidFieldError as exc:
        raise InvalidFieldError("OUT", args.out, "a *.gz or uncompressed trace path (zstd is not supported)") from exc
    quiet_third_party(args.verbose)
    print(f"kvref demo record: loading vLLM and serving {args.workload!r} "
          f"({'async' if args.async_scheduling else 'sync'}, fault {args.fault or 'none'}) ...", file=sys.stderr,
          flush=True)
    from kvref.demo import record_demo

    t0 = time.perf_counter()
    run = record_demo(args.out, args.workload, args.fault, args.async_scheduling, seed=args.seed, ticks=args.ticks)
    seconds = time.perf_counter() - t0
    print(f"recorded {run.path}: workload {run.workload}, {run.schedules:,} schedule() calls, {run.requests:,} requests, "
          f"{run.num_blocks} KV cache blocks, in {seconds:.1f} s")
    print(f"scheduler: {run.scheduler_cls} (vLLM's own {'AsyncScheduler' if run.async_scheduling else 'Scheduler'}, "
          "selected through scheduler_cls as a server selects it), fake model on CPU")
    if run.fault:
        print(f"planted fault: {run.fault} (vLLM's KV-cache code monkeypatched for this run only)")
    if run.crashed:
        print(f"vLLM raised {run.crashed}: the run ended there, as a server's engine would; the trace records it")
    print(f"next: kvref check-run {run.path}")
    return 0
