"""Every theorem is proved (Z3 unsat over unbounded integers) under the reference formulas, and a
timeout can never be reported as proved."""

from __future__ import annotations

import pytest

from kvref.proofs import PROVED, THEOREMS, UNKNOWN, get_theorem, prove_theorem
from kvref.proofs.engine import Claim, decide
from kvref.proofs.formulas import REFERENCE
from kvref.spec.errors import InvalidFieldError


@pytest.mark.parametrize("theorem", THEOREMS, ids=lambda t: t.id)
def test_theorem_is_proved(theorem):
    result = prove_theorem(theorem)
    assert result.status == PROVED, (result.detail, [(c.claim, c.status, c.reason) for c in result.lemmas])
    assert {c.claim for c in result.lemmas} == {c.name for c in theorem.proof_obligations}
    assert all(c.status == PROVED for c in result.lemmas)


def test_every_theorem_names_reference_functions_and_states_its_bounds():
    for t in THEOREMS:
        assert t.reference and all(isinstance(r, str) and r for r in t.reference)
        assert isinstance(t.bounds, tuple)
        assert t.statement and t.title


def test_timeout_is_unknown_not_proved():
    # Fermat-like cubic with no small solutions: Z3 cannot settle it in 1 ms.
    def build(F, o, v):
        x, y, z = v["x"], v["y"], v["z"]
        return [x >= 1, y >= 1, z >= 1], x * x * x + y * y * y != z * z * z
    claim = Claim("cubic", "no cubes sum", {"x": "int", "y": "int", "z": "int"}, build)
    r = decide(claim, REFERENCE, timeout_ms=1)
    assert r.status == UNKNOWN


def test_unsat_under_search_hints_is_not_a_proof():
    def build(F, o, v):
        return [v["x"] >= 0], v["x"] >= 0
    claim = Claim("trivial", "x >= 0", {"x": "int"}, build)
    assert decide(claim, REFERENCE, fixed={"x": 3}).status == UNKNOWN
    assert decide(claim, REFERENCE).status == PROVED


def test_unknown_theorem_is_rejected_with_the_valid_names():
    with pytest.raises(InvalidFieldError) as err:
        get_theorem("T99")
    assert "T1" in str(err.value) and "T99" in str(err.value)
    assert get_theorem("t2").id == "T2"
    assert get_theorem("offload-window").id == "T6"


def test_each_needed_bound_is_needed():
    from kvref.proofs import COUNTEREXAMPLE, check_bounds_needed

    seen = 0
    for t in THEOREMS:
        for r in check_bounds_needed(t):
            seen += 1
            assert r.status == COUNTEREXAMPLE, (t.id, r.claim, r.status)
            claim = next(c for c in t.necessary if c.name == r.claim)
            hyps_ok, goal_ok = claim.evaluate(REFERENCE, r.model)
            assert hyps_ok and not goal_ok  # a concrete witness, replayed in Python
    assert seen >= 3


def _resolve(theorem_id: str, ref: str):
    """The object a dotted ``ref`` names: the longest importable module prefix, then attributes."""
    import importlib

    parts = ref.split(".")
    for i in range(len(parts), 1, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise AssertionError(f"{theorem_id}: cannot import {ref}")


def _references(prefix: str) -> list[tuple[str, str]]:
    return [(t.id, ref) for t in THEOREMS for ref in t.reference if ref.startswith(prefix)]


def test_kvref_references_resolve_to_real_functions():
    """Every ``kvref.*`` reference a theorem names is an importable attribute (so a rename breaks
    this test instead of leaving a theorem about a function that no longer exists)."""
    refs = _references("kvref.")
    for theorem_id, ref in refs:
        assert callable(_resolve(theorem_id, ref)), ref
    assert len(refs) >= 15


@pytest.mark.vllm
def test_vllm_references_resolve_in_vllm_0_33():
    from tests.vllm_env import require_vllm

    require_vllm()
    for theorem_id, ref in _references("vllm."):
        _resolve(theorem_id, ref)
