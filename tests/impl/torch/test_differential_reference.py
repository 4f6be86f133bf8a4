"""Torch implementation vs the readable reference (``ReferenceKVCacheManager``), no vLLM needed.

Same generated configs and traces as the vLLM differential test; both implementations were
written independently from the vLLM 0.33.0 sources, so agreement here is a second witness.
"""

from __future__ import annotations

from hypothesis import settings

from tests.conftest import profile_examples


def test_torch_matches_reference_state_machine():
    from kvref.impl.reference.adapter import ReferenceKVCacheManager
    from kvref.models.machines.torch_differential import make_differential_machine

    machine = make_differential_machine(ReferenceKVCacheManager)
    machine.TestCase.settings = settings(max_examples=profile_examples(25, 300), stateful_step_count=40)
    machine.TestCase().runTest()
