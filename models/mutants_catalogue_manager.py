"""Mutants of the managers, the coordinator, the KV cache manager and the scheduler.

Registered into :data:`kvref.models.mutants_catalogue.CATALOGUE`; a mutant whose target does not
exist in this checkout is simply not available (``Mutant.available()``).
"""

from __future__ import annotations

from .mutants_catalogue import mutant  # noqa: F401
