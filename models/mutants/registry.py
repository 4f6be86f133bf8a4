"""The catalogue every mutant registers into, and the decorator that registers one.

:mod:`kvref.models.mutants.catalogue` and its sub-catalogues (``catalogue_manager``,
``catalogue_scheduler``) all import from here, so none imports another to register: the
catalogue imports the sub-catalogues (after its own entries, which keeps the catalogue's order),
and they import only this module.
"""

from __future__ import annotations

from kvref.models.mutants.mutant import CLASSIC, Catalogue, Mutant

CATALOGUE = Catalogue()


def mutant(name: str, target: str, description: str, *, kind: str = CLASSIC,
           vllm_bug: str | None = None, layer: str = "pool"):
    """Decorator: register ``make(original) -> replacement`` as a mutant."""
    def deco(make):
        CATALOGUE.add(Mutant(name, description, target, make, kind, vllm_bug, layer))
        return make
    return deco
