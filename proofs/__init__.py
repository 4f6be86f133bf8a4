"""kvref.proofs — Z3 proofs of vLLM 0.33.0's KV-cache bounds over unbounded integers, historic
variants with automatically found counterexamples, and CrossHair contracts.

Entry points: :func:`run_all` (``kvref prove`` / ``kvref verify``), :func:`prove_theorem`,
:func:`check_concrete` (what reproducer files call). See docs/proofs.md.
"""

from .api import (DEFAULT_TIMEOUT_MS, check_bounds_needed, check_concrete, prove_theorem, run_all, run_contracts,
                  write_reproducer)
from .engine import COUNTEREXAMPLE, PROVED, UNKNOWN, Claim, Theorem, TheoremResult
from .theorems import THEOREMS, get_theorem
from .variants import BROKEN, HISTORIC, VARIANTS, Variant, get_variant

__all__ = [
    "run_all", "prove_theorem", "check_bounds_needed", "run_contracts", "check_concrete", "write_reproducer", "DEFAULT_TIMEOUT_MS",
    "PROVED", "COUNTEREXAMPLE", "UNKNOWN", "Claim", "Theorem", "TheoremResult",
    "THEOREMS", "get_theorem", "VARIANTS", "HISTORIC", "BROKEN", "Variant", "get_variant",
]
