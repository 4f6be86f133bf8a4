"""Test-local, in-process versions of the vLLM campaign's source faults
(:mod:`kvref.models.mutants.vllm_source.catalogue`).

``planted_vllm_fault(fault_id)`` applies the catalogue's exact ``old -> new`` edits to the source
of the one function that holds them - a method of a class of the fault's module, or a module
function - compiles it in its module's namespace and swaps it in for the ``with`` block (the
installed files are never touched). The fault-class tests use it to show a check's generators
flag a fault in seconds, instead of a campaign subprocess; a catalogue edit that no single
function holds fails loudly.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
import textwrap
from collections.abc import Iterator


@contextlib.contextmanager
def planted_vllm_fault(fault_id: str, paths: tuple[str, ...] | None = None) -> Iterator[str]:
    """Yields ``Owner.function`` of the swapped function. ``paths``: the files (relative to the
    ``vllm`` package) the caller expects the fault in."""
    from kvref.models.mutants.vllm_source.catalogue import by_id

    fault = by_id()[fault_id]
    assert paths is None or fault.path in paths, (fault_id, fault.path)
    module = importlib.import_module(fault.module)
    owners = [module] + [cls for cls in vars(module).values()
                         if inspect.isclass(cls) and cls.__module__ == module.__name__]
    for owner in owners:
        for name, func in list(vars(owner).items()):
            if not inspect.isfunction(func) or func.__code__.co_filename != module.__file__:
                continue
            src = inspect.getsource(func)
            if not all(e.old in src for e in fault.edits):
                continue
            for e in fault.edits:
                assert src.count(e.old) == 1, (fault_id, name)
                src = src.replace(e.old, e.new)
            ns: dict = {}
            # vLLM's own function with the catalogue's edit, compiled in its module's namespace (test-local)
            exec(compile(textwrap.dedent(src), f"<{fault_id}>", "exec"), vars(sys.modules[module.__name__]), ns)  # noqa: S102
            setattr(owner, name, ns[name])
            try:
                yield f"{getattr(owner, '__name__', owner)}.{name}"
            finally:
                setattr(owner, name, func)
            return
    raise AssertionError(f"{fault_id}: no single function of {fault.module} holds the edit")
