"""Which vLLM kvref models, and kvref's own version — constants every layer may read."""

from __future__ import annotations

#: the vLLM release whose semantics kvref's reference models (any installed vLLM is checked against it)
MODELLED_VLLM_VERSION = "0.33.0"

#: kvref's version (the package metadata is the same; kept here so no layer imports the CLI package)
KVREF_VERSION = "0.1.0"
