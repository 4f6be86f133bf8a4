"""The import graph runs one way (spec <- impl <- proofs <- models <- kvref), and only
``kvref.impl.vllm`` imports vLLM: one place binds to vLLM's API, so a changed vLLM is met there.

``models`` may use ``proofs`` (the mutant campaign re-checks the proofs' formulas and variants);
``proofs`` never imports ``models``, so the two stay acyclic."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: folder -> the kvref layers its modules may import
ALLOWED = {
    "spec": {"spec"},
    "impl": {"spec", "impl"},
    "models": {"spec", "impl", "proofs", "models"},
    "proofs": {"spec", "impl", "proofs"},
}


def _imports(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.module, node.lineno))
    return out


def _sources(folder: str):
    return sorted((ROOT / folder).rglob("*.py"))


def test_only_impl_vllm_imports_vllm():
    offenders = []
    for folder in ("spec", "impl", "models", "proofs", "kvref"):
        for path in _sources(folder):
            rel = path.relative_to(ROOT)
            if rel.parts[:2] == ("impl", "vllm"):
                continue
            offenders += [f"{rel}:{line} imports {name}" for name, line in _imports(path)
                          if name == "vllm" or name.startswith("vllm.")]
    assert not offenders, offenders


def test_layers_import_only_downwards():
    layer_of = {"kvref.spec": "spec", "kvref.impl": "impl", "kvref.models": "models", "kvref.proofs": "proofs"}
    offenders = []
    for folder, allowed in ALLOWED.items():
        for path in _sources(folder):
            for name, line in _imports(path):
                if not name.startswith("kvref"):
                    continue
                layer = next((v for k, v in layer_of.items() if name == k or name.startswith(k + ".")), "kvref")
                if layer not in allowed:
                    offenders.append(f"{path.relative_to(ROOT)}:{line} imports {name} ({layer} is above {folder})")
    assert not offenders, offenders


def test_the_version_constants_match_the_package():
    import tomllib

    from kvref.spec.version import KVREF_VERSION

    with open(ROOT / "pyproject.toml", "rb") as fh:
        assert KVREF_VERSION == tomllib.load(fh)["project"]["version"]
