"""A toy system for the explorer: requests grabbing blocks one at a time from a shared pool.

It is the smallest system with the two failure shapes the explorer exists to find: an invariant
violation (``leak=True`` makes release drop a block) and a hold-and-wait deadlock (every request
holds part of what it needs, the pool is empty, nobody can finish — the shape of vLLM's
no-preemption hangs). ``preempt=True`` adds an action that frees a request's blocks, which removes
the deadlock. Used by the engine's tests and by ``kvref explore --toy``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

from kvref.spec.errors import check_int

ToyState = tuple[tuple[int, ...], tuple[bool, ...], int]  # (held per request, done, free)


@dataclass(frozen=True)
class ToyPool:
    num_blocks: int = 4
    needs: tuple[int, ...] = (3, 3)
    preempt: bool = False
    leak: bool = False
    symmetry: bool = True

    def __post_init__(self) -> None:
        check_int("num_blocks", self.num_blocks, minimum=1)
        for n in self.needs:
            check_int("needs[i]", n, minimum=1)

    def initial_states(self):
        n = len(self.needs)
        return [((0,) * n, (False,) * n, self.num_blocks)]

    def actions(self, s: ToyState) -> list[Hashable]:
        held, done, free = s
        acts: list[Hashable] = []
        for i, (h, d) in enumerate(zip(held, done)):
            if d:
                continue
            if h == self.needs[i]:
                acts.append(("finish", i))
            elif free > 0:
                acts.append(("grab", i))
            if self.preempt and 0 < h < self.needs[i]:
                acts.append(("preempt", i))
        return acts

    def step(self, s: ToyState, a: Hashable) -> ToyState:
        held, done, free = s
        kind, i = a  # type: ignore[misc]
        h, d = list(held), list(done)
        if kind == "grab":
            h[i] += 1
            free -= 1
        elif kind == "finish":
            free += h[i] - (1 if self.leak else 0)
            h[i] = 0
            d[i] = True
        elif kind == "preempt":
            free += h[i]
            h[i] = 0
        return tuple(h), tuple(d), free

    def key(self, s: ToyState) -> Hashable:
        if not self.symmetry:
            return s
        held, done, free = s
        # requests with equal need are interchangeable: sort them within each need class
        per = sorted(zip(self.needs, held, done))
        return tuple(per), free

    def check(self, s: ToyState) -> None:
        held, _, free = s
        assert free >= 0, f"negative free count {free}"
        assert free + sum(held) == self.num_blocks, (
            f"blocks lost: free {free} + held {sum(held)} != {self.num_blocks}")

    def is_final(self, s: ToyState) -> bool:
        return all(s[1])

    def describe(self, s: ToyState) -> dict[str, str]:
        held, done, free = s
        return {"held": " ".join(f"r{i}:{'done' if d else h}" for i, (h, d) in enumerate(zip(held, done))),
                "free": str(free)}
