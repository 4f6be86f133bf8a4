"""Integer helpers shared by the formulas (the same ones vLLM uses)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division for ints: ``-(-a // b)``."""
    return -(a // -b)


def round_up(x: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``x``."""
    return cdiv(x, multiple) * multiple


def round_down(x: int, multiple: int) -> int:
    """Largest multiple of ``multiple`` that is <= ``x``."""
    return (x // multiple) * multiple
