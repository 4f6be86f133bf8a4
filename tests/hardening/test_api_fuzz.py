"""Wrong arguments to the public API: only ``ValueError`` subclasses escape, and a rejected call
leaves the object exactly as it was (same pickled state, invariants hold).

Two layers: every (target, argument, wrong value) of the fixed catalogue in
:mod:`tests.hardening.api_targets` — :data:`~tests.hardening.api_targets.JUNK` plus the near
misses of the argument's valid value (right type, wrong content: a bool for an int, a list with a
wrong element, too short/long, a tuple for a list, blocks of another pool, a spec of another
kind, a finished request reusing an id) — exhaustive and deterministic; then Hypothesis drawing
wrong values of any shape for one argument at a time. Which entry points are in the catalogue is
checked by ``test_api_coverage.py``.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import profile_examples
from tests.hardening.api_fuzz_counts import (
    CALLABLES,
    METHODS,
    call_outcome,
    method_outcome,
    wrong_values,
)
from tests.hardening.api_targets import scratch_dir


@pytest.fixture(autouse=True)
def _in_scratch_dir(monkeypatch):
    """Path arguments made relative by the fuzz land in a scratch folder, not in the repository."""
    monkeypatch.chdir(scratch_dir())


def _constructor_rejects_or_builds(name: str, field: str, value) -> None:
    fn, good = CALLABLES[name]
    got = call_outcome(fn, dict(good, **{field: value}))
    assert got in ("ok", "rejected"), f"{name}({field}={value!r}): {got}"


def _method_rejects_or_runs(name: str, field: str, value) -> None:
    got = method_outcome(METHODS[name], field, value)
    assert got in ("ok", "rejected"), (
        f"{name}({field}={value!r}): " + {"changed": "raised after changing state",
                                          "invariants": "check_invariants() fails after the call"}.get(got, got))


CTOR_CASES = [(n, f) for n, (_, good) in CALLABLES.items() for f in good]
METHOD_CASES = [(n, f) for n, build in METHODS.items() for f in build()[2]]


@pytest.mark.parametrize("name, field", CTOR_CASES, ids=[f"{n}.{f}" for n, f in CTOR_CASES])
def test_constructor_argument_catalogue(name, field):
    for value in wrong_values(CALLABLES[name][1][field]):
        _constructor_rejects_or_builds(name, field, value)


@pytest.mark.parametrize("name, field", METHOD_CASES, ids=[f"{n}.{f}" for n, f in METHOD_CASES])
def test_method_argument_catalogue(name, field):
    for value in wrong_values(METHODS[name]()[2][field]):
        _method_rejects_or_runs(name, field, value)


def test_valid_arguments_are_accepted():
    """The catalogue's own arguments are valid: otherwise every case above would pass vacuously."""
    for fn, good in CALLABLES.values():
        fn(**good)
    for build in METHODS.values():
        _, check_invariants, good, method = build()
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
