"""``kvref mutants --ray`` on both targets: mutants and vLLM source faults as Ray units (issue #27).

* The reference: the clean-reference checks first (one unit per check; a failure there stops the
  campaign, as locally), then one unit per mutant running its checks in the campaign's order under
  the mutant (:func:`mutant_unit`, the loop body of
  :func:`kvref.models.mutants.campaign.run_campaign`), and the proof variants as one unit. A mutant
  unit's worker loads what the clean-reference units loaded (the local campaign has, by then:
  :mod:`kvref.ray_inputs`). A mutant whose unit died twice or raised is not killed, carries the
  reason, and the command exits 1: never a pass.
* ``--target vllm``: the clean-vLLM baseline as in :func:`kvref.vllm_campaign.run_campaign` (a unit
  each), then one unit per source fault, each :func:`kvref.vllm_campaign.run_fault` (a fresh
  ``kvref verify`` subprocess on an overlay of the worker's installed vLLM); a unit that died twice
  is the fault's outcome ``error``. docs/ray.md.
"""

from __future__ import annotations

import time

from .ray_runner import Unit, UnitOutcome, run_units


# --------------------------------------------------------------------------------------------
# kvref mutants (the reference)


def baseline_unit(name: str, budget: int):
    """On a worker: one campaign check on the clean reference (None: passed)."""
    from kvref.checks import _campaign_verdict, check_named

    return _campaign_verdict(check_named(name), budget)


def mutant_unit(mutant_name: str, names: list[str], budget: int, all_checks: bool) -> dict:
    """On a worker: the campaign's checks, in order, under one mutant (the body of the local loop:
    a check blind to the mutant's layer is skipped, a crash kills, the first kill stops unless
    ``all_checks``)."""
    from kvref.checks import _campaign_verdict, check_named
    from kvref.models.mutants.campaign import _first_line
    from kvref.models.mutants.catalogue import CATALOGUE

    m = CATALOGUE[mutant_name]
    t1 = time.perf_counter()
    row: dict = {"killed": False, "killed_by": None, "reason": None, "per_check": {}}
    with m.applied():
        for c in (check_named(n) for n in names):
            if not c.per_mutant or m.layer in c.blind_to:
                continue
            try:
                why = _campaign_verdict(c, budget)
            except Exception as e:  # noqa: BLE001 - a check that crashes under a mutant kills it
                why = f"check crashed: {_first_line(e)}"
            row["per_check"][c.name] = why
            if why is not None and not row["killed"]:
                row.update(killed=True, killed_by=c.name, reason=why)
                if not all_checks:
                    break
    row["seconds"] = time.perf_counter() - t1
    return row


def proof_variants_unit() -> list:
    from kvref.models.mutants.campaign import run_proof_variants

    return run_proof_variants()


def campaign_check_names(checks: list[str] | None) -> tuple[list[str], dict[str, str]]:
    """The checks a reference campaign runs and those left out, as :func:`kvref.checks.run_mutant_campaign`."""
    from kvref.checks import available_checks, mutant_campaign_checks, unavailable_checks
    from kvref.spec.errors import InvalidFieldError

    if not checks:
        return available_checks(), {}
    selectable = mutant_campaign_checks()
    for n in checks:
        if n not in selectable:
            raise InvalidFieldError("checks", n, "one of " + ", ".join(selectable))
    missing = unavailable_checks(list(checks))
    return [n for n in checks if n not in missing], {n: missing[n] for n in checks if n in missing}


def run_reference_mutants(mutants, checks: list[str] | None, budget: int, all_checks: bool,
                          proof_variants: bool, progress=None):
    """The reference campaign on Ray: ``(CampaignResult, {mutant: error})``; raises
    ``KeyboardInterrupt`` after cancelling the remote work on Ctrl-C."""
    from kvref.models.mutants.campaign import CampaignResult, MutantResult

    t0 = time.perf_counter()
    names, skipped = campaign_check_names(checks)
    base = run_units([Unit(n, baseline_unit, (n, budget)) for n in names])
    if base.interrupted:
        raise KeyboardInterrupt
    failures = {o.key: (o.value if o.ok else f"error on Ray: {o.error}") for o in base.outcomes
                if not o.ok or o.value is not None}
    if failures:
        return CampaignResult([], names, failures, time.perf_counter() - t0, skipped), {}
    # the local campaign's mutants run in a process that has run every clean-reference check: the
    # worker of a mutant loads what those units loaded (kvref.ray_inputs: the same Hypothesis inputs)
    from kvref.ray_inputs import local_modules

    loaded = sorted(set(local_modules()).union(*(o.modules for o in base.outcomes)))
    units = [Unit(m.name, mutant_unit, (m.name, names, budget, all_checks)) for m in mutants]
    if proof_variants:
        units.append(Unit("(proof variants)", proof_variants_unit))
    errors: dict[str, str] = {}
    rows: dict[str, list] = {}
    by_name = {m.name: m for m in mutants}

    def rows_of(o: UnitOutcome) -> list:
        if o.key == "(proof variants)":
            if o.ok:
                return list(o.value)
            errors[o.key] = o.error
            return []
        m = by_name[o.key]
        if not o.ok:
            errors[o.key] = o.error
            return [MutantResult(m, False, None, f"error on Ray: {o.error}", o.seconds)]
        v = o.value
        return [MutantResult(m, v["killed"], v["killed_by"], v["reason"], v["seconds"], v["per_check"])]

    def on_done(o: UnitOutcome) -> None:
        rows[o.key] = rows_of(o)
        if progress is not None:
            for r in rows[o.key]:
                progress(r)

    run = run_units(units, on_done=on_done, modules=loaded)
    if run.interrupted:
        raise KeyboardInterrupt
    results = [r for u in units for r in rows[u.key]]
    return CampaignResult(results, names, {}, time.perf_counter() - t0, skipped), errors


# --------------------------------------------------------------------------------------------
# kvref mutants --target vllm


def fault_unit(fault_id, checks: tuple, profile: str, seed: int, timeout: float | None):
    """On a worker: one source fault (None: the clean vLLM) through an overlay of the worker's vLLM.
    ``fault_id`` is a catalogue id, or the fault itself (a generated fault is in no catalogue, #22)."""
    from kvref.models.mutants.vllm_source.catalogue import FAULTS
    from kvref.vllm_campaign import installed_vllm_dir, run_fault

    fault = fault_id if fault_id is None or not isinstance(fault_id, str) else \
        next(f for f in FAULTS if f.id == fault_id)
    return run_fault(fault, checks, profile, seed, timeout, installed_vllm_dir())


def _fault_result(o: UnitOutcome, fault):
    from kvref.vllm_campaign import ERROR, FaultResult

    if o.ok:
        return o.value
    return FaultResult(fault, ERROR, o.seconds, detail=f"on Ray: {o.error}")


def run_vllm_faults(faults, checks, profile: str, seed: int, timeout, progress=None):
    """:func:`kvref.vllm_campaign.run_campaign` (the same input checks, the same baseline rule:
    checks failing on the clean vLLM are left out, the same rows) with each fault, and the clean
    vLLM, a Ray unit; raises ``KeyboardInterrupt`` after cancelling the remote work on Ctrl-C."""
    from kvref.vllm_campaign import run_campaign

    def on_ray(batch: list, checks: tuple, on_result) -> list:
        by_key = {(None if f is None else f.id): f for f in batch}
        run = run_units([Unit(key, fault_unit, (by_key[key] if key and key.startswith("gen.") else key,
                                                            checks, profile, seed, timeout)) for key in by_key],
                        on_done=lambda o: on_result(_fault_result(o, by_key[o.key])))
        if run.interrupted:
            raise KeyboardInterrupt
        return [_fault_result(o, by_key[o.key]) for o in run.outcomes]

    return run_campaign(faults, checks, profile, seed, timeout, progress=progress, runner=on_ray, where=" on Ray")
