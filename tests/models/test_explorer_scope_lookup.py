"""Every explorer entry point reads ``scope`` through one door (models/explorer/scope_lookup.py,
#26): an unknown name or an object of another kind is an InvalidFieldError naming ``scope`` and
what is allowed, before anything is explored (explore_scope took any object and failed deep in
KVSystem)."""

from __future__ import annotations

import pytest

from kvref.models.explorer.conformance import explore_conformance
from kvref.models.explorer.kv import SCOPES, explore_scope
from kvref.models.explorer.offloading_connector import CONNECTOR_SCOPES, explore_connector
from kvref.models.explorer.simple_cpu import OFFLOAD_SCOPES, explore_offload
from kvref.spec.errors import InvalidFieldError

ENTRY_POINTS = [(explore_scope, SCOPES, "Scope"), (explore_conformance, SCOPES, "Scope"),
                (explore_offload, OFFLOAD_SCOPES, "OffloadScope"),
                (explore_connector, CONNECTOR_SCOPES, "ConnectorScope")]


@pytest.mark.parametrize("explore,table,kind", ENTRY_POINTS, ids=lambda x: getattr(x, "__name__", None))
def test_an_unknown_name_lists_the_scopes(explore, table, kind):
    with pytest.raises(InvalidFieldError) as exc:
        explore("no-such-scope")
    assert exc.value.field == "scope" and all(name in str(exc.value) for name in table)


@pytest.mark.parametrize("explore,table,kind", ENTRY_POINTS, ids=lambda x: getattr(x, "__name__", None))
def test_another_kind_of_scope_is_refused(explore, table, kind):
    # a scope of another explorer (the KV one's for the offload explorers, SimpleCPU's for the KV ones)
    other = next(iter((OFFLOAD_SCOPES if kind == "Scope" else SCOPES).values()))
    for bad in (other, 3, None):
        with pytest.raises(InvalidFieldError) as exc:
            explore(bad)
        assert exc.value.field == "scope" and f"a scope name or a {kind}" in str(exc.value)
