"""How every explorer entry point reads its ``scope`` argument: a scope object of its kind, or a
name in its table; anything else is an :class:`~kvref.spec.errors.InvalidFieldError` naming the
field, the value and what is allowed (the KV, SimpleCPU and OffloadingConnector explorers and the
conformance explorer read it alike)."""

from __future__ import annotations

from typing import Any

from kvref.spec.errors import InvalidFieldError


def named_scope(scope: Any, table: dict[str, Any], cls: type) -> Any:
    """``scope`` when it is a ``cls``, the scope ``table`` names when it is a string."""
    if isinstance(scope, str):
        if scope not in table:
            raise InvalidFieldError("scope", scope, "one of " + ", ".join(table))
        return table[scope]
    if not isinstance(scope, cls):
        raise InvalidFieldError("scope", scope, f"a scope name or a {cls.__name__}")
    return scope
