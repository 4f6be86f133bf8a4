"""The table of vLLM symbols kvref binds to (:mod:`kvref.impl.vllm.api`) is true and complete:
every binding resolves against the installed vLLM, and every name an adapter module imports from
vLLM is listed, so an API move in a user's vLLM is reported up front, naming the symbol."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvref.impl.vllm.api import AREAS, CHECK_AREAS, check_api
from tests.vllm_env import require_vllm

ADAPTERS = Path(__file__).resolve().parents[3] / "impl" / "vllm"


def _imported_vllm_names() -> set[tuple[str, str, str]]:
    """(adapter file, vllm module, name) for every ``from vllm... import name`` in impl/vllm/."""
    out = set()
    for path in sorted(ADAPTERS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
                for alias in node.names:
                    out.add((path.name, node.module, alias.name))
    return out


def test_every_name_an_adapter_imports_from_vllm_is_in_the_table():
    listed = {(b.module, b.attr.split(".")[0]) for bindings in AREAS.values() for b in bindings}
    modules = {b.module for bindings in AREAS.values() for b in bindings}
    imported = _imported_vllm_names()
    assert imported, "the scan found no vLLM import: it cannot fail"
    # ``from vllm.v1 import kv_cache_interface`` imports a module whose symbols are listed
    missing = sorted(f"{f}: from {m} import {n}" for f, m, n in imported
                     if (m, n) not in listed and f"{m}.{n}" not in modules)
    assert not missing, "vLLM names used by adapters but missing from kvref.impl.vllm.api.AREAS:\n" + "\n".join(missing)


@pytest.mark.vllm
def test_every_binding_resolves_against_the_installed_vllm():
    require_vllm()
    assert check_api(list(AREAS)) == []


def test_every_check_area_exists():
    for check, areas in CHECK_AREAS.items():
        assert set(areas) <= set(AREAS), (check, areas)
