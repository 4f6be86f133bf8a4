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
from typing import Any, Callable


def add_parser(sub: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    from kvref.models.explorer.offloading_connector import CONNECTOR_SCOPES
    from kvref.models.explorer.kv import SCOPES
    from kvref.models.explorer.simple_cpu import OFFLOAD_SCOPES

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
                   help="override a scope field: an int (within the explorer's limits, e.g. num_blocks <= 128), "
                        "true/false, none, or a JSON list for tuple fields (max_tokens=[2,1,2])")
    p.add_argument("--max-states", type=int, default=None, help="stop after this many states")
    p.add_argument("--max-seconds", type=float, default=None, help="stop after this many seconds")
    p.add_argument("--liveness", action="store_true", help="also report livelocks (no way to finish)")
    p.add_argument("--all", action="store_true", help="keep going after the first finding (up to 10)")
    p.add_argument("--toy", action="store_true", help="explore the toy pool system instead")
    p.add_argument("--workers", default="1", metavar="N|auto",
                   help="processes expanding states (default 1; auto: one per idle CPU, from the load "
                        "average, and says what it chose). More than one expands each BFS level in forked "
                        "workers: same states and traces, faster on many idle cores, slower on a busy "
                        "2-core machine")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write each finding to DIR as a step table (.txt) and a trace (.json) that "
                        "`kvref replay FILE [--kinds reference,vllm,torch]` re-runs")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--against", default=None, metavar="vllm,torch",
                   help="exhaustive conformance instead (KV scopes): replay every transition of the scope's "
                        "state graph on these implementations in lock step with the reference and compare")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    from kvref.ray_runner import add_argument as add_ray_argument

    add_ray_argument(p)  # --ray [ADDRESS]: each BFS level's frontier in chunks on Ray (#27, docs/ray.md)
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


#: upper limits of ``--set`` values: explorer scopes are small by design (every state is a copy of
#: the whole stack); pools beyond ~200 blocks overflow the copy's recursion, larger counts explode
_SET_LIMITS = {"num_blocks": 128, "num_gpu_blocks": 128, "num_cpu_blocks": 128, "num_cpu_chunks": 128,
               "world_size": 16, "num_workers": 16, "max_depth": 1000}
_SET_INT_LIMIT = 4096


def _set_value(scope, f, key: str, text: str):
    """``text`` as a value of field ``f``, by the field's type (bool, int, str, tuple as JSON list).

    Raises InvalidFieldError naming ``--set KEY`` and what the field takes, instead of letting a
    wrong type reach the scope (``max_tokens=5`` used to raise TypeError deep in the explorer)."""
    import json

    from kvref.spec.errors import InvalidFieldError

    kind = str(f.type)
    nullable = "None" in kind or getattr(scope, key) is None
    low = text.strip().lower()
    if nullable and low == "none":
        return None
    what = f"--set {key}"
    if kind.startswith("tuple"):
        try:
            value = json.loads(text)
        except ValueError:
            value = None

        def tup(v):
            return tuple(tup(x) for x in v) if isinstance(v, list) else v
        if not isinstance(value, list):
            raise InvalidFieldError(what, text, "a JSON list such as [2, 1, 2]" + (" or none" if nullable else ""))
        return tup(value)
    if kind.startswith("bool"):
        if low not in ("true", "false"):
            raise InvalidFieldError(what, text, "true or false")
        return low == "true"
    if kind.startswith("int"):
        limit = _SET_LIMITS.get(key, _SET_INT_LIMIT)
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not 0 <= value <= limit:
            raise InvalidFieldError(what, text, f"an int in [0, {limit}]" + (" or none" if nullable else "")
                                    + " (explorer scopes are small by design)")
        return value
    return text  # str fields (name)


def _with_sets(scope, sets: list[str]):
    """``scope`` with the ``--set FIELD=VALUE`` overrides applied (unknown fields rejected, values
    checked against the field's type and the explorer's limits before the scope is built)."""
    from dataclasses import fields, replace

    from kvref.spec.errors import InvalidFieldError

    by_name = {f.name: f for f in fields(scope)}
    changes = {}
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep or key not in by_name:
            raise InvalidFieldError("--set", item, "FIELD=VALUE with FIELD one of " + ", ".join(sorted(by_name)))
        changes[key] = _set_value(scope, by_name[key], key, value)
    try:
        return replace(scope, **changes)
    except InvalidFieldError as exc:  # a limit on a field derived from the --set values: name both
        raise InvalidFieldError(f"--set {' '.join(sets)}: {exc.field}", exc.value, exc.allowed) from None
    except (TypeError, RecursionError) as exc:  # a value of the right type the scope cannot use
        raise InvalidFieldError("--set", " ".join(sets), f"values the scope accepts ({type(exc).__name__}: {exc})") \
            from None


def _check_arguments(args: argparse.Namespace) -> None:
    """Bounds and types of the flags, before anything is explored (``--workers 10**30`` used to
    fork until memory ran out; ``--max-seconds nan`` to run unbounded)."""
    from kvref.cli.arguments import MAX_WORKERS, check_count, check_seconds
    from kvref.spec.errors import InvalidFieldError

    if args.workers != "auto":
        try:
            n = int(args.workers)
        except ValueError:
            n = None
        if n is None or not 1 <= n <= MAX_WORKERS:
            raise InvalidFieldError("--workers", args.workers, f"an int in [1, {MAX_WORKERS}] or auto")
        args.workers = str(n)
    if getattr(args, "ray", None) is not None:  # #27: the Ray workers replace the forked ones
        if args.against is not None:
            raise InvalidFieldError("--ray", args.ray, "a run without --against (the conformance explorer drives "
                                                       "vLLM-backed systems in this process)")
        if args.workers != "1":
            raise InvalidFieldError("--workers", args.workers, "1 with --ray (the Ray cluster's CPUs expand the levels)")
    check_count("--max-states", args.max_states, minimum=1, maximum=10**12, allow_none=True)
    check_count("--max-depth", args.max_depth, minimum=0, maximum=10**6, allow_none=True)
    check_seconds("--max-seconds", args.max_seconds)


def auto_workers(stream=None) -> int:
    """``--workers auto``: one worker per *idle* CPU, not per CPU. On a loaded 2-core machine two
    forked workers share the cores with the load and run slower than one process (issue #16), so
    the 1-minute load average is subtracted; the choice is printed to ``stream``."""
    import os
    import sys

    cpus = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # not on this platform
        load = 0.0
    idle = max(1, int(cpus - load + 0.5))
    print(f"--workers auto: {cpus} CPU(s), load average {load:.2f} -> {idle} worker(s)"
          + ("" if idle > 1 else " (forking pays off only with idle cores)"), file=stream or sys.stderr)
    return idle


def run(args: argparse.Namespace) -> int:
    import json

    from kvref.models.explorer.engine import explore, render_trace
    from kvref.progress import Progress, rate

    _check_arguments(args)
    if args.against is not None:
        return _run_conformance(args)
    if args.out is not None:
        from kvref.cli.arguments import check_writable_dir

        check_writable_dir("--out", args.out)
    if args.toy:
        from kvref.models.explorer.simple_cpu import OFFLOAD_SCOPES
        from kvref.models.explorer.toy import ToyPool

        system, label = ToyPool(), "toy"
    else:
        from kvref.models.explorer.offloading_connector import CONNECTOR_SCOPES, ConnectorSystem
        from kvref.models.explorer.kv import SCOPES, KVSystem
        from kvref.models.explorer.simple_cpu import OFFLOAD_SCOPES, OffloadSystem

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
    workers = auto_workers() if args.workers == "auto" else _parse_value(args.workers)
    progress = Progress(f"explore {label}", enabled=not args.quiet)

    def on_progress(res, depth, level_size):
        progress.status = (f"{res.states:,} states, {res.transitions:,} transitions, depth {depth} "
                           f"({level_size:,} in this level), {rate(res.states, res.seconds)}")
        if progress.due():
            progress.update(progress.status)

    options = dict(max_states=args.max_states, max_seconds=args.max_seconds, stop_at_first=not args.all,
                   check_liveness=args.liveness and not bounded, check_deadlocks=not bounded,
                   max_depth=args.max_depth, progress=on_progress)
    on_ray = None
    if getattr(args, "ray", None) is not None:  # #27: the levels' frontiers in chunks on Ray
        from kvref.ray_explore import run_on_ray

        res, on_ray = run_on_ray(args.ray, system, options, progress)
    else:
        with progress.heartbeat("expanding the first states"):
            res = explore(system, workers=workers, **options)
    written = _write_findings(args, res, label) if args.out is not None else []
    if args.json:
        from kvref.models.explorer.search import resolve_workers

        print(json.dumps({"scope": label, "states": res.states, "transitions": res.transitions,
                          "depth": res.depth, "seconds": round(res.seconds, 3),
                          "workers": resolve_workers(workers) if on_ray is None else on_ray["ray"]["cpus"],
                          "states_per_second": round(res.states_per_second), "complete": res.complete,
                          "findings": [{"kind": f.kind, "message": f.message, "steps": f.trace.length,
                                        **({"files": written[i]} if written else {})}
                                       for i, f in enumerate(res.findings)], **(on_ray or {})}))
    else:
        print(f"{label}: {res.summary()}")
        if on_ray is not None:
            from kvref.ray_runner import describe

            print(describe(on_ray["ray"]) + f"; {on_ray['units']} unit(s)" + ("; INTERRUPTED (Ctrl-C): partial result, the remote units cancelled"
                                        if on_ray["interrupted"] else "")
                  + (f"; ERROR: {on_ray['error']}" if on_ray["error"] else ""))
        for i, f in enumerate(res.findings):
            print(f"\n{f.kind}: {f.message}")
            print(render_trace(f.trace, title=f"shortest {f.kind} trace"))
            if written:
                print(f"written: {written[i][0]} and {written[i][1]}; replay: kvref replay {written[i][1]}")
    if on_ray is not None and on_ray["interrupted"]:
        return 130  # kvref.cli.EXIT_INTERRUPTED (not imported: kvref.cli imports this module)
    return 1 if res.findings or (on_ray is not None and on_ray["error"]) else 0


#: ``"format"`` of the JSON an explorer finding is written as (``kvref replay`` recognises it)
EXPLORER_TRACE_FORMAT = "kvref-explorer-trace"


def _jsonable(action):
    if isinstance(action, tuple):
        return [_jsonable(a) for a in action]
    if action is None or isinstance(action, (str, int, float, bool)):
        return action
    return repr(action)


def _tupled(value):
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value


def _write_findings(args: argparse.Namespace, res, label: str) -> list[tuple[str, str]]:
    """Each finding as ``explore-<scope>-<kind>-<n>.txt`` (step table) and ``.json`` (the actions,
    data only, for ``kvref replay``). Returns the paths, per finding."""
    import json
    import os

    from kvref.models.explorer.engine import render_trace

    os.makedirs(args.out, exist_ok=True)
    scope = "toy" if args.toy else args.scope
    out = []
    for n, f in enumerate(res.findings, 1):
        # a violation raised by a step ends the trace with that action (its row shows the error)
        actions = [_jsonable(step.action) for step in f.trace.steps[1:]]
        base = os.path.join(args.out, f"explore-{scope}-{f.kind}-{n}")
        with open(base + ".txt", "w") as fh:
            fh.write(f"{label}: {f.kind}: {f.message}\n\n{render_trace(f.trace, title=f'shortest {f.kind} trace')}\n")
        with open(base + ".json", "w") as fh:
            json.dump({"format": EXPLORER_TRACE_FORMAT, "version": 1, "scope": scope, "toy": bool(args.toy),
                       "set": list(args.set), "max_depth": args.max_depth, "kind": f.kind, "message": f.message,
                       "actions": actions}, fh, indent=1)
            fh.write("\n")
        out.append((base + ".txt", base + ".json"))
    return out


def is_explorer_trace(path: str) -> bool:
    """Whether ``path`` is a JSON explorer finding (``kvref replay`` then hands it here)."""
    import json

    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("format") == EXPLORER_TRACE_FORMAT


def _system_for(data: dict, path: str):
    from kvref.spec.errors import InvalidFieldError

    if data.get("toy") is True:
        from kvref.models.explorer.toy import ToyPool

        return ToyPool()
    from kvref.models.explorer.offloading_connector import CONNECTOR_SCOPES, ConnectorSystem
    from kvref.models.explorer.kv import SCOPES, KVSystem
    from kvref.models.explorer.simple_cpu import OFFLOAD_SCOPES, OffloadSystem

    name, sets = data.get("scope"), data.get("set", [])
    if not isinstance(sets, list) or not all(isinstance(x, str) for x in sets):
        raise InvalidFieldError(f"{path}: set", sets, "a list of FIELD=VALUE strings")
    for table, cls in ((SCOPES, KVSystem), (OFFLOAD_SCOPES, OffloadSystem), (CONNECTOR_SCOPES, ConnectorSystem)):
        if isinstance(name, str) and name in table:
            return cls(_with_sets(table[name], sets))
    raise InvalidFieldError(f"{path}: scope", name, "a scope name of kvref explore --scope")


def _finding(data: dict, path: str) -> tuple[Any, list, str]:
    """A finding's system (its scope with its ``set`` overrides), its actions (checked to be a
    list) and how the replay names it: what both replays of a finding read first."""
    from kvref.spec.errors import InvalidFieldError

    actions = data.get("actions")
    if not isinstance(actions, list):
        raise InvalidFieldError(f"{path}: actions", type(actions).__name__, "a list of actions")
    return _system_for(data, path), actions, f"{data.get('scope')} ({len(actions)} actions)"


def walk_finding(system, state, actions: list, where: str, verbose: bool,
                 step: Callable[[int, Any, Any, Any], tuple[int | None, Any]]) -> tuple[int | None, Any]:
    """Apply a finding's ``actions`` from ``state``, each only where the system enables it there
    (otherwise the finding does not reproduce: printed, exit code 0). ``step(i, raw, action,
    state)`` applies one and returns (an exit code to stop with, or None to go on; the next
    state). Returns (the exit code it stopped with, or None when every action applied; the last
    state). The loop of both replays: the reference alone or in lock step (:func:`replay_explorer_trace`)
    and the reference beside vLLM's offload world (``kvref.cli.replay``)."""
    for i, raw in enumerate(actions):
        action = _tupled(raw)
        enabled = list(system.actions(state))
        if action not in enabled:
            print(f"NOT REPRODUCED: {where}: action #{i} {raw} is not enabled here (enabled: {enabled})")
            return 0, state
        if verbose:
            print(f"#{i:3d} {raw}")
        code, state = step(i, raw, action, state)
        if code is not None:
            return code, state
    return None, state


def replay_explorer_trace(path: str, kinds: str | None = None, verbose: bool = False) -> int:
    """``kvref replay explore-*.json``: apply the finding's actions from the scope's initial state,
    checking every invariant after each; with ``--kinds`` naming vllm and/or torch (KV scopes),
    the same actions also drive vLLM's Scheduler / the torch manager in lock step and every step is
    compared. Exit 1 when the finding reproduces (or an implementation diverges), 0 when it does not."""
    import json

    from kvref.spec.errors import InvalidFieldError

    with open(path) as fh:
        data = json.load(fh)
    system, actions, where = _finding(data, path)
    targets = tuple(k.strip() for k in (kinds or "reference").split(",") if k.strip() and k.strip() != "reference")
    lockstep = None
    if targets:
        from kvref.models.explorer.conformance import TARGETS, _factories, _Lockstep
        from kvref.models.explorer.kv import KVSystem

        if not isinstance(system, KVSystem):
            raise InvalidFieldError("--kinds", kinds, "reference only for an offload/connector/toy trace")
        bad = [t for t in targets if t not in TARGETS]
        if bad:
            raise InvalidFieldError("--kinds", bad[0], "reference, " + ", ".join(TARGETS))
        lockstep = _Lockstep(system, _factories(targets))

    def step(i, raw, action, state):
        try:
            state = system.step(state, action)
            system.check(state)
        except AssertionError as exc:
            print(f"REPRODUCED ({data.get('kind')}): {where}: action #{i} {raw}: {exc}")
            return 1, state
        if lockstep is not None:
            try:
                lockstep.apply(action)
            except AssertionError as exc:
                print(f"DIVERGENCE (reference,{','.join(targets)}) at action #{i} {raw}: {exc}")
                return 1, state
        return None, state

    code, state = walk_finding(system, next(iter(system.initial_states())), actions, where, verbose, step)
    if code is not None:
        return code
    if data.get("kind") in ("deadlock", "livelock") and not system.is_final(state):
        moves = [a for a in system.actions(state) if system.key(system.step(state, a)) != system.key(state)]
        if not moves:
            print(f"REPRODUCED (deadlock): {where}: no action changes the final state, and work is unfinished")
            return 1
        if data.get("kind") == "livelock":
            print(f"REPRODUCED? (livelock): {where}: the state is reached; whether it can still finish needs "
                  f"`kvref explore --scope {data.get('scope')} --liveness`")
            return 1
    print(f"NOT REPRODUCED: {where}: every action applied, every invariant holds"
          + (f", {','.join(targets)} agree with the reference" if targets else ""))
    return 0


def _run_conformance(args: argparse.Namespace) -> int:
    """``kvref explore --scope S --against vllm,torch``: every transition, compared."""
    import json

    from kvref.models.explorer.conformance import explore_conformance
    from kvref.models.explorer.kv import SCOPES
    from kvref.spec.errors import InvalidFieldError

    if args.toy or args.scope not in SCOPES:
        raise InvalidFieldError("--scope", args.scope, "a KV scope (one of " + ", ".join(SCOPES) + ") with --against")
    targets = tuple(t.strip() for t in args.against.split(",") if t.strip())
    from kvref.models.explorer.conformance import TARGETS

    if not targets or any(t not in TARGETS for t in targets) or len(set(targets)) != len(targets):
        raise InvalidFieldError("--against", args.against, "one or more of " + ", ".join(TARGETS)
                                + ", comma-separated, each once")
    from kvref.progress import Progress

    progress = Progress(f"explore {args.scope} --against {','.join(targets)}", enabled=not args.quiet)
    with progress.heartbeat(f"replaying every transition on the reference and {', '.join(targets)} in lock step"):
        res = explore_conformance(_with_sets(SCOPES[args.scope], args.set), targets=targets,
                                  max_states=args.max_states)
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
    """``kvref verify`` check ``explorer`` (:data:`kvref.checks.CHECKS`): explore the profile's
    scopes; any violation/deadlock fails it. Counterexample step tables go to ``ctx.out_dir``."""
    import os
    import sys
    import time

    from kvref.models.explorer.engine import render_trace
    from kvref.models.explorer.kv import SCOPES, explore_scope
    from kvref.models.explorer.offloading_connector import CONNECTOR_SCOPES, explore_connector
    from kvref.models.explorer.simple_cpu import explore_offload
    from kvref.progress import Progress
    from kvref.report import FAILED, PASSED, CheckResult

    t0 = time.perf_counter()
    details, artifacts, states, failed = [], [], 0, False
    scopes = VERIFY_SCOPES.get(ctx.profile, VERIFY_SCOPES["fast"])
    # the ci profile explores for minutes: say which scope runs (in a terminal kvref verify's own
    # spinner shows the check, and a second live line would garble it)
    progress = Progress("  explorer", start_after=5.0, enabled=not sys.stderr.isatty())
    with progress.heartbeat():
        for i, name in enumerate(scopes, 1):
            progress.status = f"scope {name} ({i}/{len(scopes)}), {states:,} states so far"
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
                       secs, details=details, examined=states)


#: scopes the exhaustive conformance check replays per profile (every transition, vs vLLM and torch)
CONFORMANCE_SCOPES = {
    "fast": ("tight", "small", "whole-prompts"),
    "ci": ("tight", "small", "swa", "chunked", "whole-prompts", "twins", "default"),
    "nightly": ("tight", "small", "swa", "chunked", "whole-prompts", "twins", "default", "full"),
}


def check_explorer_conformance(ctx):
    """``kvref verify`` check ``conform-explorer``: every transition of the profile's scopes,
    replayed on the installed vLLM's Scheduler and on the torch KV cache manager in lock step with the
    reference (:mod:`kvref.models.explorer.conformance`). Without vLLM only torch is compared
    (``--against vllm`` makes that a failure); without either it is skipped."""
    import time

    from kvref.check_context import vllm_gate
    from kvref.models.explorer.conformance import explore_conformance
    from kvref.report import FAILED, PASSED, SKIPPED, CheckResult

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
                       f"{len(details) - len(notes)} scopes", time.perf_counter() - t0, details=details,
                       examined=transitions)
