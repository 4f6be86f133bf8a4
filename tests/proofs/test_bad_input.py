"""Bad input to the proofs API is a ValueError naming the field and value, never a deep traceback."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvref.proofs import check_concrete, get_theorem, get_variant, prove_theorem, run_all
from kvref.spec.errors import InvalidFieldError

junk = st.one_of(st.none(), st.integers(), st.floats(allow_nan=False), st.text(max_size=8), st.booleans(),
                 st.lists(st.integers(), max_size=2))


@given(junk)
def test_get_theorem_and_variant_reject_junk(value):
    if isinstance(value, str) and (value.upper() in {f"T{i}" for i in range(1, 9)}):
        return
    with pytest.raises(InvalidFieldError):
        get_theorem(value)
    with pytest.raises(InvalidFieldError):
        get_variant(value)


@given(st.dictionaries(st.sampled_from(["free", "R", "spec_step", "full_need", "n_new", "x"]), junk, max_size=6))
def test_check_concrete_rejects_incomplete_or_mistyped_configs(config):
    ok = (set(config) >= {"free", "R", "spec_step", "full_need", "n_new"}
          and all(isinstance(config[k], int) and not isinstance(config[k], bool)
                  for k in ("free", "R", "spec_step", "full_need", "n_new")))
    if ok:
        holds, _ = check_concrete("T8", config)
        assert isinstance(holds, bool)
    else:
        with pytest.raises(InvalidFieldError):
            check_concrete("T8", config)


def test_other_entry_points():
    with pytest.raises(InvalidFieldError):
        check_concrete("T8", {"free": 1}, claim="no-such-lemma")
    with pytest.raises(InvalidFieldError):
        prove_theorem("T8", timeout_ms=0)
    with pytest.raises(InvalidFieldError):
        run_all("T1")
    with pytest.raises(InvalidFieldError):
        run_all(["T1"], variant="nope")
    with pytest.raises(ValueError) as err:
        check_concrete("T8", {"free": "many", "R": 0, "spec_step": 0, "full_need": 0, "n_new": 0})
    assert "free" in str(err.value) and "many" in str(err.value)
