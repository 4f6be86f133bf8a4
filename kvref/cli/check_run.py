"""``kvref check-run TRACE``: check a recorded vLLM run against the reference, step by step.

TRACE is what vLLM wrote with a kvref recording scheduler (``vllm serve MODEL --scheduler-cls
kvref.record.RecordingAsyncScheduler`` with ``KVREF_RECORD=run.kvtrace.gz``; docs/record.md).
The reference scheduler and KV cache manager are rebuilt from the trace's header and replayed in
lock step: every step's batch, token counts, computed tokens and block ids per group compared with
what vLLM did (and the encoder inputs a multimodal run encodes and evicts; multimodal items, LoRA
adapters, lookahead block hashes and the Mamba shared-prefix checkpoint are replayed). The first
divergence is shown as a step table (recorded vs reference) and written
under ``--out`` as a trace of its own that reproduces it (``kvref check-run`` on that file).

Properties of the run itself are checked even where the reference cannot follow (a feature it
does not model, a newer vLLM, ``--properties-only``): no starvation while requests wait, blocks
conserved per step (free + held = pool, blocks a KV connector keeps and deferred frees counted), no
block reused while a request still needs it, hits that hold their own tokens, admission within the
startup bound, tables that cover each step (an EAGLE drafter's lookahead slots included), metrics
that agree with the trace, block ids within the pool, nothing scheduled against a pause state
(``set_pause_state`` is recorded and replayed), prefill chunks that leave a multi-module MTP
drafter's runway (``num_prefill_lookahead``), finishes that follow vLLM's ``check_stop`` rules
over the recorded tokens (EOS, stop ids, ``max_tokens`` / ``max_model_len``, repetition detection
past ``min_tokens``: recorded since format 5, and replayed). A summary (steps, requests, preemptions,
prefix-cache hit rate, longest wait) closes the report.

A run in which vLLM raised (an ``error`` record: the recorder writes the exception, the step and the
call's inputs before it propagates) is a CRASH finding: the reference replays up to it and says
whether it raises too or what it would have done instead. A trace without an ``end`` record (the
server was killed) is checked up to its last complete record and reported INCOMPLETE, and a trace
with no schedule step is EMPTY: neither is ever "agrees" (``--live`` checks a trace still being
written: then a missing end record is expected).

Exit status: 0 the run agrees (or, where the reference could not follow, its properties hold),
1 a divergence, a violated property, a crash or an incomplete trace, 2 the trace cannot be read
(not a trace, a newer format, a broken record: the file and line are named), 3 nothing checked
(an empty trace), 130 interrupted. The report and its one verdict line go to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("check-run", help="check a recorded vLLM run (--scheduler-cls kvref.record...) against "
                                         "the reference", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", metavar="TRACE", help="a run trace (*.kvtrace.gz) written by a kvref recording scheduler")
    p.add_argument("--properties-only", action="store_true",
                   help="do not replay on the reference; check the run properties alone (e.g. a vLLM far from 0.33.0)")
    p.add_argument("--out", default="counterexamples",
                   help="where the reproducer of a divergence goes (default: counterexamples/)")
    p.add_argument("--starvation-steps", type=int, default=3, metavar="N",
                   help="idle schedule calls in a row (nothing runs, nothing in flight, requests wait) reported "
                        "as starvation (default: 3)")
    p.add_argument("--live", action="store_true",
                   help="the trace is still being written (the server runs): a missing end record is expected, "
                        "not reported as INCOMPLETE")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


#: preemption reasons (the trace's ``pre_why``) as the summary shows them
_WHY = {"kv": "for KV blocks", "reset_prefix_cache": "by reset_prefix_cache", "unrecorded": "reason not recorded"}


def _summary_table(s: dict) -> str:
    fin = ", ".join(f"{k} {v}" for k, v in sorted(s["finished"].items())) or "none"
    rows = [
        ("steps", f"{s['steps']:,}"),
        ("requests", f"{s['requests']:,} ({fin}; {s['still_live']} live at the end)"),
        ("preemptions", f"{s['preemptions']:,} ({s['resumes']:,} resumed"
                        + "".join(f"; {n:,} {_WHY.get(why, why)}"
                                  for why, n in sorted(s.get("preemption_reasons", {}).items()))
                        + ")"),
        ("prefix-cache hit rate", f"{100 * s['prefix_hit_rate']:.1f} % of new prompt tokens "
                                  f"({s['prefix_hits']:,} requests hit)"),
        ("longest wait", f"{s['longest_wait_steps']:,} steps ({s['longest_wait_request'] or '-'})"),
        ("peak running", f"{s['peak_running']}"),
        ("peak blocks held", f"{s['peak_blocks_held']:,} of {s['num_blocks'] - 1:,}"),
        ("scheduled tokens", f"{s['scheduled_tokens']:,}"),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"| {k:<{w}} | {v} |" for k, v in rows)


def _reproducer(trace: str, out: str, divergence, write) -> str:
    """``OUT/<run>-divergence-step<N>.kvtrace.gz``, the run's name without a ``-divergence-stepN``
    of its own: checking a reproducer named ``run-divergence-step9-divergence-step9`` (issue #25).
    A reproducer checked in place is its own reproducer (not rewritten while it is read)."""
    import re

    base = re.sub(r"(-divergence-step\d+)+$", "", os.path.basename(trace).split(".")[0]) or "run"
    path = os.path.join(out, f"{base}-divergence-step{divergence.step}.kvtrace.gz")
    if os.path.abspath(path) == os.path.abspath(trace):
        return trace
    return write(trace, divergence, path)


def run(args: argparse.Namespace) -> int:
    from kvref.models.run_check import check_trace, write_reproducer
    from kvref.models.run_check.properties import PROPERTY_NAMES
    from kvref.spec.errors import InvalidFieldError

    if args.starvation_steps < 1:
        raise InvalidFieldError("--starvation-steps", args.starvation_steps, "an int >= 1")
    if not os.path.isfile(args.trace):
        raise InvalidFieldError("TRACE", args.trace, "an existing trace file")
    from kvref.cli.arguments import check_writable_dir

    check_writable_dir("--out", args.out)  # a divergence's reproducer goes there: checked before the replay
    t0 = time.perf_counter()
    result = check_trace(args.trace, properties_only=args.properties_only, starvation_steps=args.starvation_steps,
                         live=args.live)
    seconds = time.perf_counter() - t0
    reproducer = None
    if result.divergence is not None:
        os.makedirs(args.out, exist_ok=True)
        reproducer = _reproducer(args.trace, args.out, result.divergence, write_reproducer)
    if args.json:
        out = result.to_json()
        out["seconds"] = round(seconds, 3)
        out["reproducer"] = reproducer
        print(json.dumps(out, indent=1))
        return _exit_status(result)
    h = result.header
    prod = h.get("producer") or {}
    s = result.setup.scheduler
    print(f"kvref check-run {args.trace}: vLLM {result.setup.vllm_version}, {prod.get('scheduler_cls', '?')}, "
          f"{h['pool']['num_blocks']} blocks, {len(h['pool']['groups'])} KV cache group(s) "
          f"({', '.join(g['spec']['type'] for g in h['pool']['groups'])}), "
          f"{'async' if s.get('async_class') else 'sync'} scheduling")
    for note in result.notes:
        print(f"note: {note}")
    if result.incomplete:
        print(f"INCOMPLETE: the trace has no end record ({result.truncation}): the recording process was killed "
              "or still runs (--live); checked up to its last complete record")
    elif result.truncated:
        print(f"note: the trace is still being written ({result.truncation}); checked up to its last complete record")
    if result.empty:
        print("EMPTY: the trace holds no schedule() step: nothing was checked")
    if result.crash is not None:
        print(result.crash.text())
    if result.divergence is not None:
        print("DIVERGENCE: vLLM did what the reference would not have done")
        print(result.divergence.table())
        print(f"reproducer: {reproducer} (kvref check-run {reproducer})")
    elif result.crash is not None:
        print(f"reference: agreed on all {result.steps_compared:,} steps before the crash")
    elif result.followed:
        extra = ", free blocks, metrics" if h.get("version", 1) >= 3 else ""
        if h.get("connector") is not None:  # format 4: the connector's questions and answers too
            extra += ", every KV-connector question and answer"
        print(f"reference: agrees on all {result.steps_compared:,} steps (batch, token counts, computed tokens, "
              f"block ids per group, preemptions, finishes{extra})")
    else:
        where = f" from trace line {result.stopped_at_line}" if result.stopped_at_line > 1 else ""
        print(f"reference: cannot follow this run{where}: {result.stopped_because}; agreed on "
              f"{result.steps_compared:,} steps before that; the run properties are checked to the end")
    if result.num_findings:
        print(f"PROPERTIES: {result.num_findings} violation(s)")
        for f in result.findings:
            print(f"  [{f.kind}] step {f.step} (line {f.line}): {f.message}")
        if result.num_findings > len(result.findings):
            print(f"  ... {result.num_findings - len(result.findings)} more")
    else:
        checks = str(result.summary.get("block_checks", "on"))
        order = str(result.summary.get("free_order_check", "on"))
        print("properties: " + ", ".join(PROPERTY_NAMES)
              + ("" if checks == "on" else f" (conservation, reuse, hit content and the admission bound {checks})")
              + ("" if order == "on" else f" (free-queue order {order})"))
    print(_summary_table(result.summary))
    rate = result.records / seconds if seconds > 0 else 0.0
    print(f"checked {result.records:,} records in {seconds:.1f} s ({rate:,.0f} records/s)")
    print(f"verdict: {result.verdict}")  # one verdict, one stream (issue #25)
    return _exit_status(result)


def _exit_status(result) -> int:
    """0 clean, 1 a finding (a crash, a divergence, a property, a killed run), 3 nothing checked."""
    from kvref.cli import EXIT_FINDINGS, EXIT_NOTHING_CHECKED, EXIT_OK

    if result.ok:
        return EXIT_OK
    if result.verdict == "EMPTY":
        return EXIT_NOTHING_CHECKED
    return EXIT_FINDINGS
