"""vLLM 0.33.0's small planning arithmetic vs kvref's, on generated arguments (#22).

``_approximate_gcd`` (the packed layouts' chunk size, with its refusals of an empty or
non-positive list and its lower bound above every value) and ``_largest_divisor_at_most`` (the
hidden-state block size, also with a limit below one): planning only calls them with arguments
that never reach their edges, so they are compared here directly over the whole domain. Run inside
``conform-planning``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from kvref.spec.errors import InvalidFieldError
from kvref.spec.planning_hidden_state import _largest_divisor_at_most
from kvref.spec.planning_packed import approximate_gcd


@dataclass(frozen=True)
class HelperCase:
    values: list[int]
    lower_bound: int | None
    value: int
    limit: int


@st.composite
def helper_cases(draw) -> HelperCase:
    values = draw(st.lists(st.integers(1, 96), max_size=4))
    if values and draw(st.integers(0, 5)) == 0:
        values[draw(st.integers(0, len(values) - 1))] = draw(st.integers(-3, 0))
    return HelperCase(values, draw(st.one_of(st.none(), st.integers(-2, 110))), draw(st.integers(1, 512)),
                      draw(st.integers(-2, 600)))


def _attempt(fn, *args: Any, **kw: Any) -> tuple[str, Any]:
    try:
        return "ok", fn(*args, **kw)
    except (ValueError, InvalidFieldError):  # vLLM: ValueError; kvref: InvalidFieldError (a ValueError)
        return "refused", None


def agree_helpers(case: HelperCase) -> None:
    """The two pairs of helpers give the same results and refuse the same arguments."""
    from kvref.impl.vllm.planning import vllm_approximate_gcd, vllm_largest_divisor_at_most

    kw = {} if case.lower_bound is None else {"lower_bound": case.lower_bound}
    theirs = _attempt(vllm_approximate_gcd, list(case.values), **kw)
    ours = _attempt(approximate_gcd, list(case.values), **kw)
    assert ours == theirs, f"approximate_gcd: kvref {ours} != vLLM {theirs}\n{case}"
    theirs = vllm_largest_divisor_at_most(case.value, case.limit)
    ours = _largest_divisor_at_most(case.value, case.limit)
    assert ours == theirs, f"largest_divisor_at_most: kvref {ours} != vLLM {theirs}\n{case}"
