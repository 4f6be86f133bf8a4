"""The same Hypothesis inputs on a Ray worker as in the local run (issue #27).

A seed does not fix Hypothesis' inputs alone: since 6.1xx Hypothesis mixes into its generation the
constants found in the source of every *local* module loaded so far (not site-packages, not the
stdlib, not tests: ``hypothesis.internal.conjecture.providers._get_local_constants``). kvref is such
a local module tree, so a check's traces depend on which kvref modules its process has imported.
A Ray worker imports others than ``kvref verify`` does (kvref.ray_runner, no kvref.cli.*), and on
a first try ``machine-scheduler --seed 3`` drew other traces on Ray than locally (1678 ops, 2
preemptions vs 1693 ops, 20 preemptions).

So each unit runs in a fresh worker process (``max_calls=1``) that, before the unit, imports the
local modules the driver had loaded (:func:`local_modules`, which leaves out the Ray-only modules:
the local run never loads them) and hides from Hypothesis the local modules it loaded that the
driver had not (:func:`align_with`). The campaigns add the modules their clean-reference units
loaded, which the local campaign has loaded by the time its mutants run.

Where the Hypothesis internal is missing (another Hypothesis version) nothing is patched and the
inputs are as reproducible as that version makes them.
"""

from __future__ import annotations

import importlib
import sys

#: loaded by the Ray path only: their constants must not reach the worker's inputs
RAY_ONLY = ("kvref.ray_runner", "kvref.ray_verify", "kvref.ray_mutants", "kvref.ray_inputs", "kvref.ray_explore",
            "kvref.ray_split")


def _is_local(module) -> bool:
    try:
        from hypothesis.internal.constants_ast import is_local_module_file
    except ImportError:  # pragma: no cover - another Hypothesis version, or none
        return False
    path = getattr(module, "__file__", None)
    return path is not None and is_local_module_file(path)


def local_modules() -> list[str]:
    """The local modules this process has loaded (whose constants Hypothesis draws from), less
    :data:`RAY_ONLY`."""
    return sorted(name for name, m in list(sys.modules.items())
                  if m is not None and name not in RAY_ONLY and _is_local(m))


def align_with(names: list[str] | None) -> bool:
    """Make this process' Hypothesis constant pool the one of a process that loaded ``names``:
    import them, and mark every other local module loaded here as already seen (its constants are
    then never collected). Returns whether the Hypothesis internal was there to patch."""
    if names is None:
        return False
    try:
        from hypothesis.internal.conjecture import providers

        seen = providers._seen_modules
    except (ImportError, AttributeError):  # pragma: no cover - another Hypothesis version
        return False
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module the worker cannot import is the probe's business
            continue
    wanted = set(names)
    for name, m in list(sys.modules.items()):
        if m is not None and name not in wanted and _is_local(m):
            seen.add(id(m))
    return True
