"""``kvref.verify.run_generated``: a generated comparison that finds several distinct mismatches
is a finding (failed), never an error. The vLLM campaign saw PR 47272's planner fault reported as
``error`` because Hypothesis raised an ``ExceptionGroup`` of two distinct assertion failures."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from kvref.verify import run_generated


def test_two_distinct_mismatches_are_one_failure_text():
    @given(st.integers(0, 1000))
    def compare(x):
        assert x % 7 != 3, "first kind of mismatch"
        if x > 500:
            raise AssertionError("second kind of mismatch")

    text = run_generated(compare, examples=300, seed=0)
    assert text is not None and "kind of mismatch" in text


def test_no_mismatch_is_none_and_an_error_still_propagates():
    @given(st.integers(0, 10))
    def fine(x):
        assert x <= 10

    assert run_generated(fine, examples=20, seed=0) is None

    @given(st.integers(0, 10))
    def broken(x):
        raise ValueError("the comparison itself is broken")

    with pytest.raises(ValueError):
        run_generated(broken, examples=20, seed=0)
