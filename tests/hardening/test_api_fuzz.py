"""Wrong arguments to the public API: only ``ValueError`` subclasses escape, and a rejected call
leaves the object exactly as it was (same pickled state, invariants hold).

Two layers: every (target, argument, wrong value) of the fixed catalogue in
:mod:`tests.hardening.api_targets` (exhaustive, deterministic), then Hypothesis drawing wrong
values of any shape for one argument at a time.
"""

from __future__ import annotations

import signal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import profile_examples
from tests.hardening.api_targets import JUNK, constructors, method_cases, snapshot

CONSTRUCTORS = constructors()
METHODS = dict(method_cases())

#: seconds one call may take (a constructor accepting 10**30 blocks used to run until memory ran out)
CALL_SECONDS = 20


class Hang(BaseException):
    pass


def _call_bounded(fn, **kwargs):
    def fire(signum, frame):
        raise Hang(f"no answer within {CALL_SECONDS} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(CALL_SECONDS)
    try:
        return fn(**kwargs)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _constructor_rejects_or_builds(name: str, field: str, value) -> None:
    fn, good = CONSTRUCTORS[name]
    kwargs = dict(good, **{field: value})
    try:
        _call_bounded(fn, **kwargs)
    except ValueError as exc:
        assert str(exc).strip(), f"{name}({field}={value!r}) raised {type(exc).__name__} without a message"
    # anything else (TypeError, AttributeError, OverflowError, AssertionError, Hang) fails the test


def _method_rejects_or_runs(name: str, field: str, value) -> None:
    obj, check_invariants, good, method = METHODS[name]()
    before = snapshot(obj)
    try:
        _call_bounded(method, **dict(good, **{field: value}))
    except ValueError:
        assert snapshot(obj) == before, f"{name}({field}={value!r}) raised after changing state"
        check_invariants()
    else:
        check_invariants()


CTOR_CASES = [(n, f) for n, (_, good) in CONSTRUCTORS.items() for f in good]
METHOD_CASES = [(n, f) for n, build in METHODS.items() for f in build()[2]]


@pytest.mark.parametrize("name, field", CTOR_CASES, ids=[f"{n}.{f}" for n, f in CTOR_CASES])
def test_constructor_argument_catalogue(name, field):
    for value in JUNK:
        _constructor_rejects_or_builds(name, field, value)


@pytest.mark.parametrize("name, field", METHOD_CASES, ids=[f"{n}.{f}" for n, f in METHOD_CASES])
def test_method_argument_catalogue(name, field):
    for value in JUNK:
        _method_rejects_or_runs(name, field, value)


def test_valid_arguments_are_accepted():
    """The catalogue's own arguments are valid: otherwise every case above would pass vacuously."""
    for name, (fn, good) in CONSTRUCTORS.items():
        fn(**good)
    for name, build in METHODS.items():
        obj, check_invariants, good, method = build()
        method(**good)
        check_invariants()


#: wrong values of any shape: ints of every size and sign, floats incl. nan/inf, text, bytes,
#: containers of junk, None
ANY_VALUE = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 64) | st.sampled_from([10**30, -(10**30), 2**63, 2**31])
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=5) | st.binary(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner) | st.dictionaries(st.text(max_size=3), inner,
                                                                                           max_size=2),
    max_leaves=6)


@settings(max_examples=profile_examples(150, 600), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from(CTOR_CASES), value=ANY_VALUE)
def test_constructors_fuzzed(case, value):
    _constructor_rejects_or_builds(*case, value)


@settings(max_examples=profile_examples(150, 600), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from(METHOD_CASES), value=ANY_VALUE)
def test_methods_fuzzed(case, value):
    _method_rejects_or_runs(*case, value)
