"""Whether a tiering offload worker may store KV blocks in the canonical layout: a pure rule.

vLLM 0.33.0's ``TieringOffloadingSpec.create_worker`` (``kv_offload/tiering/spec.py``) validates the
worker's layer references before it builds the CPU worker, when ``canonical_layout`` is set in the
connector's extra config (``_validate_canonical_refs``):

1. every layer reference must carry a ``CanonicalPageMapping`` (a ``None`` mapping means the layout
   could not be certified: offload workers that are not exactly the TP group, packed or cross-layer
   layouts); otherwise a ``RuntimeError`` and ``all_layers_portable`` stays unset;
2. ``all_layers_portable`` becomes whether every mapping is ``parallelism_agnostic``;
3. when the parallel config shares the storage namespace across topologies
   (``is_parallelism_agnostic``), every layer must be portable; otherwise a ``RuntimeError`` (with
   ``all_layers_portable`` already recorded as False): opaque per-topology bytes must not land in a
   namespace another topology reads.

Without ``canonical_layout`` nothing is validated and ``all_layers_portable`` stays unset. Either way
the worker's shared-region mapping is released when ``create_worker`` fails.
"""

from __future__ import annotations

from collections.abc import Sequence

from .errors import InvalidFieldError

#: the refusals, by the rule that fails
UNCERTIFIED = "uncertified"
NOT_PORTABLE = "not_portable"


def canonical_refs_verdict(canonical_layout: bool, is_parallelism_agnostic: bool,
                           portable: Sequence[Sequence[bool | None]]) -> tuple[str | None, bool | None]:
    """``(refusal or None, all_layers_portable)`` for a worker's layer references.

    Args:
        canonical_layout: the offloading config's ``canonical_layout``.
        is_parallelism_agnostic: the parallel config's ``is_parallelism_agnostic``.
        portable: per KV-cache group, per layer reference: None when the reference has no
            canonical mapping, else the mapping's ``parallelism_agnostic``.

    Returns:
        The refusal (:data:`UNCERTIFIED` or :data:`NOT_PORTABLE`), None when the worker may be
        built; and the ``all_layers_portable`` the spec records (None when unset).
    """
    for name, flag in (("canonical_layout", canonical_layout), ("is_parallelism_agnostic", is_parallelism_agnostic)):
        if not isinstance(flag, bool):
            raise InvalidFieldError(name, flag, "a bool")
    if isinstance(portable, (str, bytes)) or not isinstance(portable, Sequence) or any(
            isinstance(g, (str, bytes)) or not isinstance(g, Sequence) for g in portable):
        raise InvalidFieldError("portable", portable, "a sequence of groups, each a sequence of None/bool")
    refs = [p for group in portable for p in group]
    if any(p is not None and not isinstance(p, bool) for p in refs):
        raise InvalidFieldError("portable", portable, "None (no mapping) or a bool (parallelism_agnostic) per ref")
    if not canonical_layout:
        return None, None
    if any(p is None for p in refs):
        return UNCERTIFIED, None
    all_portable = all(refs)
    if is_parallelism_agnostic and not all_portable:
        return NOT_PORTABLE, False
    return None, all_portable


__all__ = ["NOT_PORTABLE", "UNCERTIFIED", "canonical_refs_verdict"]
