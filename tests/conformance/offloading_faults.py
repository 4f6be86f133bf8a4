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
from collections.abc import Iterable

from tests.vllm_faults import planted_vllm_fault

_PATHS = {"distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py",
          "distributed/kv_transfer/kv_connector/v1/offloading/config.py"}


def vllm_offloading_fault(fault_id: str):
    """:func:`tests.vllm_faults.planted_vllm_fault` for the OffloadingConnector's files."""
    return planted_vllm_fault(fault_id, tuple(_PATHS))


@contextlib.contextmanager
def planted_edit(owner, name: str, old: str, new: str):
    """vLLM's ``owner.name`` with one source edit ``old`` -> ``new`` (not in the campaign's
    catalogue), compiled in its module's namespace and swapped in for the ``with`` block."""
    func = vars(owner)[name]
    src = textwrap.dedent(inspect.getsource(func))
    assert src.count(old) == 1, (name, old)
    ns: dict = {}
    # vLLM's own function with the test's edit (test-local)
    module = sys.modules[getattr(owner, "__module__", None) or owner.__name__]  # a class, or a module itself
    exec(compile(src.replace(old, new), f"<planted {name}>", "exec"), vars(module), ns)  # noqa: S102
    setattr(owner, name, ns[name])
    try:
        yield
    finally:
        setattr(owner, name, func)


def offloading_scheduler_class():
    """vLLM's ``OffloadingConnectorScheduler`` (the owner of most planted edits)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler

    return OffloadingConnectorScheduler


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
