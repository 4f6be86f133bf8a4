"""Per-request tier filters and load caps from ``kv_transfer_params`` (vLLM 0.33.0
``offloading/scheduler.py``: ``_parse_tier_filter``, ``_create_req_context`` and
``RequestOffloadState.__post_init__``).

A client restricts which offloading tiers may serve a request's loads with
``kv_transfer_params["kv_load_tiers"]``: a list of matchers ``{"medium": "cpu"|"storage",
"locality": "local"|"remote"}`` (either key optional, case-insensitive). Parsing is lenient, as
vLLM's is, because the parameters come from untrusted requests and must never fail one:

* not a list: every tier (vLLM logs a warning);
* an entry that is not a dict, or names an unknown medium or locality (or a non-string one):
  skipped;
* ``[]``: no tier at all (the client asked for nothing);
* entries given but all skipped: every tier.

A matcher's missing field matches anything, and a tier that does not say its medium or locality
matches every matcher on that field. ``max_load_tokens`` / ``max_offload_tokens`` cap what one
request loads / stores; anything but a non-negative ``int`` (a bool included) is ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvref.spec.errors import InvalidFieldError

# ``ALL`` (the every-tier sentinel) is an instance, not an entry point: importable, not listed.
__all__ = ["KV_LOAD_TIERS_KEY", "LOCALITIES", "MEDIA", "TierFilter", "parse_tier_filter", "request_tier_filter",
           "token_cap"]

MEDIA = ("CPU", "STORAGE")
LOCALITIES = ("LOCAL", "REMOTE")
KV_LOAD_TIERS_KEY = "kv_load_tiers"


@dataclass(frozen=True)
class TierFilter:
    """``matchers``: ``(medium, locality)`` pairs, None = any; ``everything`` is vLLM's
    ``TierFilter.ALL`` sentinel (every tier, whatever the matchers)."""

    matchers: tuple[tuple[str | None, str | None], ...] = ()
    everything: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.matchers, tuple) or not all(
                isinstance(m, tuple) and len(m) == 2 and m[0] in (None, *MEDIA) and m[1] in (None, *LOCALITIES)
                for m in self.matchers):
            raise InvalidFieldError("matchers", self.matchers, f"a tuple of (medium in {MEDIA} or None, "
                                                               f"locality in {LOCALITIES} or None) pairs")
        if not isinstance(self.everything, bool):
            raise InvalidFieldError("everything", self.everything, "a bool")

    def allows(self, medium: str | None, locality: str | None) -> bool:
        """Whether a tier of this medium and locality may serve the request's loads."""
        if medium not in (None, *MEDIA):
            raise InvalidFieldError("medium", medium, f"one of {MEDIA} or None")
        if locality not in (None, *LOCALITIES):
            raise InvalidFieldError("locality", locality, f"one of {LOCALITIES} or None")
        if self.everything:
            return True
        return any((m is None or medium is None or m == medium) and (lc is None or locality is None or lc == locality)
                   for m, lc in self.matchers)


ALL = TierFilter(((None, None),), everything=True)


def _upper(raw: Any, allowed: tuple[str, ...]) -> str | None:
    """The member ``raw`` names (case-insensitive), or None for an unknown or non-string name."""
    if not isinstance(raw, str):
        return None
    up = raw.upper()
    return up if up in allowed else None


def parse_tier_filter(raw: Any) -> TierFilter:
    """The filter a ``kv_load_tiers`` value asks for (never raises: see the module docstring)."""
    if not isinstance(raw, list):
        return ALL
    matchers: list[tuple[str | None, str | None]] = []
    for entry in raw:
        if not isinstance(entry, dict):
            continue
        medium = locality = None
        if entry.get("medium") is not None:
            medium = _upper(entry["medium"], MEDIA)
            if medium is None:
                continue
        if entry.get("locality") is not None:
            locality = _upper(entry["locality"], LOCALITIES)
            if locality is None:
                continue
        matchers.append((medium, locality))
    if not matchers:
        return TierFilter(()) if not raw else ALL
    return TierFilter(tuple(matchers))


def request_tier_filter(kv_transfer_params: dict | None) -> TierFilter:
    """The load filter of a request with these ``kv_transfer_params`` (every tier without one)."""
    if kv_transfer_params is not None and not isinstance(kv_transfer_params, dict):
        raise InvalidFieldError("kv_transfer_params", kv_transfer_params, "a dict or None")
    raw = kv_transfer_params.get(KV_LOAD_TIERS_KEY) if kv_transfer_params else None
    return ALL if raw is None else parse_tier_filter(raw)


def token_cap(kv_transfer_params: dict | None, name: str) -> int | None:
    """``kv_transfer_params[name]`` if it is a non-negative int (not a bool), else None."""
    if kv_transfer_params is not None and not isinstance(kv_transfer_params, dict):
        raise InvalidFieldError("kv_transfer_params", kv_transfer_params, "a dict or None")
    if name not in ("max_load_tokens", "max_offload_tokens"):
        raise InvalidFieldError("name", name, "'max_load_tokens' or 'max_offload_tokens'")
    raw = kv_transfer_params.get(name) if kv_transfer_params else None
    return raw if type(raw) is int and raw >= 0 else None
