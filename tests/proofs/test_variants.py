"""Historic variants and deliberately broken formulas: each breaks its theorem, the counterexample
is a concrete configuration that fails on the variant and holds on the reference, and the written
reproducer file behaves the same way."""

from __future__ import annotations

import importlib.util

import pytest

from kvref.proofs import COUNTEREXAMPLE, HISTORIC, VARIANTS, check_concrete, get_variant, prove_theorem, run_all
from kvref.spec.errors import InvalidFieldError


def _load(path):
    spec = importlib.util.spec_from_file_location("kvref_cex_repro", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_variant_yields_a_replayable_counterexample(variant, tmp_path):
    [result] = run_all(variant=variant.name, out_dir=str(tmp_path))
    assert result.theorem == variant.theorem
    assert result.status == COUNTEREXAMPLE, result.detail
    cfg, claim = result.counterexample, result.failing_claim
    claim = "all" if claim in (None, "all") else claim
    holds_variant, detail = check_concrete(variant.theorem, cfg, variant.name, claim)
    holds_reference, _ = check_concrete(variant.theorem, cfg, None, claim)
    assert not holds_variant and "GOAL VIOLATED" in detail
    assert holds_reference
    module = _load(result.reproducer)
    with pytest.raises(AssertionError):
        module.check(variant.name)
    module.check("reference")


def test_at_least_eight_historic_bugs_each_citing_vllm():
    assert len(HISTORIC) >= 8
    for v in HISTORIC:
        assert v.refs and all(r.startswith(("#", "PR ")) for r in v.refs), v.name
    names = {v.name for v in HISTORIC}
    assert {"pre-40946-gate", "pre-41069-override-ignored", "pre-47272-null-block"} <= names


def test_every_theorem_has_a_sibling_that_breaks_it():
    from kvref.proofs import THEOREMS

    broken = {v.theorem for v in VARIANTS}
    assert {t.id for t in THEOREMS} <= broken


def test_variant_does_not_break_unrelated_theorem():
    # The override bug is about sizing; the offload window theorem still holds under it.
    r = prove_theorem("T6", "pre-41069-override-ignored")
    assert r.status == "proved"


def test_unknown_variant_is_rejected():
    with pytest.raises(InvalidFieldError):
        get_variant("no-such-bug")
    with pytest.raises(ValueError):
        run_all(variant="no-such-bug")


def test_a_variant_whose_claim_search_misses_is_settled_by_its_first_failing_lemma():
    """With no time for the whole-claim search (``cex_timeout_ms=1``) a variant falls back to the
    lemmas and stops at the first counterexample: T5's pre-42992 variant fails its 'hash divides
    size 2' fold, and the lemma after it (which runs into Z3's timeout) is never asked."""
    r = prove_theorem("T5", "pre-42992-stale-hash-block-size", cex_timeout_ms=1)
    assert r.status == COUNTEREXAMPLE and r.failing_claim == "fold:hash|size2"
    assert [c.status for c in r.lemmas][-1] == COUNTEREXAMPLE
    assert COUNTEREXAMPLE not in [c.status for c in r.lemmas][:-1]
    assert "fold:hash|sbs" not in {c.claim for c in r.lemmas}
