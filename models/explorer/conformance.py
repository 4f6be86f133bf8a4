"""Exhaustive conformance: every transition of a scope's state graph, on vLLM 0.33.0 (and the torch
KV cache manager) in lock step with the reference.

The explorer (:mod:`kvref.models.explorer.kv`) visits every reachable state of a scope on the
reference alone; the state machines compare implementations on *generated* traces. This module
does both at once: it takes the reference's whole state graph at a scope and checks that the other
implementations agree with it on **every transition** — for each edge (state ``s``, action ``a``)
the targets are driven along the breadth-first path to ``s`` and then ``a``, in lock step with a
fresh reference, comparing every step's output (scheduled requests with their block ids,
preempted and finished ids) and the observable snapshot (queues, every request's progress and
output tokens, block tables, free-block count and the free queue in eviction order) after every
action, and running each target's ``check_invariants()``.

Targets (``targets=``):

* ``"vllm"`` — vLLM 0.33.0's own ``Scheduler`` / ``AsyncScheduler`` with its ``KVCacheManager``
  (:class:`kvref.impl.vllm.scheduler.VllmScheduler`);
* ``"torch"`` — the reference scheduler over the torch implementation's KV cache manager
  (state in tensors; ``make_manager("torch", pool)``).

vLLM's objects cannot be copied (they hold loggers, locks and C-level state), so targets are
replayed from the initial state: the edge paths form a trie, and only its leaves are replayed —
every edge lies on the way to a leaf, so every transition is compared (the replays cost about
``transitions x depth`` calls in all).

Semantics are the explorer's (so the graph is exactly the explored one): arrivals in any order,
the fake model samples token ``50 + position``, completions are FIFO, a ``schedule`` that schedules
nothing puts no step in flight. vLLM's engine still settles such an empty step
(``update_from_output`` with no tokens), so the vLLM target does that at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

from kvref.spec.errors import InvalidFieldError

from kvref.models.explorer.kv import SCOPES, KVSystem, Scope, sampled_token
from kvref.models.explorer.scope_lookup import named_scope
from kvref.models.explorer.vocabulary import fmt_action
from kvref.models.machines.scheduler import _diff, _fmt  # the lock-step machine's renderings of outputs / snapshots

__all__ = ["ConformanceResult", "TARGETS", "explore_conformance"]

#: the implementations a scope can be checked against
TARGETS = ("vllm", "torch")


@dataclass
class ConformanceResult:
    scope: str
    targets: tuple[str, ...]
    states: int = 0
    transitions: int = 0
    depth: int = 0
    replays: int = 0  # leaf paths replayed
    calls: int = 0  # actions applied per target, over all replays
    seconds: float = 0.0
    complete: bool = True
    #: the first divergence: (actions from the initial state, message), or None
    divergence: tuple[tuple[Hashable, ...], str] | None = None
    coverage: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.divergence is None

    def summary(self) -> str:
        head = (f"{self.states:,} states, {self.transitions:,} transitions (depth {self.depth}) compared with "
                f"{', '.join(self.targets)} in {self.replays:,} replays ({self.calls:,} calls) in {self.seconds:.1f}s")
        if not self.complete:
            head += " (stopped early: max_states)"
        if self.divergence is not None:
            path, msg = self.divergence
            head += f"; DIVERGENCE after {' -> '.join(fmt_action(a) for a in path)}: {msg}"
        return head


class _Lockstep:
    """The reference and the targets driven by the explorer's actions, compared after each."""

    def __init__(self, system: KVSystem, factories: dict[str, Callable]) -> None:
        from kvref.impl.reference.adapter import ReferenceKVCacheManager
        from kvref.impl.reference.scheduler import Scheduler

        self.system = system
        scope = system.scope
        self.pool, self.config = scope.pool_config(), scope.scheduler_config()
        self.targets = {"reference": Scheduler(self.pool, self.config, ReferenceKVCacheManager(self.pool))}
        self.targets.update((name, f(self.pool, self.config)) for name, f in factories.items())
        self.requests: dict[str, dict[str, Any]] = {name: {} for name in self.targets}
        self.in_flight: list[dict[str, Any]] = []

    def apply(self, action: Hashable) -> None:
        from kvref.impl.scheduler_types import ModelOutput
        from kvref.impl.request import Request

        scope, kind = self.system.scope, action[0]  # type: ignore[index]
        if kind == "arrive":
            i = self.system.ids.index(action[1])  # type: ignore[index]
            for name, t in self.targets.items():
                r = Request(action[1], list(scope.prompts[i]), max_tokens=scope.max_tokens[i],
                            arrival_time=float(i), cache_salt=scope.salts[i] if scope.salts else None)
                self.requests[name][r.request_id] = r
                t.add_request(r)
        elif kind == "schedule":
            outs = {name: t.schedule() for name, t in self.targets.items()}
            ref = outs["reference"]
            for name, o in outs.items():
                if (o.scheduled, o.preempted_req_ids, o.finished_req_ids) != \
                        (ref.scheduled, ref.preempted_req_ids, ref.finished_req_ids):
                    raise AssertionError(f"schedule: reference -> {_fmt(ref)}\n          {name} -> {_fmt(o)}")
            if ref.scheduled:
                self.in_flight.append(outs)
            else:  # no step in flight (the explorer's rule); vLLM's engine settles the empty step
                for name, t in self.targets.items():
                    if hasattr(t, "_in_flight"):
                        t._in_flight.pop(id(outs[name]), None)
                    else:
                        t.update_from_output(outs[name], ModelOutput({}))
        elif kind == "complete":
            outs = self.in_flight.pop(0)
            ref_sched = self.targets["reference"]
            sampled = {}
            for sr in outs["reference"].scheduled:
                if sr.request_id in ref_sched.requests and not sr.is_prefill_chunk:
                    sampled[sr.request_id] = [sampled_token(sr.num_computed_tokens + sr.num_scheduled_tokens)]
            for name, t in self.targets.items():
                t.update_from_output(outs[name], ModelOutput(dict(sampled)))
        elif kind == "abort":
            for t in self.targets.values():
                t.finish_requests([action[1]])  # type: ignore[index]
        else:
            raise InvalidFieldError("action", action, "arrive / schedule / complete / abort")
        self.compare()

    def compare(self) -> None:
        snaps = {}
        for name, t in self.targets.items():
            t.check_invariants()
            try:
                snaps[name] = t.snapshot(self.requests[name].values())
            except TypeError:  # vLLM's adapter keeps every request it was given
                snaps[name] = t.snapshot()
        ref = snaps["reference"]
        for name, s in snaps.items():
            if s != ref:
                raise AssertionError(f"snapshots differ: reference vs {name}\n{_diff(ref, s)}")


def _factories(targets: tuple[str, ...]) -> dict[str, Callable]:
    from kvref.impl.reference.scheduler import Scheduler

    out: dict[str, Callable] = {}
    for name in targets:
        if name == "vllm":
            from kvref.impl.vllm.scheduler import VllmEnv, VllmScheduler

            env = VllmEnv()
            out["vllm"] = lambda p, c, env=env: VllmScheduler(p, c, env)
        elif name == "torch":
            from kvref.impl.interface import make_manager

            out["torch"] = lambda p, c: Scheduler(p, c, make_manager("torch", p))
        else:
            raise InvalidFieldError("targets", name, "one of " + ", ".join(TARGETS))
    return out


def _edge_paths(system: KVSystem, max_states: int | None) -> tuple[list[tuple], int, int, int, bool]:
    """Breadth-first over the reference (the explorer's states and keys): the path of every edge.

    Returns (leaf paths, states, transitions, depth, complete). A leaf path is an edge path that is
    no proper prefix of another edge path: replaying the leaves replays every edge.
    """
    s0 = system.initial_states()[0]
    seen = {system.key(s0)}
    level: list[tuple[Any, tuple]] = [(s0, ())]
    edges: list[tuple] = []
    expanded: set[tuple] = set()  # paths of states that have outgoing edges
    depth = 0
    complete = True
    while level:
        nxt: list[tuple[Any, tuple]] = []
        for s, path in level:
            acts = system.actions(s)
            if acts:
                expanded.add(path)
            for a in acts:
                t = system.step(s, a)
                p = path + (a,)
                edges.append(p)
                k = system.key(t)
                if k not in seen:
                    seen.add(k)
                    nxt.append((t, p))
            if max_states is not None and len(seen) >= max_states:
                complete = False
                nxt = []
                break
        if nxt:
            depth += 1
        level = nxt
    leaves = [p for p in edges if p not in expanded]
    return leaves, len(seen), len(edges), depth, complete


def explore_conformance(scope: Scope | str, targets: tuple[str, ...] | list[str] = ("vllm",),
                        max_states: int | None = None) -> ConformanceResult:
    """Compare ``targets`` with the reference on every transition of ``scope``'s state graph.

    Stops at the first divergence (``result.divergence``: the shortest-first path and the
    difference). Needs vLLM 0.33.0 for ``"vllm"`` and torch for ``"torch"``.
    """
    scope = named_scope(scope, SCOPES, Scope)
    targets = tuple(targets)
    if not targets or len(set(targets)) != len(targets):
        raise InvalidFieldError("targets", targets, "one or more of " + ", ".join(TARGETS) + ", each once")
    factories = _factories(targets)
    t0 = time.perf_counter()
    system = KVSystem(scope)
    leaves, states, transitions, depth, complete = _edge_paths(system, max_states)
    res = ConformanceResult(scope.name, targets, states, transitions, depth, complete=complete)
    # shortest first: a divergence is reported with the shortest path the replays meet it on
    for path in sorted(leaves, key=len):
        lock = _Lockstep(system, factories)
        res.replays += 1
        for i, a in enumerate(path):
            res.calls += 1
            res.coverage[a[0]] = res.coverage.get(a[0], 0) + 1
            try:
                lock.apply(a)
            except AssertionError as e:
                res.divergence = (path[:i + 1], str(e))
                res.seconds = time.perf_counter() - t0
                return res
    res.seconds = time.perf_counter() - t0
    return res
