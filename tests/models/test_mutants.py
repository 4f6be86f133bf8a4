"""The mutant framework: patches apply and restore, the catalogue is complete, the campaign works."""

from __future__ import annotations

import pytest

import kvref.spec.mathutil as mathutil
from kvref.impl.reference.block_pool import BlockPool, BlockPoolCore
from kvref.models.mutants.mutant import Catalogue, Mutant
from kvref.checks import MUTANT_CAMPAIGN, run_mutant_campaign
from kvref.models.mutants.catalogue import CATALOGUE, CI_SUBSET, HISTORIC, all_mutants


def test_catalogue_has_thirty_available_mutants_with_historic_variants():
    ms = all_mutants()
    assert len(ms) >= 30
    assert len({m.name for m in ms}) == len(ms)
    historic = [m for m in ms if m.kind == HISTORIC]
    assert len(historic) >= 5 and all(m.vllm_bug for m in historic)
    assert set(CI_SUBSET) <= {m.name for m in ms}


def test_every_catalogued_mutant_resolves_and_takes_the_originals_optional_arguments():
    """A renamed target or a new keyword argument must fail here, not silently shrink the campaign
    (an unavailable mutant is skipped) or count a ``TypeError`` as a kill (a replacement that no
    longer accepts what callers pass raises on its first call)."""
    import inspect

    unresolved = [m.name for m in CATALOGUE if not m.available()]
    assert not unresolved, f"mutants whose target no longer exists: {unresolved}"
    assert len(all_mutants()) == len(CATALOGUE)
    stale = []
    for m in CATALOGUE:
        owner, attr = m.resolve()
        original = inspect.getattr_static(owner, attr)
        original = getattr(original, "__func__", original)
        if not inspect.isfunction(original):
            continue
        replacement = m.make(getattr(owner, attr))
        replacement = getattr(replacement, "__func__", replacement)
        if not inspect.isfunction(replacement):
            continue
        theirs = inspect.signature(replacement).parameters
        if any(p.kind is p.VAR_KEYWORD for p in theirs.values()):
            continue
        optional = [k for k, p in inspect.signature(original).parameters.items()
                    if p.kind is p.KEYWORD_ONLY or (p.kind is p.POSITIONAL_OR_KEYWORD and p.default is not p.empty)]
        missing = [k for k in optional if k not in theirs]
        if missing:
            stale.append(f"{m.name}: {m.target} no longer takes {missing}")
    assert not stale, stale


def test_method_patch_is_applied_and_restored():
    original = BlockPoolCore.touch
    pool = BlockPool(4, True, 2)
    with CATALOGUE["pool.touch_no_ref"].applied():
        assert BlockPoolCore.touch is not original
        (b,) = pool.get_new_blocks(1)
        pool.free_blocks([b])
        pool.touch([b])
        assert b.ref_cnt == 0  # the fault: the reference is not counted
    assert BlockPoolCore.touch is original


def test_module_function_patch_reaches_by_name_imports():
    import kvref.spec.kv_cache_interface as kci

    original = mathutil.cdiv
    assert kci.cdiv is original
    with CATALOGUE["spec.cdiv_floor"].applied():
        assert mathutil.cdiv(5, 2) == 2 and kci.cdiv(5, 2) == 2
    assert mathutil.cdiv is original and kci.cdiv is original and kci.cdiv(5, 2) == 3


def test_patch_is_restored_when_the_body_raises():
    original = BlockPoolCore.free_blocks
    with pytest.raises(RuntimeError):
        with CATALOGUE["pool.free_append_all"].applied():
            raise RuntimeError("check crashed")
    assert BlockPoolCore.free_blocks is original


def test_missing_target_is_unavailable_and_names_are_unique():
    m = Mutant("x.missing", "targets nothing", "kvref.impl.reference.block_pool:BlockPool.no_such", lambda f: f)
    assert not m.available()
    cat = Catalogue()
    cat.add(m)
    with pytest.raises(ValueError, match="mutant.name"):
        cat.add(m)
    with pytest.raises(ValueError, match="mutant"):
        cat["nope"]


def test_campaign_reports_the_killing_check():
    ms = [CATALOGUE[n] for n in ("spec.swa_cap_no_plus1", "manager.swa_skip_one_too_many",
                                 "pool.get_cached_first_group_only")]
    res = run_mutant_campaign(ms, checks=["spec-formulas", "explorer"], budget=20)
    assert not res.baseline_failures
    by = {r.mutant.name: r for r in res.results}
    assert by["spec.swa_cap_no_plus1"].killed_by == "spec-formulas"
    assert by["manager.swa_skip_one_too_many"].killed_by == "explorer"
    # documented equivalent mutant (docs/mutants.md): a group-0 hit implies a group-1 hit
    assert not by["pool.get_cached_first_group_only"].killed
    assert res.kill_rate == pytest.approx(2 / 3)
    text = res.render()
    assert "manager.swa_skip_one_too_many" in text and "explorer" in text
    assert by["manager.swa_skip_one_too_many"].seconds > 0


def test_unknown_check_is_rejected():
    with pytest.raises(ValueError, match="checks"):
        run_mutant_campaign([], checks=["no-such-check"])
    assert "explorer" in MUTANT_CAMPAIGN


def test_summary_separates_reference_mutants_from_formula_variants():
    from kvref.models.mutants.campaign import CampaignResult, MutantResult

    formula = Mutant("formula.x", "a formula variant", "kvref.proofs.variants:X", lambda f: f, HISTORIC,
                     "#1", "formula")
    res = CampaignResult([MutantResult(CATALOGUE["pool.touch_no_ref"], True, "explorer", "a|b"),
                          MutantResult(CATALOGUE["kvm.free_keeps_hashes"], False),
                          MutantResult(formula, True, "proofs", "theorem T1: counterexample")], ["explorer"])
    assert res.reference_kill_rate == 0.5 and res.kill_rate == pytest.approx(2 / 3)
    assert "1/2 reference mutants" in res.summary() and "1/1 formula variants" in res.summary()
    md = res.to_markdown()
    assert "**survived**" in md and "a\\|b" in md and "`formula.x`" in md


def test_bad_subset_is_rejected():
    with pytest.raises(ValueError, match="subset"):
        run_mutant_campaign(checks=["spec-formulas"], subset="weekly")
