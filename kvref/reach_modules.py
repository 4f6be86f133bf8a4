"""Which vLLM files the reach report counts: the packaged module list, resolved against the vLLM
under test (issue #22).

The list is data (``kvref/data/reach_modules.toml``): globs relative to the directory that holds
the ``vllm`` package, so the same list resolves in site-packages and in a developer's checkout.
vLLM is located with ``importlib.util.find_spec`` (``PYTHONPATH`` honoured) and never imported
here: a module imported before coverage starts would have its module-level lines (imports, ``def``
and ``class`` statements) reported as never executed.
"""

from __future__ import annotations

import importlib.util
import os
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from kvref.spec.errors import InvalidFieldError

#: the packaged module list
MODULES_RESOURCE = "data/reach_modules.toml"


@dataclass(frozen=True)
class ModuleGlob:
    """One entry of the list: ``glob`` (relative to the folder holding ``vllm/``) and what it is."""

    glob: str
    what: str


@dataclass(frozen=True)
class ReachModules:
    """The resolved list.

    Args:
        root: the folder that holds the ``vllm`` package directory.
        files: real paths of the listed files, sorted (what coverage.py records: a tree of
            symlinks, as a checkout may be, measures the files they point to).
        globs: the entries of the list.
        unmatched: globs that matched no file of this vLLM (reported: a moved module is not
            silently dropped from the figure).
        names: real path -> ``vllm/...`` name.
    """

    root: str
    files: tuple[str, ...]
    globs: tuple[ModuleGlob, ...]
    unmatched: tuple[str, ...]
    names: dict[str, str]

    def rel(self, path: str) -> str:
        """``vllm/v1/core/block_pool.py`` for a listed file (or any path under :attr:`root`)."""
        real = os.path.realpath(path)
        return self.names.get(real) or os.path.relpath(real, self.root).replace(os.sep, "/")

    def by_rel(self) -> dict[str, str]:
        """Relative name -> absolute path."""
        return {self.rel(f): f for f in self.files}


def load_module_globs(text: str | None = None) -> tuple[ModuleGlob, ...]:
    """Parse the module list (the packaged one when ``text`` is None)."""
    source = MODULES_RESOURCE
    if text is None:
        text = resources.files("kvref").joinpath(MODULES_RESOURCE).read_text(encoding="utf-8")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InvalidFieldError("reach modules", source, f"valid TOML ({exc})") from None
    entries = data.get("module")
    if not isinstance(entries, list) or not entries:
        raise InvalidFieldError("reach modules", source, "a TOML file with [[module]] tables")
    out = []
    for i, entry in enumerate(entries):
        glob = entry.get("glob") if isinstance(entry, dict) else None
        if not isinstance(glob, str) or not glob.startswith("vllm/") or ".." in glob.split("/"):
            raise InvalidFieldError(f"module[{i}].glob", glob, "a path glob under vllm/ (no '..')")
        out.append(ModuleGlob(glob, str(entry.get("what", ""))))
    return tuple(out)


def installed_vllm_root() -> str:
    """The folder holding the ``vllm`` package ``import vllm`` would load, without importing it."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise InvalidFieldError("--reach", "vllm", "an importable vLLM package (the reach report measures its "
                                "KV-cache modules)")
    return os.path.dirname(os.path.realpath(list(spec.submodule_search_locations)[0]))


def resolve_modules(root: str | None = None, globs: tuple[ModuleGlob, ...] | None = None) -> ReachModules:
    """The listed files of the vLLM under ``root`` (default: the importable one)."""
    root = os.path.realpath(root) if root is not None else installed_vllm_root()
    globs = load_module_globs() if globs is None else globs
    names: dict[str, str] = {}
    unmatched = []
    for g in globs:
        found = [p for p in Path(root).glob(g.glob) if p.is_file() and p.suffix == ".py"]
        if not found:
            unmatched.append(g.glob)
        for p in found:
            names[os.path.realpath(p)] = p.relative_to(root).as_posix()
    return ReachModules(root, tuple(sorted(names)), globs, tuple(unmatched), names)
