"""``kvref explore``: exhaustive small-scope exploration of the reference (or the toy system).

Visits every state reachable by every interleaving of arrivals, scheduler steps, completions (and
aborts where the scope allows) of the real reference stack, checks every invariant in every state,
and prints the shortest counterexample as a step table. Exit status 1 if anything was found.

Examples::

    kvref explore                      # the default scope
    kvref explore --scope tight --liveness
    kvref explore --scope default --set max_num_batched_tokens=2 --set aborts=true
    kvref explore --toy                # the engine on its toy system (finds a deadlock)
    kvref explore --scope offload      # SimpleCPU offload: per-worker store completions in any order
    kvref explore --scope default --against vllm,torch   # every transition, compared with vLLM and torch
"""

from __future__ import annotations

import argparse


def add_parser(sub: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    from kvref.models.explorer_connector import CONNECTOR_SCOPES
    from kvref.models.explorer_kv import SCOPES
    from kvref.models.explorer_offload import OFFLOAD_SCOPES

    p = sub.add_parser("explore", help="exhaustive small-scope explorer (states, deadlocks, shortest traces)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scope", default="default",
                   choices=sorted(SCOPES) + sorted(OFFLOAD_SCOPES) + sorted(CONNECTOR_SCOPES),
                   help="named scope (default: default); offload* scopes explore the SimpleCPU offload path "
                        "(offload and offload-deep: bounded depth; offload-lazy, offload-complete: every state); "
                        "connector*, reset-swa: the OffloadingConnector path (connector, reset-swa: bounded "
                        "depth, reset-swa finds the reset bug of docs/offload.md; connector-complete, "
                        "connector-complete-2w: every state)")
    p.add_argument("--max-depth", type=int, default=None, help="bounded exploration: expand states up to this depth")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a scope field (int, true/false, none)")
    p.add_argument("--max-states", type=int, default=None, help="stop after this many states")
    p.add_argument("--max-seconds", type=float, default=None, help="stop after this many seconds")
    p.add_argument("--liveness", action="store_true", help="also report livelocks (no way to finish)")
    p.add_argument("--all", action="store_true", help="keep going after the first finding (up to 10)")
    p.add_argument("--toy", action="store_true", help="explore the toy pool system instead")
    p.add_argument("--workers", default="1", metavar="N|auto",
                   help="processes expanding states (default 1; auto: one per CPU). More than one "
                        "expands each BFS level in forked workers: same states and traces, faster on "
                        "many cores")
    p.add_argument("--against", default=None, metavar="vllm,torch",
                   help="exhaustive conformance instead (KV scopes): replay every transition of the scope's "
                        "state graph on these implementations in lock step with the reference and compare")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    return p


def _parse_value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    try:
        return int(text)
    except ValueError:
        return text


def _with_sets(scope, sets: list[str]):
    """``scope`` with the ``--set FIELD=VALUE`` overrides applied (unknown fields rejected)."""
    from dataclasses import fields, replace

    from kvref.spec.errors import InvalidFieldError

    names = {f.name for f in fields(scope)}
    changes = {}
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep or key not in names:
            raise InvalidFieldError("--set", item, "FIELD=VALUE with FIELD one of " + ", ".join(sorted(names)))
        changes[key] = _parse_value(value)
    return replace(scope, **changes)


def run(args: argparse.Namespace) -> int:
    import json

    from kvref.models.explorer import explore, render_trace
    from kvref.models.explorer_search import resolve_workers

    if args.against is not None:
        return _run_conformance(args)
    if args.toy:
        from kvref.models.explorer_offload import OFFLOAD_SCOPES
        from kvref.models.explorer_toy import ToyPool

        system, label = ToyPool(), "toy"
    else:
        from kvref.models.explorer_connector import CONNECTOR_SCOPES, ConnectorSystem
        from kvref.models.explorer_kv import SCOPES, KVSystem
        from kvref.models.explorer_offload import OFFLOAD_SCOPES, OffloadSystem

        scope = _with_sets(SCOPES.get(args.scope) or OFFLOAD_SCOPES.get(args.scope) or CONNECTOR_SCOPES[args.scope],
                           args.set)
        if args.scope in OFFLOAD_SCOPES or args.scope in CONNECTOR_SCOPES:
            system = OffloadSystem(scope) if args.scope in OFFLOAD_SCOPES else ConnectorSystem(scope)
            label = f"scope {scope.name}"
            if args.max_depth is None:
                args.max_depth = scope.max_depth
        else:
            system, label = KVSystem(scope), f"scope {scope.name}"
    bounded = args.max_depth is not None and not args.toy and args.scope not in SCOPES
    workers = args.workers if args.workers == "auto" else _parse_value(args.workers)
    res = explore(system, max_states=args.max_states, max_seconds=args.max_seconds,
                  stop_at_first=not args.all, check_liveness=args.liveness and not bounded,
                  check_deadlocks=not bounded, max_depth=args.max_depth, workers=workers)
    if args.json:
        print(json.dumps({"scope": label, "states": res.states, "transitions": res.transitions,
                          "depth": res.depth, "seconds": round(res.seconds, 3),
                          "workers": resolve_workers(workers),
                          "states_per_second": round(res.states_per_second), "complete": res.complete,
                          "findings": [{"kind": f.kind, "message": f.message, "steps": f.trace.length}
                                       for f in res.findings]}))
    else:
        print(f"{label}: {res.summary()}")
        for f in res.findings:
            print(f"\n{f.kind}: {f.message}")
            print(render_trace(f.trace, title=f"shortest {f.kind} trace"))
    return 1 if res.findings else 0


def _run_conformance(args: argparse.Namespace) -> int:
    """``kvref explore --scope S --against vllm,torch``: every transition, compared."""
    import json

    from kvref.models.explorer_conformance import explore_conformance
    from kvref.models.explorer_kv import SCOPES
    from kvref.spec.errors import InvalidFieldError

    if args.toy or args.scope not in SCOPES:
        raise InvalidFieldError("--scope", args.scope, "a KV scope (one of " + ", ".join(SCOPES) + ") with --against")
    targets = tuple(t.strip() for t in args.against.split(",") if t.strip())
    res = explore_conformance(_with_sets(SCOPES[args.scope], args.set), targets=targets, max_states=args.max_states)
    if args.json:
        print(json.dumps({"scope": res.scope, "targets": list(res.targets), "states": res.states,
                          "transitions": res.transitions, "depth": res.depth, "replays": res.replays,
                          "calls": res.calls, "seconds": round(res.seconds, 3), "complete": res.complete,
                          "divergence": None if res.ok else {"path": [list(a) for a in res.divergence[0]],
                                                             "message": res.divergence[1]}}))
    else:
        print(f"scope {res.scope}: {res.summary()}")
    return 0 if res.ok else 1


#: scopes ``kvref verify`` explores per profile (``offload`` and ``connector`` are depth-bounded;
#: ``offload-lazy``, ``offload-complete`` and ``connector-complete*`` are explored completely)
VERIFY_SCOPES = {
    "fast": ("default", "tight", "offload"),
    "ci": ("default", "tight", "small", "swa", "full", "chunked", "whole-prompts", "twins", "offload", "offload-lazy",
           "connector", "connector-complete"),
    "nightly": ("default", "tight", "small", "swa", "full", "chunked", "whole-prompts", "twins", "large", "offload",
                "offload-lazy", "offload-complete", "connector", "connector-complete", "connector-complete-2w"),
}


def check_explorer(ctx):
    """``kvref verify`` check: explore the profile's scopes; any violation/deadlock fails it.

    Register in ``kvref/verify.py`` as ``Check("explorer", "exhaustive small-scope explorer",
    check_explorer)``; counterexample step tables go to ``ctx.out_dir``.
    """
    import os
    import time

    from kvref.models.explorer import render_trace
    from kvref.models.explorer_kv import SCOPES, explore_scope
    from kvref.models.explorer_connector import CONNECTOR_SCOPES, explore_connector
    from kvref.models.explorer_offload import explore_offload
    from kvref.report import FAILED, PASSED, CheckResult

    t0 = time.perf_counter()
    details, artifacts, states, failed = [], [], 0, False
    for name in VERIFY_SCOPES.get(ctx.profile, VERIFY_SCOPES["fast"]):
        if name in SCOPES:
            res = explore_scope(name, check_liveness=name in ("tight", "twins"))
        elif name in CONNECTOR_SCOPES:
            res = explore_connector(name)
        else:
            res = explore_offload(name)
        states += res.states
        details.append(f"{name}: {res.summary()}")
        for f in res.findings:
            failed = True
            path = os.path.join(ctx.ensure_out_dir(), f"explorer-{name}-{f.kind}.txt")
            with open(path, "w") as fh:
                fh.write(f"{f.kind}: {f.message}\n\n{render_trace(f.trace, title=f'shortest {f.kind} trace')}")
            artifacts.append(path)
    secs = time.perf_counter() - t0
    if failed:
        return CheckResult("explorer", FAILED, f"counterexample found ({len(artifacts)} trace(s))", secs,
                           details=details, artifacts=artifacts)
    return CheckResult("explorer", PASSED, f"{states:,} states, every invariant in every state, no deadlock",
                       secs, details=details)


#: scopes the exhaustive conformance check replays per profile (every transition, vs vLLM and torch)
CONFORMANCE_SCOPES = {
    "fast": ("tight", "small", "whole-prompts"),
    "ci": ("tight", "small", "swa", "chunked", "whole-prompts", "twins", "default"),
    "nightly": ("tight", "small", "swa", "chunked", "whole-prompts", "twins", "default", "full"),
}


def check_explorer_conformance(ctx):
    """``kvref verify`` check ``conform-explorer``: every transition of the profile's scopes,
    replayed on the installed vLLM's Scheduler and on the torch KV cache manager in lock step with the
    reference (:mod:`kvref.models.explorer_conformance`). Without vLLM only torch is compared
    (``--against vllm`` makes that a failure); without either it is skipped."""
    import time

    from kvref.models.explorer_conformance import explore_conformance
    from kvref.report import FAILED, PASSED, SKIPPED, CheckResult
    from kvref.verify import vllm_gate

    t0 = time.perf_counter()
    targets, notes = [], []
    gate = vllm_gate(ctx, "conform-explorer")
    if gate is None:
        targets.append("vllm")
    elif gate.status != SKIPPED:
        return gate
    else:
        notes.append(f"vLLM left out: {gate.summary}")
    try:
        import torch  # noqa: F401

        targets.append("torch")
    except ImportError as exc:
        notes.append(f"torch left out: {exc}")
    if not targets:
        return CheckResult("conform-explorer", SKIPPED, "; ".join(notes), 0.0)
    details, transitions = list(notes), 0
    for name in CONFORMANCE_SCOPES.get(ctx.profile, CONFORMANCE_SCOPES["fast"]):
        res = explore_conformance(name, targets=tuple(targets))
        transitions += res.transitions
        details.append(f"{name}: {res.summary()}")
        if not res.ok:
            return CheckResult("conform-explorer", FAILED, f"{name}: divergence ({', '.join(targets)})",
                               time.perf_counter() - t0, details=details)
    return CheckResult("conform-explorer", PASSED,
                       f"{', '.join(targets)} = reference on all {transitions:,} transitions of "
                       f"{len(details) - len(notes)} scopes", time.perf_counter() - t0, details=details)
