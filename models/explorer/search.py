"""The explorer's search: level-synchronous breadth-first search, in one process or spread over
forked worker processes.

The reference is plain Python, and one expansion (copy the state, run the scheduler, hash the
key, check every invariant) costs 100-300 µs of interpreter time that no single-process trick
removes (the pickle copy alone is ~40 % of it, BENCHMARKS.md). Expanding the states of one BFS level is
embarrassingly parallel, so this module spreads the expansions over forked worker processes and
keeps everything that decides *which* states exist in the parent:

* a **worker** owns the live states it created: in the next level it expands exactly those the
  parent tells it to (the parent registered them as new), with the sequential engine's copying
  scheme (copy per action, the last action steps the state itself). States never travel between
  processes, only what the parent needs to know about them: per successor its key, whether it
  is final, its invariant violation if any. A successor this worker met before is reported by
  key alone; one met the first time is checked and kept (if another worker reported it first, the
  parent does not ask for it and it is dropped at the end of the level);
* the **parent** merges the reports *in frontier order*, state by state and action by action,
  exactly as the sequential engine pops its FIFO queue. It alone owns the index, the parent
  pointers and the findings.

So the result does not depend on the number of workers: same states in the same discovery order,
same transition count, same depth, the same first finding with the same shortest trace — those of
a textbook FIFO breadth-first search (``tests/models/test_explorer_search.py`` compares both with
such a search, ``tests/models/fifo_bfs.py``, on every scope, with findings and limits). With one
worker everything runs in this process. Small levels are expanded in the parent (forking costs
more than they do); the
workers start at the first level of at least ``min_parallel_level`` states, which is serialized
once (``system.dump``) and dealt out round robin.

Keys cross processes as their ``repr`` (see :class:`_ReprKeyed`), so ``key`` must not depend on
the process (no per-process numbering): :class:`~kvref.models.explorer.kv.KVSystem` fixes its
content numbering from the workload for this. Needs the ``fork`` start method (Linux; elsewhere
:func:`kvref.models.explorer.engine.explore` stays in one process).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import time
from array import array
from collections import deque
from multiprocessing.connection import wait
from typing import Any, Hashable

from kvref.spec.errors import InvalidFieldError

from kvref.models.explorer.vocabulary import Finding, Step, Trace, first_stuck, fmt_action, fmt_exc, rebuild_trace, safe_describe

__all__ = ["resolve_workers", "fork_available", "search", "expand_shipped"]

#: states a worker reports per message
_BATCH = 16


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


class _ReprKeyed:
    """``system`` with its keys as their ``repr`` strings.

    A key is a nested tuple; shipping it to the parent would mean pickling and unpickling every
    element, and the parent would hash it again on every lookup. Its ``repr`` is one string (hash
    cached, copied as a block). The explorer's keys are built from ints, strings, bytes, None,
    bools, tuples and enum members, whose ``repr`` is deterministic, so equal keys give equal
    strings; the converse holds too except for ``1 == True``-style coincidences, which would only
    split a state in two (never merge two different ones) and would show as a state count that
    differs from the sequential search's.
    """

    def __init__(self, system: Any) -> None:
        self._system = system

    def key(self, state: Any) -> str:
        return repr(self._system.key(state))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._system, name)


class _Expander:
    """Expands live states; runs in the parent for small levels and in every worker.

    ``live`` holds the states this process created in the current level and has not reported
    before (by key); ``sent`` every key it has reported.
    """

    def __init__(self, system: Any) -> None:
        self.system = system
        self.consume = getattr(system, "step_consuming", None)
        self.live: dict[str, Any] = {}
        self.next_live: dict[str, Any] = {}
        self.sent: set[str] = set()

    def expand(self, key: str) -> tuple[str | None, list]:
        """Report for the state with ``key``: (deadlock reason if nothing changed it, entries).

        Entries, one per enabled action in the system's order: ``("err", action, message,
        error)`` if the action raised; ``("same", action)`` if it led back to this state;
        ``("seen", action, key)`` for a successor this process reported before;
        ``("new", action, key, final, violation)`` for one it meets the first time.
        """
        system = self.system
        state = self.live.pop(key)
        acts = list(system.actions(state))
        last = len(acts) - 1
        out: list = []
        progressed = False
        for i, a in enumerate(acts):
            try:
                nxt = self.consume(state, a) if i == last and self.consume is not None else system.step(state, a)
            except RecursionError as e:
                # the explorer's own limit (states are copied by pickling; a pool of a few hundred
                # linked blocks is too deep), not a finding about the system: say so, as input
                from kvref.spec.errors import InvalidFieldError

                raise InvalidFieldError("scope", "too large for the explorer's state copies",
                                        f"a smaller scope (fewer blocks); action {fmt_action(a)} hit {fmt_exc(e)}") \
                    from None
            except Exception as e:  # noqa: BLE001 - any exception of the real code is a finding
                out.append(("err", a, f"action {fmt_action(a)} raised {fmt_exc(e)}", fmt_exc(e)))
                progressed = True
                continue
            k = system.key(nxt)
            if k == key:
                out.append(("same", a))
                continue
            progressed = True
            if k in self.sent:
                out.append(("seen", a, k))
                continue
            self.sent.add(k)
            try:
                system.check(nxt)
            except AssertionError as e:
                out.append(("new", a, k, False, fmt_exc(e)))
                continue
            self.next_live[k] = nxt
            out.append(("new", a, k, bool(system.is_final(nxt)), None))
        why = None
        if not progressed and not system.is_final(state):
            reason = getattr(system, "deadlock_reason", None)
            why = reason(state) if reason is not None else ""
        return why, out

    def next_level(self) -> None:
        self.live = self.next_live
        self.next_live = {}


def _worker_main(system: Any, conn: Any) -> None:
    """A worker: ``("seed", [(key, blob)])``, then per level ``("expand", [key, ...])``."""
    ex = _Expander(system)
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "seed":
                load = getattr(system, "load", None)
                for k, blob in msg[1]:
                    ex.live[k] = load(blob) if load is not None else pickle.loads(blob)
                    ex.sent.add(k)
            elif msg[0] == "expand":
                batch: list = []
                for k in msg[1]:
                    batch.append(ex.expand(k))
                    if len(batch) >= _BATCH:
                        conn.send(batch)
                        batch = []
                if batch:
                    conn.send(batch)
                ex.next_level()
            else:  # pragma: no cover - the parent terminates its workers
                return
    except (EOFError, KeyboardInterrupt):
        return
    except BaseException as e:  # noqa: BLE001 - hand the failure to the parent, which re-raises
        try:
            conn.send(("crash", e))
        except Exception:  # noqa: BLE001 - the exception itself may not pickle
            conn.send(("crash", RuntimeError(f"explorer worker failed: {type(e).__name__}: {e}")))


def expand_shipped(system: Any, items: list[tuple[str, bytes]], load: Any, dump: Any) -> list:
    """Expand shipped states, keeping none: for a pool whose workers hold no state between levels
    (``kvref explore --ray``: a Ray task per chunk of a level, retried on another process if its
    worker dies). ``items``: ``(key, blob)`` in frontier order, ``load(blob)`` the state; returns
    one report per item as :meth:`_Expander.expand` does, every ``"new"`` entry without a
    violation carrying ``dump(successor)`` as a sixth element (the pool keeps it for the next level).
    """
    ex = _Expander(_ReprKeyed(system))
    for k, blob in items:
        ex.live[k] = load(blob)
        ex.sent.add(k)  # a successor equal to a state of this chunk is registered already
    out = []
    for k, _ in items:
        why, entries = ex.expand(k)
        out.append((why, [e + (dump(ex.next_live.pop(e[2])),) if e[0] == "new" and e[4] is None else e
                          for e in entries]))
    return out


class _Workers:
    """The worker processes and the parent's ends of their pipes."""

    def __init__(self, system: Any, n: int, seeds: list[list[tuple[str, bytes]]]) -> None:
        ctx = multiprocessing.get_context("fork")
        self.conns: list = []
        self.procs: list = []
        for w in range(n):
            parent, child = ctx.Pipe(duplex=True)
            p = ctx.Process(target=_worker_main, args=(system, child), daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        for conn, seed in zip(self.conns, seeds):
            conn.send(("seed", seed))
        self.buffers: list[deque] = [deque() for _ in range(n)]

    def expand(self, per_worker: list[list[str]]) -> None:
        for conn, ks in zip(self.conns, per_worker):
            conn.send(("expand", ks))

    def next_report(self, w: int) -> tuple:
        """The next report of worker ``w``; reads whatever any worker has sent meanwhile, so
        no worker waits on a full pipe while the parent waits for another one."""
        buf = self.buffers[w]
        while not buf:
            for conn in wait(self.conns):
                i = self.conns.index(conn)
                try:
                    msg = conn.recv()
                except EOFError:
                    raise RuntimeError(f"explorer worker {i} exited unexpectedly") from None
                if isinstance(msg, tuple) and msg and msg[0] == "crash":
                    raise msg[1]
                self.buffers[i].extend(msg)
        return buf.popleft()

    def close(self) -> None:
        # workers hold nothing worth a clean exit (and may be blocked sending a level the parent
        # stopped reading after a finding): end them at once
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.join()
        for conn in self.conns:
            conn.close()


def search(system: Any, res: Any, *, workers: int, max_states: int | None,
                     max_seconds: float | None, stop_at_first: bool, check_deadlocks: bool,
                     check_liveness: bool, max_findings: int, max_depth: int | None,
                     min_parallel_level: int = 64, progress: Any = None, backend: Any = None) -> Any:
    """The body of :func:`kvref.models.explorer.engine.explore`; fills ``res``. ``progress(res, depth,
    level_size)`` is called every 256 expansions and at each new level (a long search is not silent).

    ``backend`` replaces the forked workers by another pool of expanders (``kvref explore --ray``,
    :mod:`kvref.ray_explore`): ``backend.dump(state)`` serializes a handed-over state and
    ``backend.start(system, [(key, blob), ...])`` returns a pool with :class:`_Workers`' ``expand`` /
    ``next_report`` / ``close``, seen as one worker (index 0) that reports in frontier order; the
    merge here is unchanged, so the result is the same as a local run's."""

    t0 = time.perf_counter()
    raw_system = system
    if backend is not None:
        workers = 1  # one pool, index 0; it spreads the level itself
    if workers > 1 or backend is not None:
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
        trace = rebuild_trace(system, keys, parents, via, idx) if idx is not None else Trace([])
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

    local = _Expander(system)
    # a level: (index, owner, final); owner -1 = this process
    level: list[tuple[int, int, bool]] = []
    for s0 in system.initial_states():
        try:
            system.check(s0)
        except AssertionError as e:
            if add_finding("violation", f"initial state: {fmt_exc(e)}", None,
                           extra=Step(None, safe_describe(system, s0))):
                return finish(False)
            continue
        k0 = system.key(s0)
        if k0 in index:
            continue
        local.live[k0] = s0
        local.sent.add(k0)
        level.append((register(k0, -1, None), -1, bool(system.is_final(s0))))
        res.states += 1

    pool: Any = None  # _Workers, or the backend's pool
    also_live: dict[int, list[int]] = {}
    n = 0
    cut = False
    depth = 0
    try:
        while level:
            res.depth = max(res.depth, depth)
            if max_depth is not None and depth >= max_depth:
                cut = cut or any(not final for _, _, final in level)
                break
            if pool is None and (workers > 1 or backend is not None) and len(level) >= min_parallel_level:
                # hand this level's states to the workers, round robin, serialized once; dumped
                # before the fork, so anything the dump registers exists in the workers too
                dump = backend.dump if backend is not None else getattr(system, "dump", None)
                seeds: list[list[tuple[str, bytes]]] = [[] for _ in range(workers)]
                for i, (idx, _, final) in enumerate(level):
                    k = keys[idx]
                    s = local.live.pop(k)
                    seeds[i % workers].append(
                        (k, dump(s) if dump is not None else pickle.dumps(s, protocol=pickle.HIGHEST_PROTOCOL)))
                    level[i] = (idx, i % workers, final)
                local.live.clear()
                pool = _Workers(system, workers, seeds) if backend is None else backend.start(raw_system, seeds[0])
            if pool is not None:
                per_worker: list[list[str]] = [[] for _ in range(workers)]
                for i, (idx, w, final) in enumerate(level):
                    # balance: a state met by several workers in the last level is live in each
                    # of them; the least loaded one expands it
                    holders = also_live.get(idx)
                    if holders:
                        w = min([w] + holders, key=lambda c: len(per_worker[c]))
                        level[i] = (idx, w, final)
                    per_worker[w].append(keys[idx])
                pool.expand(per_worker)
            first_new = len(keys)
            also_live: dict[int, list[int]] = {}
            nxt_level: list[tuple[int, int, bool]] = []
            for idx, w, final in level:
                why, entries = local.expand(keys[idx]) if w < 0 else pool.next_report(w)  # type: ignore[union-attr]
                if final:
                    finals.append(idx)
                progressed = False
                for entry in entries:
                    res.transitions += 1
                    tag = entry[0]
                    if tag == "same":
                        continue
                    progressed = True
                    if tag == "err":
                        _, a, msg, err = entry
                        if add_finding("violation", msg, idx, failed_action=a, extra=Step(a, {"error": err})):
                            return finish(False)
                        continue
                    a, k = entry[1], entry[2]
                    j = index.get(k)
                    if j is not None:
                        if j >= first_new and w >= 0:  # new in this level: w holds a live copy too
                            holders = also_live.setdefault(j, [])
                            if w not in holders:
                                holders.append(w)
                        if check_liveness:
                            edge_src.append(idx)
                            edge_dst.append(j)
                        continue
                    if tag != "new":  # pragma: no cover - a key reported before is registered
                        raise RuntimeError(f"explorer: a worker reported {k!r} as seen, but it is not registered")
                    _, a, k, sfinal, violation = entry
                    j = register(k, idx, a)
                    if check_liveness:
                        edge_src.append(idx)
                        edge_dst.append(j)
                    if violation is not None:
                        if add_finding("violation", f"invariant broken after {fmt_action(a)}: {violation}", j):
                            return finish(False)
                        continue
                    res.states += 1
                    nxt_level.append((j, w, sfinal))
                if check_deadlocks and not progressed and not final:
                    msg = "no action changes the state, but work is unfinished"
                    if why:
                        msg += f": {why}"
                    if add_finding("deadlock", msg, idx):
                        return finish(False)
                n += 1
                if n % 256 == 0:
                    if progress is not None:
                        res.seconds = time.perf_counter() - t0
                        progress(res, depth, len(level))
                    if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
                        return finish(False)
                if max_states is not None and res.states >= max_states:
                    return finish(False)
            local.next_level()
            level = nxt_level
            depth += 1
            if progress is not None:
                res.seconds = time.perf_counter() - t0
                progress(res, depth, len(level))
    finally:
        if pool is not None:
            pool.close()
    if check_liveness and not cut and not (res.findings and stop_at_first):
        stuck = first_stuck(len(keys), finals, edge_src, edge_dst, parents)
        if stuck is not None and not any(f.kind == "deadlock" for f in res.findings):
            add_finding("livelock", "no final state is reachable from here (actions only cycle)", stuck)
    return finish(not (res.findings and stop_at_first) and not cut)
