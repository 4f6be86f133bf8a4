"""kvref — a formally checked, executable reference of vLLM v1's KV-cache management.

Semantics: vLLM 0.33.0. Layers: ``kvref.spec`` (formulas), ``kvref.impl`` (reference runtime,
torch implementation, vLLM adapter), ``kvref.models`` (state machines, explorer),
``kvref.proofs`` (Z3, CrossHair); this package is the front door (CLI, reports).
"""

from kvref.spec.version import KVREF_VERSION as __version__
from kvref.spec.version import MODELLED_VLLM_VERSION as VLLM_VERSION

__all__ = ["__version__", "VLLM_VERSION"]
