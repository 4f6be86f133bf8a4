"""The explorer's vocabulary, shared by the engine (:mod:`.explorer`) and the search
(:mod:`.explorer_search`): what a transition system is, what a search finds, and the helpers that
turn the search's arrays back into shortest traces. Kept apart so the import graph runs one way:
``explorer`` -> ``explorer_search`` -> ``explorer_types``.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterable, Protocol, Sequence, TypeVar

S = TypeVar("S")


class TransitionSystem(Protocol[S]):
    """What the explorer needs from a system under exploration.

    ``step`` must not mutate its input state (copy first); states must stay valid while queued.
    """

    def initial_states(self) -> Iterable[S]:
        """The states the search starts from."""

    def actions(self, state: S) -> Sequence[Hashable]:
        """Actions enabled in ``state`` (a deterministic order keeps traces reproducible)."""

    def step(self, state: S, action: Hashable) -> S:
        """The successor of ``state`` under ``action``; may raise to report a violation."""

    def key(self, state: S) -> Hashable:
        """Canonical, hashable description of ``state`` (symmetric states may share a key)."""

    def check(self, state: S) -> None:
        """Raise ``AssertionError`` if an invariant is broken in ``state``."""

    def is_final(self, state: S) -> bool:
        """Whether all work is done in ``state`` (a final state is never a deadlock)."""

    # optional: ``deadlock_reason(state) -> str`` says, for the report, what is stuck
    # optional: ``step_consuming(state, action) -> state`` is ``step`` allowed to reuse (mutate)
    # ``state``; the engine calls it for a state's last action, after which it drops the state

    def describe(self, state: S) -> dict[str, str]:
        """Columns shown for ``state`` in a counterexample step table."""


@dataclass(frozen=True)
class Step:
    """One row of a trace: the action taken and the state it led to."""

    action: Hashable | None  # None for the initial state
    state: dict[str, str]


@dataclass
class Trace:
    steps: list[Step]

    @property
    def length(self) -> int:
        """Number of actions (the initial state is not an action)."""
        return len(self.steps) - 1


@dataclass
class Finding:
    """A violation or a deadlock, with the shortest trace that reaches it."""

    kind: str  # "violation" | "deadlock" | "livelock"
    message: str
    trace: Trace
    failed_action: Hashable | None = None  # for violations raised by a step: the action that raised


@dataclass
class ExplorationResult:
    states: int = 0
    transitions: int = 0
    depth: int = 0
    seconds: float = 0.0
    complete: bool = True  # False if stopped early (max_states / first finding / time)
    findings: list[Finding] = field(default_factory=list)

    @property
    def states_per_second(self) -> float:
        return self.states / self.seconds if self.seconds > 0 else float("inf")

    @property
    def violations(self) -> list[Finding]:
        return [f for f in self.findings if f.kind == "violation"]

    @property
    def deadlocks(self) -> list[Finding]:
        return [f for f in self.findings if f.kind == "deadlock"]

    @property
    def livelocks(self) -> list[Finding]:
        return [f for f in self.findings if f.kind == "livelock"]

    @property
    def ok(self) -> bool:
        return not self.findings

    def summary(self) -> str:
        return (f"{self.states} states, {self.transitions} transitions, depth {self.depth}, "
                f"{self.seconds:.2f}s ({self.states_per_second:,.0f} states/s), "
                f"{len(self.violations)} violations, {len(self.deadlocks)} deadlocks"
                + (f", {len(self.livelocks)} livelocks" if self.livelocks else "")
                + ("" if self.complete else " [incomplete]"))


def first_stuck(n: int, finals: list[int], src: array, dst: array, parents: list[int]) -> int | None:
    """The first state (BFS order = shallowest) from which no final state is reachable."""
    preds: list[list[int]] = [[] for _ in range(n)]
    for a, b in zip(src, dst):
        preds[b].append(a)
    good = bytearray(n)
    stack = list(finals)
    for f in finals:
        good[f] = 1
    while stack:
        b = stack.pop()
        for a in preds[b]:
            if not good[a]:
                good[a] = 1
                stack.append(a)
    for i in range(n):  # indices are in BFS discovery order
        if not good[i]:
            return i
    return None


def fmt_exc(e: BaseException) -> str:
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def safe_describe(system: TransitionSystem[Any], state: Any) -> dict[str, str]:
    try:
        return system.describe(state)
    except Exception as e:  # noqa: BLE001 - a broken state may not describe itself
        return {"state": f"<cannot describe: {fmt_exc(e)}>"}


def rebuild_trace(system: TransitionSystem[Any], keys: list, parents: list[int], via: list,
                   idx: int | None) -> Trace:
    """Replay the action path from an initial state to ``key`` and describe every state.

    States are not stored per key (memory), so the path is re-executed; replay is deterministic
    because ``step`` is. The replay picks, at each depth, the initial state / successor whose key
    matches the recorded one.
    """
    if idx is None:
        return Trace([])
    path: list[tuple[Hashable, Hashable | None]] = []  # (key, action that led to it)
    i = idx
    while i >= 0:
        path.append((keys[i], via[i]))
        i = parents[i]
    path.reverse()
    first_key = path[0][0]
    state = next(s for s in system.initial_states() if system.key(s) == first_key)
    steps = [Step(None, safe_describe(system, state))]
    for k, a in path[1:]:
        state = system.step(state, a)
        steps.append(Step(a, safe_describe(system, state)))
    return Trace(steps)


def fmt_action(a: Hashable) -> str:
    if isinstance(a, tuple):
        return " ".join(str(x) for x in a)
    return str(a)
