"""Running the theorems: ``run_all`` (what ``kvref prove`` and ``kvref verify`` call),
``prove_theorem``, ``check_concrete`` (what reproducer files call) and reproducer rendering.
"""

from __future__ import annotations

import os
import pprint
import re
import time
from typing import Any, Iterable, Mapping, Sequence

from .engine import COUNTEREXAMPLE, PROVED, UNKNOWN, Claim, ClaimResult, Theorem, TheoremResult, decide
from .explain import render_config
from .formulas import REFERENCE, Formulas
from .theorems import THEOREMS, get_theorem
from .variants import Variant, get_variant

#: per-query Z3 timeout for proofs (ms); a timeout is reported as "unknown", never "proved"
DEFAULT_TIMEOUT_MS = 20_000


def _formulas(variant: str | Variant | None) -> tuple[Formulas, Variant | None]:
    if variant is None or variant == "reference":
        return REFERENCE, None
    v = get_variant(variant) if isinstance(variant, str) else variant
    return v.formulas, v


def _claim_by_name(theorem: Theorem, name: str) -> Claim:
    from kvref.spec.errors import InvalidFieldError

    if name in ("all", theorem.claim.name):
        return theorem.claim
    for c in (*theorem.lemmas, *theorem.necessary):
        if c.name == name:
            return c
    names = ["all", *(c.name for c in (*theorem.lemmas, *theorem.necessary))]
    raise InvalidFieldError("claim", name, f"one of {names} for {theorem.id}")


def _validate_config(claim: Claim, config: Mapping[str, Any]) -> None:
    from kvref.spec.errors import InvalidFieldError

    if not isinstance(config, Mapping):
        raise InvalidFieldError("config", config, "a mapping of variable name -> int/bool")
    missing = [n for n in claim.variables if n not in config]
    if missing:
        raise InvalidFieldError("config", sorted(config), f"values for every variable, missing {missing}")
    for name, kind in claim.variables.items():
        value = config[name]
        if kind == "bool" and not isinstance(value, bool):
            raise InvalidFieldError(f"config[{name!r}]", value, "True or False")
        if kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
            raise InvalidFieldError(f"config[{name!r}]", value, "an int")


def check_concrete(theorem: str, config: Mapping[str, Any], variant: str | None = None,
                   claim: str = "all") -> tuple[bool, str]:
    """Evaluate ``hypotheses => goal`` of a theorem's claim on concrete values.

    Returns ``(holds, detail)``; ``detail`` renders the configuration and the derived quantities.
    With the reference formulas, the values the formulas compute are also compared with
    ``kvref.spec`` where it has the function (see :func:`spec_crosscheck`).
    """
    t = get_theorem(theorem)
    F, _ = _formulas(variant)
    c = _claim_by_name(t, claim)
    _validate_config(c, config)
    hyps_ok, goal_ok = c.evaluate(F, config)
    holds = (not hyps_ok) or goal_ok
    if F is REFERENCE:
        spec_crosscheck(config)
    state = ("hypotheses do not hold (the configuration is rejected / unreachable)" if not hyps_ok
             else "goal holds" if goal_ok else "GOAL VIOLATED")
    detail = "\n".join([f"{t.id} {t.name} under {F.name}: {state}", *render_config(t.id, F, config)])
    return holds, detail


def spec_crosscheck(config: Mapping[str, Any]) -> None:
    """Assert the reference formulas agree with kvref.spec on the caps a config mentions."""
    from kvref.spec import ChunkedLocalAttentionSpec, SlidingWindowSpec

    from .ops import PyOps

    k, B, M = config.get("k"), config.get("B"), config.get("M")
    if k is None or B is None or M is None or k < 1 or B < 1 or M < 1:
        return
    F = k * B
    for bs_key in ("bs", "bss"):
        bs, sw, extra = config.get(bs_key), config.get("sw"), config.get("extra")
        if bs and sw and bs >= 1 and sw >= 1 and extra is not None and extra >= 0:
            spec = SlidingWindowSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype="float16",
                                     sliding_window=sw, extra_retained_tokens=extra)
            got = REFERENCE.swa_cap(PyOps, sw, extra, bs, F, M)
            assert spec.max_admission_blocks_per_request(F, M) == got, "SWA cap differs from kvref.spec"
    for bs_key in ("bs", "bsc"):
        bs, chunk = config.get(bs_key), config.get("chunk")
        if bs and chunk and bs >= 1 and chunk >= 1:
            spec = ChunkedLocalAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype="float16",
                                             attention_chunk_size=chunk)
            got = REFERENCE.cl_cap(PyOps, chunk, bs, F, M)
            assert spec.max_admission_blocks_per_request(F, M) == got, "chunked-local cap differs from kvref.spec"


def prove_theorem(theorem: Theorem | str, variant: str | Variant | None = None,
                  timeout_ms: int = DEFAULT_TIMEOUT_MS, cex_timeout_ms: int = 5_000) -> TheoremResult:
    """Decide every proof obligation of ``theorem`` under the reference or a variant.

    Status: ``proved`` iff every lemma is ``unsat`` (Z3); ``counterexample`` if some obligation or
    the whole claim has a model; ``unknown`` otherwise (timeouts included).
    """
    from kvref.spec.errors import InvalidFieldError, check_int

    t = get_theorem(theorem) if isinstance(theorem, str) else theorem
    if not isinstance(t, Theorem):
        raise InvalidFieldError("theorem", theorem, "a Theorem or a theorem id/name")
    check_int("timeout_ms", timeout_ms, minimum=1)
    F, var = _formulas(variant)
    start = time.perf_counter()
    results: list[ClaimResult] = []
    cex: ClaimResult | None = None
    if var is not None:
        # Variants are expected to fail: look for a whole-claim counterexample first (it gives a
        # complete configuration), under the theorem's search hints and two solvers with short
        # timeouts, then fall back to the lemmas.
        cex = find_counterexample(t, F, cex_timeout_ms)
        if cex is not None:
            results.append(cex)
    if cex is None:
        for c in t.proof_obligations:
            r = decide(c, F, timeout_ms)
            results.append(r)
            if r.status == COUNTEREXAMPLE and cex is None:
                cex = r
                if var is not None:
                    # a variant's verdict is settled by its first counterexample; deciding the
                    # remaining lemmas only costs time (T5's pre-42992 variant: a counterexample
                    # on its 7th lemma at 2.8 s, then 'fold:hash|sbs' ran into the 20-s timeout)
                    break
    seconds = time.perf_counter() - start
    if cex is not None:
        status = COUNTEREXAMPLE
    elif all(any(r.claim == c.name and r.status == PROVED for r in results) for c in t.proof_obligations):
        status = PROVED
    else:
        status = UNKNOWN
    res = TheoremResult(theorem=t.id, name=t.name, title=t.title, formulas=F.name, status=status,
                        seconds=seconds, lemmas=results)
    if cex is not None:
        res.counterexample = cex.model
        res.failing_claim = cex.claim
        res.detail = "\n".join(render_config(t.id, F, cex.model or {}))
    elif status == UNKNOWN:
        res.detail = "; ".join(f"{r.claim}: {r.reason or r.status}" for r in results if r.status != PROVED)
    return res


def find_counterexample(t: Theorem, F: Formulas, budget_ms: int = 5_000,
                        per_attempt_ms: int = 1_000) -> ClaimResult | None:
    """A model of the whole claim's negation, or None within about ``budget_ms``.

    Tries the theorem's search hints in order (the first ones give realistic configurations),
    then no hint; each with Z3's default solver and, if that timed out, the QF_NIA solver.
    """
    deadline = time.perf_counter() + budget_ms / 1000
    for hint in (*t.search_hints, {}):
        for logic in (None, "QF_NIA"):
            left = int((deadline - time.perf_counter()) * 1000)
            if left <= 50:
                return None
            r = decide(t.claim, F, min(per_attempt_ms, left) if hint else left, fixed=hint, logic=logic)
            if r.status == COUNTEREXAMPLE:
                return r
            if r.reason == "unsat under search hints":
                break  # no counterexample with this hint: the other solver will not find one
    return None


def check_bounds_needed(theorem: Theorem | str, timeout_ms: int = DEFAULT_TIMEOUT_MS) -> list[ClaimResult]:
    """Decide the theorem's ``necessary`` claims (each drops one stated bound) under the reference;
    each should come back ``counterexample``."""
    t = get_theorem(theorem) if isinstance(theorem, str) else theorem
    return [decide(c, REFERENCE, timeout_ms) for c in t.necessary]


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]+", "_", s).strip("_").lower()


def write_reproducer(result: TheoremResult, out_dir: str, variant: str | None) -> str:
    """Write a ready-to-run pytest file for a counterexample; returns its path.

    ``pytest FILE`` fails on the variant (the bug); ``KVREF_IMPL=reference pytest FILE`` passes.
    The name starts ``cex_``, not ``test_``: pytest collects it only when named on its command line,
    so a reproducer that fails by design never breaks the user's own ``pytest`` run.
    """
    assert result.counterexample is not None
    t = get_theorem(result.theorem)
    os.makedirs(out_dir, exist_ok=True)
    impl = variant or "reference"
    path = os.path.join(out_dir, f"cex_{_slug(t.id)}_{_slug(impl)}.py")
    claim = result.failing_claim or "all"
    if claim == t.claim.name:
        claim = "all"
    var = get_variant(variant) if variant else None
    header = [f'"""Counterexample to {t.id} ({t.name}) under {impl!r}, found by `kvref prove`.',
              "",
              t.title + ".",
              ""]
    if var is not None:
        header += [f"Variant: {var.summary}", f"See vLLM {', '.join(var.refs)}." if var.refs else "", ""]
    header += ["Configuration:", *("    " + line for line in (result.detail or "").splitlines()), "",
               f"Run:  pytest {os.path.basename(path)}                      # fails: reproduces the bug",
               f"      KVREF_IMPL=reference pytest {os.path.basename(path)}  # passes on the reference",
               '"""']
    body = f'''
import os

from kvref.proofs import check_concrete

THEOREM = {t.id!r}
CLAIM = {claim!r}
VARIANT = {impl!r}
CONFIG = {pprint.pformat(dict(result.counterexample), width=100, sort_dicts=False)}


def check(impl):
    holds, detail = check_concrete(THEOREM, CONFIG, variant=None if impl == "reference" else impl, claim=CLAIM)
    assert holds, detail


def test_counterexample():
    check(os.environ.get("KVREF_IMPL", VARIANT))
'''
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("\n".join(header) + "\n" + body)
    result.reproducer = path
    return path


def run_all(theorems: Sequence[str] | None = None, variant: str | None = None, out_dir: str | None = None,
            timeout_ms: int = DEFAULT_TIMEOUT_MS) -> list[TheoremResult]:
    """Prove the theorems (default: all; with a variant: the one it breaks).

    Counterexamples are written as reproducer files under ``out_dir`` when it is given. Returns one
    :class:`TheoremResult` per theorem; ``result.ok`` is True only for ``proved``.
    """
    from kvref.spec.errors import InvalidFieldError

    if isinstance(theorems, str):
        raise InvalidFieldError("theorems", theorems, "a list of theorem ids/names, not one string")
    if theorems:
        chosen: Iterable[Theorem] = [get_theorem(x) for x in theorems]
    elif variant is not None and variant != "reference":
        chosen = [get_theorem(get_variant(variant).theorem)]
    else:
        chosen = THEOREMS
    out = []
    for t in chosen:
        r = prove_theorem(t, variant, timeout_ms)
        if r.counterexample is not None and out_dir is not None:
            write_reproducer(r, out_dir, None if variant in (None, "reference") else variant)
        out.append(r)
    return out


__all__ = ["run_all", "prove_theorem", "check_bounds_needed", "run_contracts", "check_concrete", "write_reproducer", "spec_crosscheck", "PROVED",
           "COUNTEREXAMPLE", "UNKNOWN", "DEFAULT_TIMEOUT_MS"]


def run_contracts(per_condition_timeout: float = 2.0):
    """CrossHair over :mod:`kvref.proofs.contracts` (see :mod:`kvref.proofs.crosshair_run`)."""
    from .crosshair_run import run_crosshair

    return run_crosshair(per_condition_timeout=per_condition_timeout)
