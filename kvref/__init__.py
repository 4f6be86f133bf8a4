"""kvref — a formally checked, executable reference of vLLM v1's KV-cache management.

Semantics: vLLM 0.33.0. Layers: ``kvref.spec`` (formulas), ``kvref.impl`` (reference runtime,
torch implementation, vLLM adapter), ``kvref.models`` (state machines, explorer),
``kvref.proofs`` (Z3, CrossHair); this package is the front door (CLI, reports).
"""

__version__ = "0.1.0"
VLLM_VERSION = "0.33.0"
