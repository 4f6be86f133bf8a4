"""Level-synchronous parallel breadth-first search: the explorer's states spread over processes.

The reference is plain Python, and one expansion (copy the state, run the scheduler, hash the
key, check every invariant) costs ~100-300 µs of interpreter time that no single-process trick
removes (issue 6: the pickle copy alone is ~40 % of it). Expanding the states of one BFS level is
embarrassingly parallel, so this module farms the expansions out to forked worker processes and
keeps everything that decides *which* states exist in the parent:

* **workers** get a chunk of the current level as serialized states (``system.dump``), expand each
  by every action, and send back, per successor, its key, whether it is final, the invariant
  violation if any, and the serialized successor (only for keys this worker has not sent before:
  a key it sent earlier is registered already, so its state is not needed again);
* the **parent** merges the chunks *in frontier order* (``imap`` is ordered), state by state and
  action by action, exactly as the sequential engine pops its FIFO queue. It alone owns the
  index, the parent pointers and the findings.

So the result is *identical* to :func:`kvref.models.explorer._explore`: same states in the same
discovery order, same transition count, same depth, the same first finding with the same shortest
trace (``tests/models/test_explorer_parallel.py`` compares the two on every scope). Small levels
are expanded in the parent (forking costs more than they do); the pool is started at the first
level of at least ``min_parallel_level`` states.

What a system must allow: its states must survive ``system.dump`` / ``system.load`` (defaults:
pickle) into another process forked from this one, and ``key`` must not depend on the process
(no per-process interning). :class:`~kvref.models.explorer_kv.KVSystem` documents how it ensures
both. Needs the ``fork`` start method (Linux; elsewhere the search falls back to one process).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import time
from array import array
from typing import Any, Hashable

from kvref.spec.errors import InvalidFieldError

__all__ = ["resolve_workers", "explore_parallel"]

#: the system being explored, set in the parent before the pool forks (workers inherit it)
_SYSTEM: Any = None
#: keys this worker process has already sent with their state
_SENT: set = set()


def resolve_workers(workers: int | str | None) -> int:
    """``workers`` as a process count: an int >= 1, or ``"auto"`` / 0 / None for the CPU count."""
    if workers is None or workers == 0 or workers == "auto":
        try:
            n = len(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - not on Linux
            n = os.cpu_count() or 1
        return max(1, n)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise InvalidFieldError("workers", workers, "an int >= 1, or 0 / 'auto' for one per CPU")
    return workers


def fork_available() -> bool:
    return "fork" in multiprocessing.get_all_start_methods()


def _dump(system: Any, state: Any) -> bytes:
    dump = getattr(system, "dump", None)
    return dump(state) if dump is not None else pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)


def _load(system: Any, blob: bytes) -> Any:
    load = getattr(system, "load", None)
    return load(blob) if load is not None else pickle.loads(blob)


def _expand(system: Any, blob: bytes, sent: Any) -> list:
    """Every successor of one serialized state, as plain data the parent can merge.

    One entry per enabled action, in the system's order:
    ``("err", action, message)`` if the action raised, else
    ``("ok", action, key, final, violation | None, blob | None)``. A successor whose key is in
    ``sent`` (registered already) is neither checked nor serialized: the parent ignores it.
    """
    state = _load(system, blob)
    acts = list(system.actions(state))
    consume = getattr(system, "step_consuming", None)
    out: list = []
    for i, a in enumerate(acts):
        # every action steps a fresh copy of the state (the first one steps the copy we already
        # loaded); loading is cheaper than the sequential engine's dump-once-load-per-action here
        cur = state if i == 0 else _load(system, blob)
        try:
            nxt = consume(cur, a) if consume is not None else system.step(cur, a)
        except Exception as e:  # noqa: BLE001 - any exception of the real code is a finding
            from .explorer import _fmt_action, _fmt_exc

            out.append(("err", a, f"action {_fmt_action(a)} raised {_fmt_exc(e)}", _fmt_exc(e)))
            continue
        k = system.key(nxt)
        if k in sent:
            out.append(("ok", a, k, False, None, None))
            continue
        if isinstance(sent, set):
            sent.add(k)
        violation = None
        try:
            system.check(nxt)
        except AssertionError as e:
            from .explorer import _fmt_exc

            violation = _fmt_exc(e)
        if violation is not None:
            out.append(("ok", a, k, False, violation, None))
        else:
            out.append(("ok", a, k, bool(system.is_final(nxt)), None, _dump(system, nxt)))
    return out


def _worker_started() -> None:
    hook = getattr(_SYSTEM, "worker_started", None)
    if hook is not None:
        hook()


class _ReprKeyed:
    """``system`` with its keys sent as their ``repr`` strings.

    A key is a nested tuple; shipping it to the parent means pickling and unpickling every
    element, and the parent then hashes it again on every lookup. Its ``repr`` is one string
    (hash cached, copied as a block). The explorer's keys are built from ints, strings, None,
    bools, tuples and enum members, whose ``repr`` is deterministic, so equal keys give equal
    strings; the converse holds too except for ``1 == True``-style coincidences, which would
    only split a state in two (never merge two different ones). The parallel search is checked
    to find exactly the sequential one's states.
    """

    def __init__(self, system: Any) -> None:
        self._system = system

    def key(self, state: Any) -> str:
        return repr(self._system.key(state))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._system, name)


def _work(chunk: list[bytes]) -> list[list]:
    return [_expand(_SYSTEM, blob, _SENT) for blob in chunk]


def explore_parallel(system: Any, res: Any, *, workers: int, max_states: int | None,
                     max_seconds: float | None, stop_at_first: bool, check_deadlocks: bool,
                     check_liveness: bool, max_findings: int, max_depth: int | None,
                     min_parallel_level: int = 64, chunk_states: int | None = None) -> Any:
    """The body of :func:`kvref.models.explorer.explore` for ``workers > 1``; fills ``res``."""
    global _SYSTEM
    from .explorer import Finding, Step, _first_stuck, _fmt_action, _rebuild_trace, _safe_describe

    t0 = time.perf_counter()
    system = _ReprKeyed(system)
    index: dict[Hashable, int] = {}
    keys: list[Hashable] = []
    parents: list[int] = []
    via: list[Hashable | None] = []
    finals: list[int] = []
    edge_src: array = array("l")
    edge_dst: array = array("l")

    def finish(complete: bool) -> Any:
        res.complete = complete
        res.seconds = time.perf_counter() - t0
        return res

    def add_finding(kind: str, message: str, idx: int | None, failed_action: Hashable | None = None,
                    extra: Step | None = None) -> bool:
        from .explorer import Trace

        trace = _rebuild_trace(system, keys, parents, via, idx) if idx is not None else Trace([])
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

    # level 0: (index, blob, final)
    level: list[tuple[int, bytes, bool]] = []
    for s0 in system.initial_states():
        try:
            system.check(s0)
        except AssertionError as e:
            from .explorer import _fmt_exc

            if add_finding("violation", f"initial state: {_fmt_exc(e)}", None,
                           extra=Step(None, _safe_describe(system, s0))):
                return finish(False)
            continue
        k0 = system.key(s0)
        if k0 in index:
            continue
        level.append((register(k0, -1, None), _dump(system, s0), bool(system.is_final(s0))))
        res.states += 1

    pool = None
    n = 0
    cut = False
    depth = 0
    try:
        while level:
            res.depth = max(res.depth, depth)
            if max_depth is not None and depth >= max_depth:
                cut = cut or any(not final for _, _, final in level)
                break
            expand_here = pool is None and len(level) < min_parallel_level
            if not expand_here and pool is None:
                _SYSTEM = system
                pool = multiprocessing.get_context("fork").Pool(workers, initializer=_worker_started)
            if expand_here:
                results = (_expand(system, blob, index) for _, blob, _ in level)
            else:
                size = chunk_states or max(4, min(256, len(level) // (workers * 4) or 1))
                chunks = [[blob for _, blob, _ in level[i:i + size]] for i in range(0, len(level), size)]
                results = (r for rs in pool.imap(_work, chunks) for r in rs)
            nxt_level: list[tuple[int, bytes, bool]] = []
            for (idx, blob, final), succ in zip(level, results):
                if final:
                    finals.append(idx)
                progressed = False
                for entry in succ:
                    res.transitions += 1
                    if entry[0] == "err":
                        _, a, msg, err = entry
                        progressed = True
                        if add_finding("violation", msg, idx, failed_action=a, extra=Step(a, {"error": err})):
                            return finish(False)
                        continue
                    _, a, k, sfinal, violation, sblob = entry
                    j = index.get(k)
                    if j is not None:
                        if j != idx:
                            progressed = True
                            if check_liveness:
                                edge_src.append(idx)
                                edge_dst.append(j)
                        continue
                    progressed = True
                    j = register(k, idx, a)
                    if check_liveness:
                        edge_src.append(idx)
                        edge_dst.append(j)
                    if violation is not None:
                        if add_finding("violation", f"invariant broken after {_fmt_action(a)}: {violation}", j):
                            return finish(False)
                        continue
                    if sblob is None:  # pragma: no cover - a worker sends every unsent new state
                        raise RuntimeError(f"explorer worker sent no state for new key {k!r}")
                    res.states += 1
                    nxt_level.append((j, sblob, sfinal))
                if check_deadlocks and not progressed and not final:
                    why = getattr(system, "deadlock_reason", None)
                    msg = "no action changes the state, but work is unfinished"
                    if why is not None:
                        msg += f": {why(_load(system, blob))}"
                    if add_finding("deadlock", msg, idx):
                        return finish(False)
                n += 1
                if max_seconds is not None and n % 256 == 0 and time.perf_counter() - t0 > max_seconds:
                    return finish(False)
                if max_states is not None and res.states >= max_states:
                    return finish(False)
            level = nxt_level
            depth += 1
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        _SYSTEM = None
    if check_liveness and not cut and not (res.findings and stop_at_first):
        stuck = _first_stuck(len(keys), finals, edge_src, edge_dst, parents)
        if stuck is not None and not any(f.kind == "deadlock" for f in res.findings):
            add_finding("livelock", "no final state is reachable from here (actions only cycle)", stuck)
    return finish(not (res.findings and stop_at_first) and not cut)
