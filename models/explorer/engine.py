"""Explicit-state explorer: breadth-first search over every reachable state of a small system.

This is the "model-checked" part of kvref. A :class:`TransitionSystem` says what a state is, which
actions are enabled in it and what each action does; :func:`explore` then visits every reachable
state exactly once (state hashing on a canonical key), runs the system's invariant check in every
state, and reports

* **violations**: an action raised (an ``AssertionError`` from ``check_invariants()``, or any other
  exception the real code threw, e.g. "Cannot get N free blocks from the pool") — with the
  shortest trace that reaches it;
* **deadlocks**: a state with unfinished work and no enabled progress action (vLLM #39734 / #35541
  were exactly this: a waiting request the gate never admits) — again with the shortest trace.

Breadth-first order is what makes the traces shortest: a state is first reached at its minimal
depth, and its parent pointer is recorded then.

Symmetry reduction is the system's business: ``key(state)`` may map symmetric states (e.g. two
requests with identical prompts whose ids are swapped) to the same key. That is sound as long as
the key is a *complete* description of the state up to the symmetry — two states with the same key
must have the same future up to renaming. :mod:`kvref.models.explorer.kv` documents why its key is.

The engine knows nothing about KV caches; tests drive it with toy systems too.
"""

from __future__ import annotations

import gc
from typing import Any

from kvref.spec.errors import check_int

from kvref.models.explorer.vocabulary import (  # noqa: F401  (re-exported: the explorer's public vocabulary)
    ExplorationResult,
    Finding,
    Step,
    Trace,
    TransitionSystem,
    fmt_action,
)

__all__ = [
    "TransitionSystem",
    "Step",
    "Trace",
    "Finding",
    "ExplorationResult",
    "explore",
    "render_trace",
]


def explore(system: TransitionSystem[Any], *, max_states: int | None = None,
            max_seconds: float | None = None, stop_at_first: bool = True,
            check_deadlocks: bool = True, check_liveness: bool = False,
            max_findings: int = 10, max_depth: int | None = None,
            workers: int | str | None = 1, progress: Any = None) -> ExplorationResult:
    """Breadth-first exploration of every state reachable from ``system.initial_states()``.

    Args:
        system: the system to explore.
        max_states: stop (``complete=False``) after this many distinct states.
        max_seconds: stop (``complete=False``) after this much wall time.
        stop_at_first: stop at the first violation or deadlock (its trace is still the shortest).
        check_deadlocks: report non-final states in which no action changes the state.
        check_liveness: after a complete search, also report the shallowest state from which no
            final state is reachable at all (a livelock: actions exist, but they go round in
            circles — e.g. admit, preempt, admit). Keeps the reverse edges in memory.
        max_findings: stop after this many findings when ``stop_at_first`` is False.
        max_depth: bounded exploration: states at this depth are checked but not expanded
            (``complete=False`` if any was cut off). For systems whose state carries a counter.
        workers: processes that expand states (1: this one only; ``"auto"`` / 0: one per CPU).
            With more than one, each BFS level is expanded by forked workers and merged in
            order (:mod:`kvref.models.explorer.search`): the same states, counts and shortest
            traces as with one, faster on a multi-core machine once a level is large.
        progress: called as ``progress(result_so_far, depth, level_size)`` every 256 expanded
            states (``kvref explore`` prints states, depth, rate and elapsed time from it).

    Returns:
        An :class:`ExplorationResult` with counts, timing and findings (shortest traces first).
    """
    # The search allocates container objects at a high rate (copied states, keys) and keeps the
    # keys alive: with the default thresholds the cyclic GC runs every 700 allocations and its
    # older generations re-walk the growing index (≈ 25 % of the time on the reference scopes).
    # Collect less often while exploring; copied states still die by reference counting, and
    # their cycles (free-list links) are collected at the higher threshold.
    from kvref.models.explorer.search import fork_available, resolve_workers, search

    n_workers = resolve_workers(workers)
    check_int("max_findings", max_findings, minimum=1)
    check_int("max_states", max_states, minimum=1, allow_none=True)
    check_int("max_depth", max_depth, minimum=0, allow_none=True)
    old = gc.get_threshold()
    gc.set_threshold(max(old[0], 50_000), max(old[1], 20), max(old[2], 100))
    try:
        return search(system, ExplorationResult(), workers=n_workers if fork_available() else 1,
                      max_states=max_states, max_seconds=max_seconds, stop_at_first=stop_at_first,
                      check_deadlocks=check_deadlocks, check_liveness=check_liveness,
                      max_findings=max_findings, max_depth=max_depth, progress=progress)
    finally:
        gc.set_threshold(*old)


def render_trace(trace: Trace, *, title: str = "counterexample", console: Any = None) -> str:
    """Render ``trace`` as a step table (``rich``); returns the text (and prints it if ``console``)."""
    from rich.console import Console
    from rich.table import Table

    columns: list[str] = []
    for st in trace.steps:
        for c in st.state:
            if c not in columns:
                columns.append(c)
    table = Table(title=f"{title} ({trace.length} steps)", show_lines=False)
    table.add_column("#", justify="right")
    table.add_column("action")
    for c in columns:
        table.add_column(c)
    for i, st in enumerate(trace.steps):
        table.add_row(str(i), "(initial)" if st.action is None else fmt_action(st.action),
                      *[st.state.get(c, "") for c in columns])
    out = Console(width=200, record=True, file=_NullIO()) if console is None else console
    out.print(table)
    return out.export_text() if console is None else ""


class _NullIO:
    def write(self, s: str) -> int:
        return len(s)

    def flush(self) -> None:
        pass
