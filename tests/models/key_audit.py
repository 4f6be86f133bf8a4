"""Helpers for auditing explorer state keys (tests only)."""

from __future__ import annotations

from typing import Any, Callable, Hashable

from kvref.models.explorer.engine import explore

#: ids start here in the id-renaming audits: no other int in an offload world is this large
OFFSET = 10**7


def ints(key: Hashable):
    """Every int in a (nested tuple) key."""
    if isinstance(key, tuple):
        for x in key:
            yield from ints(x)
    elif isinstance(key, int) and not isinstance(key, bool):
        yield key


def explored_keys(system: Any, depth: int, on_key: Callable[[Any], None] | None = None) -> set:
    """The keys of every state a depth-bounded exploration of ``system`` computes;
    ``on_key(state)`` sees each state as its key is taken."""
    found: set = set()
    key = system.key

    def recording(s):
        k = key(s)
        found.add(k)
        if on_key is not None:
            on_key(s)
        return k
    system.key = recording
    res = explore(system, max_depth=depth, check_deadlocks=False)
    assert res.states > 300, res.states
    return found
