"""The tiering worker's canonical-layout rule (kvref.spec.tiering_canonical_refs, #22) on generated
references: its verdict follows from the three statements of vLLM's rule, and bad input is refused."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvref.spec.errors import InvalidFieldError
from kvref.spec.tiering_canonical_refs import NOT_PORTABLE, UNCERTIFIED, canonical_refs_verdict
from tests.conftest import profile_examples

_REFS = st.lists(st.lists(st.one_of(st.none(), st.booleans()), max_size=3), max_size=3)


@settings(max_examples=profile_examples(100, 300), deadline=None)
@given(canonical=st.booleans(), agnostic=st.booleans(), portable=_REFS)
def test_verdict_follows_the_rule(canonical, agnostic, portable):
    refusal, all_portable = canonical_refs_verdict(canonical, agnostic, portable)
    refs = [p for g in portable for p in g]
    if not canonical:
        assert (refusal, all_portable) == (None, None)
    elif None in refs:
        assert (refusal, all_portable) == (UNCERTIFIED, None)
    else:
        assert all_portable is (False not in refs)
        assert refusal == (NOT_PORTABLE if agnostic and False in refs else None)


@pytest.mark.parametrize("kwargs", [dict(canonical_layout=1), dict(is_parallelism_agnostic=None),
                                    dict(portable="x"), dict(portable=[[1]]), dict(portable=[None])])
def test_bad_input_is_refused(kwargs):
    args = {**dict(canonical_layout=True, is_parallelism_agnostic=False, portable=[[True]]), **kwargs}
    with pytest.raises(InvalidFieldError):
        canonical_refs_verdict(**args)
