"""Two arithmetic back-ends for the same formula source: plain Python ints and Z3 terms.

Every formula in :mod:`kvref.proofs.formulas` is written once against an ``ops`` object. With
:class:`PyOps` it computes a number (concrete checks, reproducer files, agreement tests); with
:class:`Z3Ops` it builds Z3 terms over *unbounded* integers for the proofs.

Division is the only non-linear step. As docs/proofs.md explains, ``cdiv(x, b)`` becomes a fresh
integer ``q`` with ``q*b >= x`` and ``(q-1)*b < x``, and ``x // b`` a fresh ``q`` with
``q*b <= x < (q+1)*b``. The defining constraints are collected in ``Z3Ops.side`` and asserted with
the theorem; they pin ``q`` down uniquely whenever ``b > 0``, which every theorem states as a
hypothesis. ``gcd``/``lcm`` are pinned down the same way through Bezout witnesses.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import z3


class PyOps:
    """Python ints: the formulas evaluate to numbers."""

    name = "python"

    @staticmethod
    def cdiv(x: int, b: int) -> int:
        return -(x // -b)

    @staticmethod
    def fdiv(x: int, b: int) -> int:
        return x // b

    @staticmethod
    def min(a: int, b: int) -> int:
        return a if a <= b else b

    @staticmethod
    def max(a: int, b: int) -> int:
        return a if a >= b else b

    @staticmethod
    def ite(c: bool, a: Any, b: Any) -> Any:
        return a if c else b

    @staticmethod
    def And(*xs: bool) -> bool:
        return all(xs)

    @staticmethod
    def Or(*xs: bool) -> bool:
        return any(xs)

    @staticmethod
    def Not(x: bool) -> bool:
        return not x

    @staticmethod
    def Implies(a: bool, b: bool) -> bool:
        return (not a) or b

    @staticmethod
    def divides(d: int, x: int) -> bool:
        return x % d == 0

    @staticmethod
    def not_divides(d: int, x: int) -> bool:
        return x % d != 0

    @staticmethod
    def gcd(a: int, b: int) -> int:
        return math.gcd(a, b)

    @staticmethod
    def lcm(a: int, b: int) -> int:
        return math.lcm(a, b)


class Z3Ops:
    """Z3 terms over unbounded Ints; divisions introduce fresh witnesses (see module doc)."""

    name = "z3"
    _ids = itertools.count()

    def __init__(self) -> None:
        self.side: list[z3.BoolRef] = []

    def fresh(self, stem: str) -> z3.ArithRef:
        return z3.Int(f"_{stem}{next(self._ids)}")

    def cdiv(self, x, b):
        if isinstance(x, int) and isinstance(b, int):
            return PyOps.cdiv(x, b)
        q = self.fresh("cdiv")
        self.side += [q * b >= x, (q - 1) * b < x]
        return q

    def fdiv(self, x, b):
        if isinstance(x, int) and isinstance(b, int):
            return PyOps.fdiv(x, b)
        q = self.fresh("fdiv")
        self.side += [q * b <= x, x < (q + 1) * b]
        return q

    @staticmethod
    def min(a, b):
        return z3.If(a <= b, a, b)

    @staticmethod
    def max(a, b):
        return z3.If(a >= b, a, b)

    @staticmethod
    def ite(c, a, b):
        if isinstance(c, bool):
            return a if c else b
        return z3.If(c, a, b)

    @staticmethod
    def And(*xs):
        return z3.And(*xs)

    @staticmethod
    def Or(*xs):
        return z3.Or(*xs)

    @staticmethod
    def Not(x):
        return z3.Not(x)

    @staticmethod
    def Implies(a, b):
        return z3.Implies(a, b)

    def divides(self, d, x):
        """Hypothesis ``d | x`` as ``x == d*k``, fresh ``k``: sound only where it is assumed
        (an existential witness), never inside a negated goal."""
        return x == d * self.fresh("mult")

    def not_divides(self, d, x):
        """``x % d != 0`` for ``d > 0`` as ``x == d*q + r`` with ``0 < r < d`` (existential, so it
        may appear in a negated goal)."""
        q, r = self.fresh("q"), self.fresh("r")
        return z3.And(x == d * q + r, r > 0, r < d)

    def gcd(self, a, b):
        """``gcd(a, b)`` for ``a > 0``, ``b >= 0``: a common divisor ``g > 0`` with Bezout witnesses
        ``a*x + b*y == g``, which makes it the greatest one."""
        g, ka, kb, x, y = (self.fresh(s) for s in ("g", "ka", "kb", "bx", "by"))
        self.side += [g > 0, a == g * ka, b == g * kb, a * x + b * y == g]
        return g

    def lcm(self, a, b):
        """``lcm(a, b)`` for ``a, b > 0`` as ``L`` with ``L * gcd(a, b) == a * b``."""
        g = self.gcd(a, b)
        L = self.fresh("lcm")
        self.side.append(L * g == a * b)
        return L


def ints(names: str) -> list[z3.ArithRef]:
    """``ints("a b c")`` -> Z3 Int variables with those names."""
    return [z3.Int(n) for n in names.split()]


def bools(names: str) -> list[z3.BoolRef]:
    return [z3.Bool(n) for n in names.split()]
