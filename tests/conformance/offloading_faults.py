"""Test-local, in-process versions of the vLLM campaign's OffloadingConnector source faults.

``vllm_offloading_fault(fault_id)`` applies the catalogue's exact ``old -> new`` edit to the source
of the one function that holds it - a method of vLLM's ``OffloadingConnectorScheduler``
(``offloading/scheduler.py``) or a function of ``offloading/config.py`` - compiles it in its
module's namespace and swaps it in for the ``with`` block (the installed files are never
touched). kvref's vLLM backend reads ``get_sliding_window_size_in_chunks`` from the module when a
world is built, so a swapped config function is live for worlds built inside the block.

``conform_offloading(cases)`` is conform-offload's comparison (kvref/verify.py ``_run_offload``)
restricted to the OffloadingConnector cases: reference and vLLM worlds op by op, a vLLM assert or a
differing output/observation is a finding.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import textwrap
from collections.abc import Iterable, Iterator

_PATHS = {"distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py",
          "distributed/kv_transfer/kv_connector/v1/offloading/config.py"}


@contextlib.contextmanager
def vllm_offloading_fault(fault_id: str) -> Iterator[str]:
    import importlib

    from kvref.models.mutants.vllm_source.catalogue import by_id

    fault = by_id()[fault_id]
    assert fault.path in _PATHS, fault.path
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


def conform_offloading(cases: Iterable) -> str | None:
    """The first finding of conform-offload's comparison on the OffloadingConnector ``cases``
    (``(OffloadingConfig, ops)``), or None."""
    from kvref.models.offload.offloading_connector_world import (
        OffloadingConfig,
        OffloadingWorld,
    )
    from kvref.models.offload.traces import apply_offloading_op

    for i, (cfg, ops) in enumerate(cases):
        if not isinstance(cfg, OffloadingConfig):
            continue
        worlds = [OffloadingWorld(cfg, b, strict=False) for b in ("reference", "vllm")]
        for j, op in enumerate(ops):
            try:
                outs = [apply_offloading_op(w, op) for w in worlds]
            except KeyError:
                break  # vLLM 0.33.0's KeyError after a connector reset (docs/offload.md), as verify
            except AssertionError as exc:
                return f"trace {i} op {j} {op[0]}: {type(exc).__name__}: {exc}"[:400]
            if outs[0] != outs[1] or worlds[0].observe() != worlds[1].observe():
                return f"trace {i} op {j} {op[0]}: reference and vLLM differ"
    return None
