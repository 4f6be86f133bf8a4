"""Mutants of the reference: faults applied at runtime, so the reference code itself stays clean.

A :class:`Mutant` names one fault — a historic variant (the pre-fix behaviour of a real vLLM bug)
or a classic fault (off-by-one, order reversed, a counter forgotten) — and knows how to patch it
in: :meth:`Mutant.applied` is a context manager that replaces one attribute (a method of a
reference class, or a function of ``kvref.spec``) and restores it afterwards. A module-level
function that other modules imported by name (``from kvref.models.mathutil import cdiv``) is replaced in every
loaded ``kvref`` module that holds it, so the fault is seen wherever the original was.

A fault inside a long method (one condition of the scheduler loop) is written with
:func:`edit_source`: the original method's source with one snippet replaced, compiled in the
original's module — a one-line mutation of the real code rather than a hand-kept faulty copy. If
the snippet is no longer in the source, building the mutant fails loudly instead of patching in
the clean code.

The catalogue lives in :mod:`kvref.models.mutants.catalogue`; the campaign that runs the checks
against each mutant in :mod:`kvref.models.mutants.campaign`.
"""

from __future__ import annotations

import __future__
import ast
import importlib
import inspect
import sys
import textwrap
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from kvref.spec.errors import InvalidFieldError

#: kinds of mutants
HISTORIC = "historic"
CLASSIC = "classic"


@dataclass(frozen=True)
class Mutant:
    """One fault.

    Args:
        name: short unique id (``"pool.touch_no_ref"``).
        description: what the fault does, in words.
        target: ``"module:attr"`` or ``"module:Class.attr"`` — what gets replaced.
        make: ``original -> replacement``; builds the faulty attribute from the original one.
        kind: :data:`HISTORIC` or :data:`CLASSIC`.
        vllm_bug: the vLLM issue/PR whose pre-fix behaviour this re-creates (historic mutants).
        layer: which part of kvref it lives in (``spec``, ``pool``, ``manager``, ``scheduler``…),
            so a campaign can skip mutants whose layer is not built yet.
    """

    name: str
    description: str
    target: str
    make: Callable[[Any], Any]
    kind: str = CLASSIC
    vllm_bug: str | None = None
    layer: str = "pool"

    def resolve(self) -> tuple[Any, str]:
        """(owner object, attribute name) of the target; raises ``ImportError``/``AttributeError``
        if the code it mutates does not exist (yet)."""
        module_name, _, path = self.target.partition(":")
        owner: Any = importlib.import_module(module_name)
        parts = path.split(".")
        for p in parts[:-1]:
            owner = getattr(owner, p)
        getattr(owner, parts[-1])  # must exist
        return owner, parts[-1]

    def available(self) -> bool:
        """Whether the code this mutant patches exists in this checkout."""
        try:
            self.resolve()
        except (ImportError, AttributeError):
            return False
        return True

    @contextmanager
    def applied(self) -> Iterator[None]:
        """Patch the fault in for the duration of the ``with`` block."""
        owner, attr = self.resolve()
        original = owner.__dict__[attr] if isinstance(owner, type) and attr in owner.__dict__ \
            else getattr(owner, attr)
        func = original.__func__ if isinstance(original, (staticmethod, classmethod)) else original
        replacement = self.make(func)
        if isinstance(original, staticmethod):
            replacement = staticmethod(replacement)
        elif isinstance(original, classmethod):
            replacement = classmethod(replacement)
        patched: list[tuple[Any, str, Any]] = [(owner, attr, original)]
        setattr(owner, attr, replacement)
        if not isinstance(owner, type):  # a module function: rebind every by-name import of it
            for mod in list(sys.modules.values()):
                if mod is owner or not getattr(mod, "__name__", "").startswith("kvref"):
                    continue
                for name, value in list(vars(mod).items()):
                    if value is original:
                        patched.append((mod, name, value))
                        setattr(mod, name, replacement)
        try:
            yield
        finally:
            for obj, name, value in reversed(patched):
                setattr(obj, name, value)


def edit_source(func: Callable[..., Any], old: str, new: str) -> Callable[..., Any]:
    """``func`` recompiled with the snippet ``old`` of its source replaced by ``new``.

    The snippet must occur exactly once in the dedented source (a method's body then starts at
    four spaces of indentation), and ``new`` must have as many lines as ``old``. The new function shares ``func``'s module globals, name and
    defaults, and its line numbers are those of the original file, so a traceback points at the
    mutated line.

    Raises:
        InvalidFieldError: ``func`` is not a plain Python function (or a closure, whose cells
            cannot be recompiled), ``old`` does not occur exactly once in its source, or ``new``
            has a different number of lines.
    """
    if not inspect.isfunction(func):
        raise InvalidFieldError("func", func, "a Python function")
    if func.__closure__:
        raise InvalidFieldError("func", func.__qualname__, "a function without closure cells")
    if not isinstance(old, str) or not old or not isinstance(new, str):
        raise InvalidFieldError("old", old, "a non-empty source snippet (str), and new a str")
    if new.count("\n") != old.count("\n"):
        raise InvalidFieldError("new", new, f"as many lines as old ({old.count(chr(10)) + 1}), so "
                                "tracebacks keep the original line numbers")
    lines, first_line = inspect.getsourcelines(func)
    src = textwrap.dedent("".join(lines))
    found = src.count(old)
    if found != 1:
        raise InvalidFieldError("old", old, f"a snippet occurring exactly once in {func.__qualname__} "
                                f"(found {found} times)")
    tree = ast.parse(src.replace(old, new))
    ast.increment_lineno(tree, first_line - 1)
    code = compile(tree, inspect.getsourcefile(func) or "<mutant>", "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    namespace: dict[str, Any] = {}
    exec(code, func.__globals__, namespace)  # noqa: S102 - recompiling kvref's own source
    out = namespace[func.__name__]
    out.__defaults__, out.__kwdefaults__ = func.__defaults__, func.__kwdefaults__
    out.__qualname__, out.__module__ = func.__qualname__, func.__module__
    return out


class Catalogue:
    """Mutants by name, in definition order."""

    def __init__(self) -> None:
        self._by_name: dict[str, Mutant] = {}

    def add(self, mutant: Mutant) -> Mutant:
        if mutant.name in self._by_name:
            raise InvalidFieldError("mutant.name", mutant.name, "a name not already in the catalogue")
        self._by_name[mutant.name] = mutant
        return mutant

    def __iter__(self) -> Iterator[Mutant]:
        return iter(self._by_name.values())

    def __len__(self) -> int:
        return len(self._by_name)

    def __getitem__(self, name: str) -> Mutant:
        try:
            return self._by_name[name]
        except KeyError:
            raise InvalidFieldError("mutant", name, "one of " + ", ".join(self._by_name)) from None

    def names(self) -> list[str]:
        return list(self._by_name)

    def select(self, names: list[str] | None = None, layers: list[str] | None = None,
               available_only: bool = True) -> list[Mutant]:
        chosen = [self[n] for n in names] if names else list(self)
        if layers:
            chosen = [m for m in chosen if m.layer in layers]
        if available_only:
            chosen = [m for m in chosen if m.available()]
        return chosen
