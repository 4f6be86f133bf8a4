"""Test-local, in-process versions of the vLLM campaign's SimpleCPU source faults.

``vllm_fault(fault_id)`` applies the catalogue's exact ``old -> new`` edit to the *source of the one
method* of vLLM's ``SimpleCPUOffloadScheduler`` that contains it, compiles that method in the
module's namespace and swaps it in for the duration of the ``with`` block (the installed files are
never touched). Used by the fault-class tests to show that conform-offload's generators flag the
fault, in seconds instead of a campaign subprocess.
"""

from __future__ import annotations

from tests.vllm_faults import planted_vllm_fault


def vllm_fault(fault_id: str):
    """:func:`tests.vllm_faults.planted_vllm_fault` for vLLM's SimpleCPU offload manager."""
    return planted_vllm_fault(fault_id, ("v1/simple_kv_offload/manager.py",))
