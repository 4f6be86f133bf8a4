"""Torch implementation vs vLLM 0.33.0's own KVCacheManager on generated configs and traces.

Same block ids (exactly), admission decisions, hits, free-queue order, hash map and ref counts
after every operation; uniform and hybrid layouts of full attention, sliding window and chunked
local attention, with prefix caching on/off, watermark, reserved blocks, lookahead slots,
in-flight tokens, the full-sequence admission gate with its caps, preemption and frees.
"""

from __future__ import annotations

import pytest
from hypothesis import settings

from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def twin_factory():
    require_vllm()
    from tests.impl.torch.vllm_twin import VllmTwin

    return VllmTwin


def test_torch_matches_vllm_state_machine(twin_factory):
    from kvref.models.torch_differential import make_differential_machine

    machine = make_differential_machine(twin_factory)
    machine.TestCase.settings = settings(max_examples=profile_examples(25, 400), stateful_step_count=40)
    machine.TestCase().runTest()
