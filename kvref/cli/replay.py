"""``kvref replay FILE``: replay a saved KV-cache-manager trace against implementations side by side.

A trace (``"format": "kvref-trace"``, see :mod:`kvref.models.conformance.trace`) is what the conformance state
machine saves when two implementations disagree or one breaks an invariant. Replaying it applies
the same ops to fresh managers of ``--kinds`` (default ``reference,vllm``; ``reference`` alone
needs no vLLM) and prints the first divergence. A trace is data: reading it runs no code, and a
wrong value in it is an input error naming the file and the position (``ops[3].chunk``), never
reported as a divergence.

A proof reproducer (``.py``, written by ``kvref prove`` / ``kvref verify``) is a pytest file, and
running it executes the Python code in it: only with ``--exec-python`` (run reproducers you or
kvref wrote, as you would any script). Without the flag a ``.py`` file is refused.

An explorer finding (``kvref explore --out``) replays on the reference and, by default when vLLM
imports, in lock step on vLLM's own classes: a KV-cache scope on vLLM's ``Scheduler``, an offload or
connector scope on vLLM's ``SimpleCPUOffloadScheduler`` / ``OffloadingConnectorScheduler`` (what
each observes compared after every action; an exception vLLM raises is a divergence). Where it
runs on the reference only (the toy scope, no vLLM), stderr says so. ``--table`` is for
state-machine traces; an explorer finding's step table is the
``.txt`` file written beside it (asking for ``--table`` on one is an input error, not ignored).

Exit status: 0 no divergence (the reproducer holds), 1 divergence (the reproducer fails),
2 bad input (missing/unreadable/corrupt file, bad value, bad --kinds), 3 nothing was checked
(a trace with no op or action), 130 interrupted.
"""

from __future__ import annotations

import argparse


def add_parser(sub: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    p = sub.add_parser("replay", help="replay a saved trace against reference/vLLM/torch side by side",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", metavar="FILE",
                   help="trace JSON saved by a failing state-machine run (data only), or a proof reproducer "
                        "(.py, runs only with --exec-python)")
    p.add_argument("--exec-python", action="store_true",
                   help="allow FILE to be a Python proof reproducer and run it through pytest: this EXECUTES the "
                        "code in the file, so only use it on files you trust (kvref prove / verify wrote them)")
    p.add_argument("--kinds", default=None,
                   help="comma-separated implementations: reference, vllm, torch (default: reference,vllm); "
                        "for a .py reproducer: the formulas to check (default: its variant; reference)")
    p.add_argument("--verbose", "-v", action="store_true", help="print every op as it is applied")
    p.add_argument("--table", action="store_true",
                   help="print the trace as a step table: block tables per group of every live request "
                        "and the free blocks after each op (the first implementation's view)")
    return p


#: pytest's exit codes that mean "the file is not a runnable reproducer" (3 internal error, 4 usage,
#: 5 no tests; 2 is also what a collection error — a syntax error in the file — returns)
_PYTEST_BROKEN = {2: "a collection error (is it a Python test file?)", 3: "a pytest internal error",
                  4: "a pytest usage error", 5: "no tests collected"}


def _run_reproducer(path: str, impl: str | None, verbose: bool) -> int:
    """A proof counterexample written by `kvref prove` / `kvref verify` is a pytest file: run it.

    By default it checks the variant the counterexample was found for (and fails, showing the
    configuration); ``--kinds reference`` checks kvref's reference formulas (and passes). Only
    called with ``--exec-python``: running the file executes its code.
    """
    import os

    import pytest

    from kvref.spec.errors import InvalidFieldError

    if not os.path.isfile(path):
        raise InvalidFieldError("FILE", path, "an existing trace (.json) or reproducer (.py) file")
    saved = os.environ.get("KVREF_IMPL")
    if impl:
        os.environ["KVREF_IMPL"] = impl
    try:
        rc = pytest.main([path, "-q", "-p", "no:cacheprovider"] + ([] if verbose else ["--no-header"]))
    finally:
        if saved is None:
            os.environ.pop("KVREF_IMPL", None)
        else:
            os.environ["KVREF_IMPL"] = saved
    if rc in _PYTEST_BROKEN:  # not a finding: the file is not a working reproducer
        raise InvalidFieldError("FILE", path, f"a kvref proof reproducer (pytest reported {_PYTEST_BROKEN[rc]})")
    print(("OK: the reproducer holds" if rc == 0 else "COUNTEREXAMPLE: the reproducer fails")
          + (f" on {impl}" if impl else " on the variant it was found for"))
    return 0 if rc == 0 else 1


def _table_row(h, i: int, op, skipped: bool) -> tuple[int, str, str, int]:
    """One step-table row: the op and, per live request, its block table per group."""
    mgr = h.managers[h.kinds[0]]
    tables = []
    for rid in h.live():
        try:
            groups = mgr.get_block_ids(rid)
        except (KeyError, ValueError):
            continue
        if any(groups):
            tables.append(f"{rid}: " + " ".join(f"g{g}{list(ids)}" for g, ids in enumerate(groups)))
    return i, f"{op}{' (skipped)' if skipped else ''}", "\n".join(tables), mgr.get_num_free_blocks()


def _print_table(rows, kind: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"trace step table ({kind}'s block tables; 0 = null block)", show_lines=True)
    for col, kw in (("#", {"justify": "right"}), ("op", {}), ("block tables per group", {}), ("free", {"justify": "right"})):
        t.add_column(col, overflow="fold", **kw)
    for i, op, tables, free in rows:
        t.add_row(str(i), op, tables, "" if free < 0 else str(free))
    Console().print(t)


def run(args: argparse.Namespace) -> int:
    args.kinds_given = args.kinds
    if args.kinds is None:
        args.kinds = "reference,vllm"
    from kvref.spec.errors import InvalidFieldError

    if args.trace.endswith(".py"):
        if not args.exec_python:
            raise InvalidFieldError("FILE", args.trace, "a trace (.json); a .py reproducer runs Python code and "
                                                        "needs --exec-python (only for files you trust)")
        return _run_reproducer(args.trace, args.kinds_given, args.verbose)
    from kvref.cli.explore import is_explorer_trace, replay_explorer_trace
    from kvref.cli.input import read_json

    # the file as JSON first: unreadable, not UTF-8, nested 10,000 deep (a RecursionError in both
    # readers below) or an int of 5,000 digits named with the file and position
    read_json("FILE", args.trace, "trace file (.json)")

    if is_explorer_trace(args.trace):  # a `kvref explore --out` finding: the explorer's actions (data)
        return _replay_explorer(args)
    from kvref.impl.interface import manager_kinds
    from kvref.models.conformance.differential import Divergence, Harness
    from kvref.models.conformance.trace import Trace

    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not kinds:
        raise InvalidFieldError("--kinds", args.kinds, "one or more of " + ", ".join(manager_kinds()))
    for k in kinds:
        if k not in manager_kinds():
            raise InvalidFieldError("--kinds", k, "one of " + ", ".join(manager_kinds()))
    trace = Trace.load(args.trace)  # data only: a wrong value is a TraceFormatError (exit 2)
    if not trace.ops:
        return _nothing_checked(f"{args.trace} holds no op")
    h = _with_progress(kinds, lambda: Harness(trace.pool_config, kinds))
    rows: list[tuple[int, str, str, int]] = []
    compared = 0  # ops that called the managers and were compared (not skipped, not a queued arrival)
    try:
        for i, op in enumerate(trace.ops):
            res = h.apply(op)
            compared += not res.skipped and op.name != "add"
            if args.verbose:
                print(f"#{i:3d} {op}{'  (skipped)' if res.skipped else ''}")
            if getattr(args, "table", False):
                rows.append(_table_row(h, i, op, res.skipped))
    except Divergence as exc:
        if getattr(args, "table", False):
            rows.append((len(rows), "DIVERGENCE", str(exc)[:300], -1))
            _print_table(rows, kinds[0])
        print(f"DIVERGENCE ({','.join(kinds)}): {exc}")
        return 1
    if getattr(args, "table", False):
        _print_table(rows, kinds[0])
    if not compared:
        return _nothing_checked(f"every one of the {len(trace.ops)} ops of {args.trace} was skipped or only queued "
                                "an arrival: no manager call was compared")
    print(f"OK: {len(trace.ops)} ops ({h.num_skipped} skipped) on {','.join(kinds)}: no divergence, "
          "all invariants hold")
    return 0


def _nothing_checked(why: str) -> int:
    """A replay that applied nothing checked nothing: never "OK" (issue #25)."""
    from kvref.cli import EXIT_NOTHING_CHECKED

    print(f"NOTHING CHECKED: {why} (exit {EXIT_NOTHING_CHECKED})")
    return EXIT_NOTHING_CHECKED


def _with_progress(kinds, work):
    """Run ``work``; with vLLM among ``kinds`` importing it takes seconds, so after two seconds a
    line on stderr says what runs (``size --against vllm`` and ``replay`` were silent ~30 s)."""
    if "vllm" not in kinds:
        return work()
    from kvref.progress import Progress

    with Progress("replay").heartbeat(f"on {','.join(['reference', *[k for k in kinds if k != 'reference']])} "
                                      "(importing vLLM takes seconds)"):
        return work()


def _explorer_kinds(args: argparse.Namespace, data: dict) -> str:
    """``--kinds`` for an explorer finding: as given; else ``reference,vllm`` for a KV-cache scope
    when vLLM imports (the help's default), else ``reference`` — said on stderr either way."""
    import sys

    if args.kinds_given is not None:
        return args.kinds_given
    if data.get("toy") is True:
        print("replay: the toy scope replays on the reference only (it models no vLLM class)", file=sys.stderr)
        return "reference"
    from kvref.impl.vllm.installed import vllm_available

    ok, why = vllm_available()
    if not ok:
        print(f"replay: on the reference only ({why})", file=sys.stderr)
        return "reference"
    return "reference,vllm"


def _replay_explorer(args: argparse.Namespace) -> int:
    import json

    from kvref.cli.explore import replay_explorer_trace
    from kvref.spec.errors import InvalidFieldError

    if args.table:
        raise InvalidFieldError("--table", True, "a state-machine trace; an explorer finding's step table is the "
                                                 ".txt written beside its .json (or replay it with -v)")
    with open(args.trace) as fh:
        data = json.load(fh)
    if isinstance(data, dict) and data.get("actions") == []:
        return _nothing_checked(f"{args.trace} holds no action")
    kinds = _explorer_kinds(args, data if isinstance(data, dict) else {})
    targets = [k.strip() for k in kinds.split(",") if k.strip() and k.strip() != "reference"]
    from kvref.models.explorer.kv import SCOPES

    if targets and data.get("toy") is not True and data.get("scope") not in SCOPES:
        if targets != ["vllm"]:
            raise InvalidFieldError("--kinds", kinds, "reference or reference,vllm for an offload/connector trace")
        return _with_progress(targets, lambda: _replay_world_on_vllm(args.trace, data, args.verbose))
    return _with_progress(targets, lambda: replay_explorer_trace(args.trace, kinds, args.verbose))


def _replay_world_on_vllm(path: str, data: dict, verbose: bool) -> int:
    """An offload/connector explorer finding on the reference world and, in lock step, on the same
    world over vLLM's own offload schedulers (the backend ``conform-offload`` drives): after every
    action the reference's invariants are checked and both worlds' observations compared (free GPU
    queue, chunk/job states, request phases). vLLM raising where the reference does not is a
    divergence (e.g. ``reset-swa``: vLLM 0.33.0's connector reset, docs/offload.md).
    Exit 1 when the finding reproduces or vLLM diverges, 0 otherwise."""
    from kvref.cli.explore import _finding, walk_finding

    system, actions, where = _finding(data, path)
    ref = next(iter(system.initial_states()))
    world = type(ref[0])
    kwargs = {"strict": False} if world.__name__ == "OffloadingWorld" else {"allow_duplicates_within_event": True}
    theirs = (world(system.scope.config(), "vllm", **kwargs), 0)

    def step(i, raw, action, ref):
        nonlocal theirs
        ref_error = vllm_error = None
        try:
            ref = system.step_consuming(ref, action)
            system.check(ref)
        except AssertionError as exc:
            ref_error = f"{type(exc).__name__}: {exc}"
        try:
            theirs = system.step_consuming(theirs, action)
        except Exception as exc:  # noqa: BLE001 — whatever vLLM raises is what it did
            vllm_error = f"vLLM raised {type(exc).__name__}: {exc}"
        broken = getattr(theirs[0], "violations", None)
        if vllm_error is None and broken:
            vllm_error = f"vLLM's world broke a rule: {broken[0]}"
        if ref_error is not None:
            print(f"REPRODUCED ({data.get('kind')}) on the reference: {where}: action #{i} {raw}: {ref_error}")
            print(f"  on vLLM: {vllm_error}" if vllm_error else "  on vLLM: no failure at this action")
            return 1, ref
        if vllm_error is not None:
            print(f"DIVERGENCE (reference,vllm) at action #{i} {raw}: {vllm_error}")
            return 1, ref
        mine, its = ref[0].observe(), theirs[0].observe()
        if mine != its:
            print(f"DIVERGENCE (reference,vllm) at action #{i} {raw}: reference observes {mine!r:.400}, "
                  f"vLLM {its!r:.400}")
            return 1, ref
        return None, ref

    code, _ = walk_finding(system, ref, actions, where, verbose, step)
    if code is not None:
        return code
    print(f"NOT REPRODUCED: {where}: every action applied, every invariant holds, vllm agrees with the reference")
    return 0
