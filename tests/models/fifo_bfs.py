"""The explorer's former engine, kept as a test oracle: a plain FIFO breadth-first search.

:mod:`kvref.models.explorer.search` expands BFS levels (in one process or spread over forked
workers) and merges their reports; this is the textbook loop it replaced — a queue of live
states, one expansion at a time — so that the tests can check that both find the same states in
the same order, the same transitions, depth and findings with the same shortest traces.
"""

from __future__ import annotations

import time
from array import array
from collections import deque
from typing import Any, Hashable

from kvref.models.explorer.vocabulary import (
    ExplorationResult,
    Finding,
    Step,
    first_stuck,
    fmt_action,
    fmt_exc,
    rebuild_trace,
    safe_describe,
)


def fifo_explore(system: Any, max_states: int | None = None, max_seconds: float | None = None,
                 stop_at_first: bool = True, check_deadlocks: bool = True, check_liveness: bool = False,
                 max_findings: int = 10, max_depth: int | None = None) -> ExplorationResult:
    return _explore(system, max_states, max_seconds, stop_at_first, check_deadlocks, check_liveness,
                    max_findings, max_depth)


def _explore(system: Any, max_states: int | None, max_seconds: float | None,
             stop_at_first: bool, check_deadlocks: bool, check_liveness: bool, max_findings: int,
             max_depth: int | None) -> ExplorationResult:
    t0 = time.perf_counter()
    res = ExplorationResult()
    index: dict[Hashable, int] = {}
    keys: list[Hashable] = []
    parents: list[int] = []  # -1 for initial states
    via: list[Hashable | None] = []
    finals: list[int] = []
    edge_src: array = array("l")
    edge_dst: array = array("l")
    queue: deque[tuple[Any, int, int]] = deque()  # (state, index, depth)

    def finish(complete: bool) -> ExplorationResult:
        res.complete = complete
        res.seconds = time.perf_counter() - t0
        return res

    def add_finding(kind: str, message: str, idx: int | None,
                    failed_action: Hashable | None = None, extra: Step | None = None) -> bool:
        trace = rebuild_trace(system, keys, parents, via, idx)
        if extra is not None:
            trace.steps.append(extra)
        res.findings.append(Finding(kind, message, trace, failed_action))
        return stop_at_first or len(res.findings) >= max_findings

    def register(k: Hashable, parent: int, action: Hashable | None) -> int:
        i = len(keys)
        index[k] = i
        keys.append(k)
        parents.append(parent)
        via.append(action)
        return i

    for s0 in system.initial_states():
        try:
            system.check(s0)
        except AssertionError as e:  # the initial state itself is broken
            if add_finding("violation", f"initial state: {fmt_exc(e)}", None,
                           extra=Step(None, safe_describe(system, s0))):
                return finish(False)
            continue
        k0 = system.key(s0)
        if k0 in index:
            continue
        queue.append((s0, register(k0, -1, None), 0))
        res.states += 1

    n = 0
    cut = False
    consume = getattr(system, "step_consuming", None)
    while queue:
        state, idx, depth = queue.popleft()
        if depth > res.depth:
            res.depth = depth
        final = system.is_final(state)
        if max_depth is not None and depth >= max_depth:
            cut = cut or not final
            continue
        if final:
            finals.append(idx)
        progressed = False
        acts = list(system.actions(state))
        last = len(acts) - 1
        for ai, a in enumerate(acts):
            res.transitions += 1
            try:
                nxt = consume(state, a) if ai == last and consume is not None else system.step(state, a)
            except Exception as e:  # noqa: BLE001 - any exception of the real code is a finding
                msg = f"action {fmt_action(a)} raised {fmt_exc(e)}"
                progressed = True  # not a deadlock: something happened (and it was wrong)
                if add_finding("violation", msg, idx, failed_action=a,
                               extra=Step(a, {"error": fmt_exc(e)})):
                    return finish(False)
                continue
            nk = system.key(nxt)
            j = index.get(nk)
            if j is not None:
                if j != idx:
                    progressed = True
                    if check_liveness:
                        edge_src.append(idx)
                        edge_dst.append(j)
                continue
            progressed = True
            j = register(nk, idx, a)
            if check_liveness:
                edge_src.append(idx)
                edge_dst.append(j)
            try:
                system.check(nxt)
            except AssertionError as e:
                if add_finding("violation", f"invariant broken after {fmt_action(a)}: {fmt_exc(e)}", j):
                    return finish(False)
                continue
            res.states += 1
            queue.append((nxt, j, depth + 1))
        if check_deadlocks and not progressed and not final:
            why = getattr(system, "deadlock_reason", None)
            msg = "no action changes the state, but work is unfinished"
            if why is not None:
                msg += f": {why(state)}"
            if add_finding("deadlock", msg, idx):
                return finish(False)
        n += 1
        if max_seconds is not None and n % 256 == 0 and time.perf_counter() - t0 > max_seconds:
            return finish(False)
        if max_states is not None and res.states >= max_states:
            return finish(False)
    if check_liveness and not cut and not (res.findings and stop_at_first):
        stuck = first_stuck(len(keys), finals, edge_src, edge_dst, parents)
        if stuck is not None and not any(f.kind == "deadlock" for f in res.findings):
            add_finding("livelock", "no final state is reachable from here (actions only cycle)", stuck)
    return finish(not (res.findings and stop_at_first) and not cut)
