"""Source faults in a *copy* of the installed vLLM, never in the installed files.

A :class:`SourceFault` is one exact ``old -> new`` text edit on one file of the vLLM package (a
path relative to the ``vllm`` package directory, e.g. ``v1/core/block_pool.py``). It is applied
through an *overlay*: a temporary directory holding a ``vllm/`` tree in which

* every directory on the way to the mutated file is a real directory,
* the mutated file is a real, edited copy,
* everything else is a symlink to the installed file or directory, and
* each real directory's ``__pycache__`` is a real directory of symlinks to the installed ``.pyc``
  files minus the mutated module's, so importing the overlay compiles one module, not all of vLLM,
  and Python never writes a stale-source ``.pyc`` into the installation.

A subprocess started with ``PYTHONPATH=<overlay>`` then imports ``vllm`` from the overlay (a
``PYTHONPATH`` entry precedes site-packages); nothing in the installed package changes, so the
campaign can run while other tools use the same vLLM.

Why exact text edits and not AST patches: a fault reads as a diff a vLLM developer recognises, and
an edit whose ``old`` text is not found exactly once is an error naming the fault
(:class:`FaultDoesNotApplyError`) — a vLLM that moved on makes the catalogue say so instead of
silently measuring fewer faults.

This module never imports vLLM (only ``kvref.impl.vllm`` may): it locates the package with
:func:`importlib.util.find_spec`, which does not execute it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from collections.abc import Iterator

from kvref.spec.errors import InvalidFieldError, KVRefError

#: fault classes
HISTORIC = "historic"
CLASSIC = "classic"
NEUTRAL = "neutral"
#: generated mechanically from vLLM's source (:mod:`.generated`), not chosen by anyone: the recall
#: goal is over historic + classic only; a generated survivor may be an equivalent mutant
GENERATED = "generated"
CLASSES = (HISTORIC, CLASSIC, NEUTRAL, GENERATED)


class FaultDoesNotApplyError(KVRefError):
    """A fault's ``old`` text is not found exactly once in its file of the installed vLLM."""

    def __init__(self, fault_id: str, path: str, count: int, old: str) -> None:
        self.fault_id = fault_id
        self.path = path
        self.count = count
        first = old.strip().splitlines()[0] if old.strip() else old
        super().__init__(f"fault {fault_id!r}: its text is found {count} times in vllm/{path} (expected exactly "
                         f"once): {first[:80]!r} — the installed vLLM differs from the one the catalogue was "
                         "written for; update or drop the fault")


@dataclass(frozen=True)
class Edit:
    """One exact replacement: ``old`` must occur exactly once in the file."""

    old: str
    new: str


@dataclass(frozen=True)
class SourceFault:
    """One fault (or behaviour-preserving refactor) in vLLM's source.

    Args:
        id: short unique id (``"pool.free_append_all"``).
        path: file relative to the ``vllm`` package dir (``"v1/core/block_pool.py"``).
        edits: the exact text edits, applied in order (most faults have one).
        kind: :data:`HISTORIC` (pre-fix logic of a merged vLLM fix; ``bug`` names it),
            :data:`CLASSIC` (off-by-one, wrong comparison, dropped call, swapped order …) or
            :data:`NEUTRAL` (a refactor that must *not* be flagged) or :data:`GENERATED` (a mutation
            operator applied to a sampled site, :mod:`.generated`).
        description: what the edit does to behaviour, in words.
        bug: the vLLM issue / PR numbers for historic faults.
        behaviour: the class of behaviour it lives in (``admission``, ``prefix-cache``, ``free-order``,
            ``sliding-window``, ``offload``, ``scheduler``, ``planning`` …), so survivors group.
    """

    id: str
    path: str
    edits: tuple[Edit, ...]
    kind: str
    description: str
    bug: str | None = None
    behaviour: str = ""

    def __post_init__(self) -> None:
        if self.kind not in CLASSES:
            raise InvalidFieldError("SourceFault.kind", self.kind, " / ".join(CLASSES))
        if self.kind == HISTORIC and not self.bug:
            raise InvalidFieldError("SourceFault.bug", self.bug, "the vLLM issue/PR of a historic fault")
        if not self.edits:
            raise InvalidFieldError("SourceFault.edits", self.edits, "at least one edit")
        if not self.path.endswith(".py") or self.path.startswith(("/", "..")):
            raise InvalidFieldError("SourceFault.path", self.path, "a .py file relative to the vllm package dir")

    @property
    def module(self) -> str:
        """The dotted module name the file is imported as (``vllm.v1.core.block_pool``)."""
        return "vllm." + self.path[:-3].replace("/", ".")

    def apply_to(self, text: str) -> str:
        """The file's text with every edit applied; :class:`FaultDoesNotApplyError` if one does not
        match exactly once (checked against the text as edited so far)."""
        for e in self.edits:
            n = text.count(e.old)
            if n != 1:
                raise FaultDoesNotApplyError(self.id, self.path, n, e.old)
            text = text.replace(e.old, e.new, 1)
        return text


def fault(id: str, path: str, old: str, new: str, kind: str, description: str, *, bug: str | None = None,
          behaviour: str = "", more: tuple[tuple[str, str], ...] = ()) -> SourceFault:
    """Shorthand for a fault of one edit (``more``: further ``(old, new)`` edits on the same file)."""
    edits = (Edit(old, new),) + tuple(Edit(o, n) for o, n in more)
    return SourceFault(id, path, edits, kind, description, bug, behaviour)


def installed_vllm_dir() -> str:
    """The installed ``vllm`` package directory, found without importing vLLM.

    Raises :class:`InvalidFieldError` when vLLM is not importable here.
    """
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise InvalidFieldError("vllm", None, "an installed vLLM package (pip install vllm)")
    return os.path.realpath(list(spec.submodule_search_locations)[0])


def file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _pyc_prefix(filename: str) -> str:
    return filename[:-3] + "."  # "block_pool." matches block_pool.cpython-311.pyc, .opt-1 ...


@dataclass
class Overlay:
    """A built overlay: ``root`` goes on ``PYTHONPATH``; ``mutated`` is the edited copy."""

    root: str
    vllm_dir: str
    fault: SourceFault | None
    mutated: str | None = None
    installed_hashes: dict[str, str] = field(default_factory=dict)

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """An environment whose ``import vllm`` resolves to the overlay."""
        env = dict(os.environ if base is None else base)
        env["PYTHONPATH"] = self.root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        return env


def _link_dir_contents(src: str, dst: str, keep_real: str | None, skip_file: str | None) -> None:
    """Fill real dir ``dst`` with symlinks to ``src``'s entries, except ``keep_real`` (made a real
    dir by the caller) and ``skip_file`` (copied by the caller); ``__pycache__`` becomes a real dir
    of symlinks to the cached bytecode of every module except ``skip_file``'s."""
    for name in os.listdir(src):
        s = os.path.join(src, name)
        if name in (keep_real, skip_file):
            continue
        if name == "__pycache__" and os.path.isdir(s):
            pyc_dir = os.path.join(dst, name)
            os.mkdir(pyc_dir)
            for pyc in os.listdir(s):
                if skip_file and pyc.startswith(_pyc_prefix(skip_file)):
                    continue
                os.symlink(os.path.join(s, pyc), os.path.join(pyc_dir, pyc))
            continue
        os.symlink(s, os.path.join(dst, name))


def build_overlay(fault: SourceFault | None, root: str, vllm_dir: str | None = None) -> Overlay:
    """Build the overlay for ``fault`` (None: a clean overlay, every file a link) under ``root``.

    Raises :class:`FaultDoesNotApplyError` when the fault's text does not match the installed file.
    """
    vllm_dir = vllm_dir or installed_vllm_dir()
    top = os.path.join(root, "vllm")
    if fault is None:
        os.makedirs(top)
        _link_dir_contents(vllm_dir, top, None, None)
        return Overlay(root, vllm_dir, None)
    parts = fault.path.split("/")
    src_file = os.path.join(vllm_dir, *parts)
    if not os.path.isfile(src_file):
        raise InvalidFieldError(f"fault {fault.id!r} path", fault.path, f"a file under {vllm_dir}")
    with open(src_file, encoding="utf-8") as f:
        original = f.read()
    edited = fault.apply_to(original)  # before anything is created: a fault that does not apply leaves no trace
    os.makedirs(top)
    src, dst = vllm_dir, top
    for i, name in enumerate(parts):
        last = i == len(parts) - 1
        _link_dir_contents(src, dst, None if last else name, name if last else None)
        if last:
            mutated = os.path.join(dst, name)
            with open(mutated, "w", encoding="utf-8") as f:
                f.write(edited)
        else:
            src, dst = os.path.join(src, name), os.path.join(dst, name)
            os.mkdir(dst)
    return Overlay(root, vllm_dir, fault, mutated, {fault.path: file_sha256(src_file)})


@contextmanager
def overlay(fault: SourceFault | None, vllm_dir: str | None = None) -> Iterator[Overlay]:
    """:func:`build_overlay` in a temporary directory removed afterwards."""
    root = tempfile.mkdtemp(prefix="kvref_vllm_overlay_")
    try:
        yield build_overlay(fault, root, vllm_dir)
    finally:
        shutil.rmtree(root, ignore_errors=True)


