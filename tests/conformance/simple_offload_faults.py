"""Test-local, in-process versions of the vLLM campaign's SimpleCPU source faults.

``vllm_fault(fault_id)`` applies the catalogue's exact ``old -> new`` edit to the *source of the one
method* of vLLM's ``SimpleCPUOffloadScheduler`` that contains it, compiles that method in the
module's namespace and swaps it in for the duration of the ``with`` block (the installed files are
never touched). Used by the fault-class tests to show that conform-offload's generators flag the
fault, in seconds instead of a campaign subprocess.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import textwrap


@contextlib.contextmanager
def vllm_fault(fault_id: str):
    from kvref.models.mutants.vllm_source.catalogue import FAULTS
    from vllm.v1.simple_kv_offload import manager

    fault = next(f for f in FAULTS if f.id == fault_id)
    assert fault.path == "v1/simple_kv_offload/manager.py", fault.path
    cls = manager.SimpleCPUOffloadScheduler
    for name, func in list(vars(cls).items()):
        if not inspect.isfunction(func):
            continue
        src = inspect.getsource(func)
        if not all(e.old in src for e in fault.edits):
            continue
        for e in fault.edits:
            assert src.count(e.old) == 1, (fault_id, name)
            src = src.replace(e.old, e.new)
        ns: dict = {}
        # vLLM's own method with the catalogue's edit, compiled in its module's namespace (test-local)
        exec(compile(textwrap.dedent(src), f"<{fault_id}>", "exec"), vars(sys.modules[cls.__module__]), ns)  # noqa: S102
        setattr(cls, name, ns[name])
        try:
            yield name
        finally:
            setattr(cls, name, func)
        return
    raise AssertionError(f"{fault_id}: no single method of SimpleCPUOffloadScheduler holds the edit")
