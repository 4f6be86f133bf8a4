"""``kvref explore --ray``: each BFS level's frontier in chunks on Ray workers (issue #27).

The explorer's search (:mod:`kvref.models.explorer.search`) keeps everything that decides *which*
states exist in the driver: the index, the parent pointers, the findings, and the merge of the
expansion reports in frontier order. Here the expanders are Ray tasks instead of forked workers:

* from the first level of at least ``min_parallel_level`` states on, the driver holds every
  frontier state as bytes (a portable pickle) and ships each level in chunks, one Ray task each
  (:func:`expand_unit`); a task loads its states, expands them exactly as a local worker does, and
  returns per state its report plus the bytes of each successor it met the first time. The driver
  merges the reports chunk by chunk, in frontier order, and keeps the bytes of the successors it
  registered for the next level. So the states, counts and shortest traces are those of a local
  run, whatever the chunking (tests/cli/test_ray_explore.py compares them).
* A task holds no state between levels, so a worker that dies under a chunk is retried once on
  another process (``max_retries=1``); a second death is an **error** of that unit and ends the
  exploration with the error (exit 1, never a pass: the level is incomplete). A task that raises
  is an error at once, except the explorer's own input error (a scope too large to copy), which is
  raised as locally (exit 2).
* Ctrl-C cancels every chunk still out (``ray.cancel(force=True)``) and returns the partial result
  with ``interrupted`` set; ``kvref explore`` prints it as such and exits 130.

The system is sent once per exploration (``ray.put``) and cached in each worker process by a
token. A planted fault (a mutant of the catalogue, as the explorer's tests plant them) must be
active in the workers too: ``mutants`` names those each task applies around its chunk (the driver
applies them itself for its own levels and the trace replays). docs/ray.md.
"""

from __future__ import annotations

import gc
import math
import pickle
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: states per unit below which a level is not cut further (a task's round trip costs ~10 ms)
MIN_CHUNK_STATES = 32
#: units per CPU of the cluster per level (some slack so a slow chunk does not idle the others)
CHUNKS_PER_CPU = 2

#: worker side: systems by token (a worker process runs many chunks of one exploration)
_SYSTEMS: dict[str, Any] = {}


class RayUnitError(RuntimeError):
    """A chunk whose worker died twice, or that raised: the level cannot be merged."""


def portable_dump(state: Any) -> bytes:
    """A state as bytes any process can load: a plain pickle. (``KVSystem.dump`` shares frozen
    configs by ``id`` with the processes forked after it, which a Ray worker is not; a state's
    ``_blob`` is a cache of its own copy and is left out.)"""
    blob = getattr(state, "_blob", None)
    if blob is not None:
        state._blob = None
    try:
        return pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
    finally:
        if blob is not None:
            state._blob = blob


def _system(token: str, box: list) -> Any:
    system = _SYSTEMS.get(token)
    if system is None:
        import ray

        _SYSTEMS.clear()  # one exploration at a time per worker process
        system = _SYSTEMS[token] = ray.get(box[0])
    return system


def expand_unit(token: str, box: list, mutants: tuple[str, ...], items: list[tuple[str, bytes]]) -> list:
    """On a worker: expand one chunk of a level (:func:`kvref.models.explorer.search.expand_shipped`),
    with the planted ``mutants`` applied."""
    from contextlib import ExitStack

    from kvref.models.explorer.search import expand_shipped

    system = _system(token, box)
    load = getattr(system, "load", None) or pickle.loads
    with ExitStack() as stack:
        if mutants:
            from kvref.models.mutants.catalogue import CATALOGUE

            for name in mutants:
                stack.enter_context(CATALOGUE[name].applied())
        return expand_shipped(system, items, load, portable_dump)


class RayBackend:
    """The search's pool factory for Ray (``search(..., backend=RayBackend(...))``)."""

    def __init__(self, mutants: tuple[str, ...] = (), chunk_states: int = MIN_CHUNK_STATES,
                 log: Callable[[str], None] | None = None, max_retries: int = 1) -> None:
        self.mutants = tuple(mutants)
        self.chunk_states = chunk_states
        self.log = log
        self.max_retries = max_retries
        #: every unit submitted, in order (tests look at the cancelled ones)
        self.refs: list = []
        self.units = 0

    def dump(self, state: Any) -> bytes:
        return portable_dump(state)

    def start(self, system: Any, seeds: list[tuple[str, bytes]]) -> "_RayPool":
        return _RayPool(self, system, seeds)


class _RayPool:
    """One "worker" (index 0) for the search: a level is shipped in chunks, the reports come back
    in frontier order."""

    def __init__(self, backend: RayBackend, system: Any, seeds: list[tuple[str, bytes]]) -> None:
        import ray

        self.ray = ray
        self.backend = backend
        self.store: dict[str, bytes] = dict(seeds)
        self.token = uuid.uuid4().hex
        self.box = [ray.put(system)]  # in a list: Ray does not resolve it into every task's arguments
        self.remote = ray.remote(num_cpus=1, max_retries=backend.max_retries, retry_exceptions=False)(expand_unit)
        self.cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
        self.queue: deque = deque()  # (ref, first state's position, count) of this level, in order
        self.buffer: deque = deque()
        self.level = 0
        self.level_size = 0

    def _chunks(self, n: int) -> int:
        return max(1, min(math.ceil(n / self.backend.chunk_states), CHUNKS_PER_CPU * self.cpus))

    def expand(self, per_worker: list[list[str]]) -> None:
        keys = per_worker[0]
        items = [(k, self.store[k]) for k in keys]
        self.store = {}
        self.level += 1
        self.level_size = len(items)
        parts = self._chunks(len(items))
        size = math.ceil(len(items) / parts) if items else 0
        for first in range(0, len(items), size or 1):
            chunk = items[first:first + size]
            ref = self.remote.remote(self.token, self.box, self.backend.mutants, chunk)
            self.backend.refs.append(ref)
            self.backend.units += 1
            self.queue.append((ref, first, len(chunk)))
        if self.backend.log is not None:
            self.backend.log(f"a level of {len(items):,} state(s) in {len(self.queue)} unit(s) on Ray")

    def _fetch(self) -> None:
        from ray.exceptions import RayError, RayTaskError

        from kvref.spec.errors import InvalidFieldError

        ref, first, count = self.queue[0]
        where = (f"the Ray unit of states {first + 1}-{first + count} of a level of {self.level_size:,} "
                 f"(the {self.level}. level on Ray)")
        try:
            reports = self.ray.get(ref)
        except RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, InvalidFieldError):  # the explorer's own input error: as locally
                raise cause from None
            lines = str(cause if cause is not None else exc).strip().splitlines()
            raise RayUnitError(f"{where} raised {type(cause or exc).__name__}: {lines[0] if lines else ''}"[:500]) \
                from None
        except RayError as exc:  # the worker died twice (max_retries=1), or its node was lost
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise RayUnitError(f"{where}: {type(exc).__name__} on Ray after {self.backend.max_retries + 1} "
                               f"attempt(s): {first_line}"[:500]) from None
        self.queue.popleft()
        for why, entries in reports:
            out = []
            for e in entries:
                if len(e) == 6:  # ("new", action, key, final, None, blob): keep the blob for the next level
                    self.store.setdefault(e[2], e[5])
                    e = e[:5]
                out.append(e)
            self.buffer.append((why, out))

    def next_report(self, w: int) -> tuple:
        while not self.buffer:
            self._fetch()
        return self.buffer.popleft()

    def close(self) -> None:
        for ref, _, _ in self.queue:  # a stop mid-level (finding, limit, error, Ctrl-C): cancel the rest
            self.ray.cancel(ref, force=True)
        self.queue.clear()


@dataclass
class RayExploration:
    """What ``explore`` on Ray found: the result (as a local run's), and whether it was cut short."""

    result: Any
    interrupted: bool = False
    #: why a unit gave no report (its worker died twice, or it raised); the result is then partial
    error: str | None = None
    units: int = 0
    refs: list = field(default_factory=list)


def explore_on_ray(system: Any, *, mutants: tuple[str, ...] = (), min_parallel_level: int = 64,
                   chunk_states: int = MIN_CHUNK_STATES, log: Callable[[str], None] | None = None,
                   max_states: int | None = None, max_seconds: float | None = None, stop_at_first: bool = True,
                   check_deadlocks: bool = True, check_liveness: bool = False, max_findings: int = 10,
                   max_depth: int | None = None, progress: Any = None) -> RayExploration:
    """:func:`kvref.models.explorer.engine.explore` with the levels of at least ``min_parallel_level``
    states (and every level after the first such) expanded on the Ray cluster this process joined."""
    from kvref.models.explorer.engine import ExplorationResult
    from kvref.models.explorer.search import search
    from kvref.spec.errors import check_int

    check_int("max_findings", max_findings, minimum=1)
    check_int("max_states", max_states, minimum=1, allow_none=True)
    check_int("max_depth", max_depth, minimum=0, allow_none=True)
    check_int("min_parallel_level", min_parallel_level, minimum=1)
    check_int("chunk_states", chunk_states, minimum=1)
    backend = RayBackend(mutants, chunk_states, log)
    res = ExplorationResult()
    out = RayExploration(res)
    t0 = time.perf_counter()
    old = gc.get_threshold()
    gc.set_threshold(max(old[0], 50_000), max(old[1], 20), max(old[2], 100))  # as explore() does
    try:
        search(system, res, workers=1, max_states=max_states, max_seconds=max_seconds, stop_at_first=stop_at_first,
               check_deadlocks=check_deadlocks, check_liveness=check_liveness, max_findings=max_findings,
               max_depth=max_depth, min_parallel_level=min_parallel_level, progress=progress, backend=backend)
    except KeyboardInterrupt:
        from kvref.cli.interrupt import acknowledge

        acknowledge()  # taken: the partial report is written, not interrupted again
        out.interrupted, res.complete = True, False
        res.seconds = time.perf_counter() - t0
    except RayUnitError as exc:
        out.error, res.complete = str(exc), False
        res.seconds = time.perf_counter() - t0
    finally:
        gc.set_threshold(*old)
    out.units, out.refs = backend.units, backend.refs
    return out


def run_on_ray(address: str, system: Any, options: dict, progress: Any) -> tuple[Any, dict]:
    """``kvref explore --ray ADDRESS``: join (or start) the cluster, check the workers' versions,
    explore, leave. Returns the result and the report's Ray fields: ``ray`` (where, with what),
    ``units``, ``interrupted``, ``error``."""
    from kvref.ray_runner import describe, start, stop

    import sys

    info = start(address)
    said = []

    def log(line: str) -> None:  # the first hand-over is said at once, the later levels as progress
        if said or not progress.enabled:
            progress.update(line)
            return
        said.append(line)
        print(f"explore: {line}", file=sys.stderr, flush=True)

    if progress.enabled:
        print(describe(info), file=sys.stderr, flush=True)
    try:
        with progress.heartbeat("expanding the first states"):
            got = explore_on_ray(system, log=log, **options)
    finally:
        stop(info)
    return got.result, {"ray": info, "units": got.units, "interrupted": got.interrupted, "error": got.error}
