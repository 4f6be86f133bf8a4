"""No import cycle among kvref's modules, in every package (``kvref``, ``spec``, ``impl``,
``models``, ``proofs``; #26 found a cycle the old scan of ``kvref/*.py`` and ``models/mutants``
missed): every ``import`` statement counts, at module level or inside a function, absolute or
relative. Two modules that import each other — even lazily, inside a function — are one module
split in two; the registry of checks (:mod:`kvref.checks`) imports the check bodies and nothing
imports it back, the mutant catalogue imports its sub-catalogues and they import only
:mod:`kvref.models.mutants.registry`. Imports under ``if TYPE_CHECKING:`` never run and name a
type for annotations only: they are not edges. The benchmarks import kvref, never the tests."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: source folder -> the dotted package its files are installed as
FOLDERS = {"kvref": "kvref", "spec": "kvref.spec", "impl": "kvref.impl", "models": "kvref.models",
           "proofs": "kvref.proofs"}


def _module_name(path: Path, folder: str, package: str) -> str:
    rel = path.relative_to(ROOT / folder).with_suffix("")
    parts = [] if rel.parts == ("__init__",) else [p for p in rel.parts if p != "__init__"]
    return ".".join([package, *parts])


def sources() -> dict[str, tuple[str, bool]]:
    """Dotted module name -> (source text, is a package ``__init__``), for every checked module."""
    out = {}
    for folder, package in FOLDERS.items():
        base = ROOT / folder
        for path in sorted(base.rglob("*.py")):
            out[_module_name(path, folder, package)] = (path.read_text(encoding="utf-8"), path.name == "__init__.py")
    return out


def import_graph(mods: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """Module -> the checked modules its import statements name (a ``from P import name`` names
    the submodule ``P.name`` when that is a checked module, else ``P``)."""
    graph: dict[str, set[str]] = {}
    for name, (text, is_package) in mods.items():
        here = name if is_package else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in _runtime_nodes(ast.parse(text, name)):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in mods else module for a in node.names]
            edges.update(t for t in targets if t in mods and t != name)
        graph[name] = edges
    return graph


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` except those inside an ``if TYPE_CHECKING:`` body."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_among_kvref_and_the_mutant_modules():
    mods = sources()
    assert "kvref.checks" in mods and "kvref.models.mutants.catalogue" in mods
    assert not cycles(import_graph(mods)), cycles(import_graph(mods))


def test_a_reintroduced_cycle_is_found():
    """The checker sees lazy (function-level) and relative imports: putting back the old edges
    fails the test above."""
    mods = sources()
    explore, is_pkg = mods["kvref.cli.explore"]
    lazy = explore + "\n\ndef _gate(ctx):\n    from ..verify import vllm_gate\n\n    return vllm_gate\n"
    found = cycles(import_graph({**mods, "kvref.cli.explore": (lazy, is_pkg)}))
    assert ["kvref.cli.explore", "kvref.verify"] in found, found
    sub, is_pkg = mods["kvref.models.mutants.catalogue_scheduler"]
    back = sub + "\nfrom kvref.models.mutants.catalogue import mutant  # noqa: E402\n"
    found = cycles(import_graph({**mods, "kvref.models.mutants.catalogue_scheduler": (back, is_pkg)}))
    assert ["kvref.models.mutants.catalogue", "kvref.models.mutants.catalogue_scheduler"] in found, found
    checks, is_pkg = mods["kvref.checks"]
    body = mods["kvref.verify"][0] + "\n\ndef _all():\n    from kvref.checks import CHECKS\n\n    return CHECKS\n"
    found = cycles(import_graph({**mods, "kvref.verify": (body, False)}))
    assert any({"kvref.checks", "kvref.verify"} <= set(c) for c in found), found


def test_the_whole_tree_is_scanned_and_type_checking_imports_are_not_edges():
    mods = sources()
    assert {"kvref.impl.reference.scheduler", "kvref.impl.torch.triton_kernels.attention",
            "kvref.impl.vllm.connector", "kvref.spec.planning", "kvref.proofs.theorems"} <= set(mods)
    text, is_pkg = mods["kvref.impl.reference.scheduler_connector"]
    guarded = text + "\n\nif TYPE_CHECKING:\n    from .scheduler import Scheduler as _S  # noqa\n"
    assert not cycles(import_graph({**mods, "kvref.impl.reference.scheduler_connector": (guarded, is_pkg)}))
    unguarded = text + "\n\ndef _s():\n    from .scheduler import Scheduler\n\n    return Scheduler\n"
    found = cycles(import_graph({**mods, "kvref.impl.reference.scheduler_connector": (unguarded, is_pkg)}))
    assert any({"kvref.impl.reference.scheduler", "kvref.impl.reference.scheduler_connector"} <= set(c)
               for c in found), found
    # the Triton package and its kernels: the kernels import .availability, never the package
    init, is_pkg = mods["kvref.impl.torch.triton_kernels"]
    lazy = init + "\n\ndef _k():\n    from .attention import _paged_attention_kernel\n\n    return 1\n"
    found = cycles(import_graph({**mods, "kvref.impl.torch.triton_kernels": (lazy, is_pkg)}))
    assert found == [], found  # the kernels no longer import the package: no way back


def _benchmark_files() -> list[Path]:
    """Every benchmark module, those in sub-folders (``benchmarks/v1core_standin``) included."""
    return sorted((ROOT / "benchmarks").rglob("*.py"))


def test_benchmarks_import_kvref_never_the_tests():
    files = _benchmark_files()
    assert any(p.parent != ROOT / "benchmarks" for p in files), "the scan reaches the sub-folders"
    offenders = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno}" for n in names
                          if n == "tests" or n.startswith("tests.")]
    assert not offenders, offenders


def test_no_import_cycle_with_the_benchmarks():
    """The benchmarks join the graph as ``benchmarks.*``: kvref never imports them back, and two
    benchmark modules never import each other both ways (#26: the scan covers benchmarks/)."""
    mods = sources()
    for path in _benchmark_files():
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(p for p in rel.parts if p != "__init__")
        mods[name] = (path.read_text(encoding="utf-8"), path.name == "__init__.py")
    graph = import_graph(mods)
    assert any(name.startswith("benchmarks.") and edges for name, edges in graph.items()), \
        "the benchmarks' imports of kvref are edges of the graph"
    assert not cycles(graph), cycles(graph)
    # a cycle between two benchmark modules (lazy imports both ways) is seen
    a, b = "benchmarks.v1core_standin.run_v1core", "benchmarks.v1core_standin.kvref_standin"
    back = {a: (mods[a][0] + f"\n\ndef _x():\n    import {b}\n", False),
            b: (mods[b][0] + f"\n\ndef _y():\n    import {a}\n", False)}
    assert sorted([a, b]) in cycles(import_graph({**mods, **back}))
