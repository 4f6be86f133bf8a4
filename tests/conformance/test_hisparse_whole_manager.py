"""A HiSparse pool behind vLLM 0.33.0's whole ``KVCacheManager`` vs the reference's (#22;
models/conformance/hisparse_kv_manager.py, also run by ``kvref verify --against vllm`` in
conform-kv-manager): hits, ``allocate_slots`` (the host source's longer hit trimmed to the reused
prefix), write-backs and frees, the whole pool state compared after every step."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvref.models.conformance.hisparse_kv_manager import (STEPS, ReferenceHiSparseKVCacheManager,
                                                          run_whole_manager_program, whole_manager_configs)
from kvref.spec.errors import InvalidFieldError
from kvref.spec.hisparse import HiSparsePoolConfig
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


def _vllm():
    require_vllm()
    from kvref.impl.vllm.hisparse_kv_manager import VllmHiSparseKVCacheManager

    return VllmHiSparseKVCacheManager


def test_generated_programs_agree_and_reach_the_longer_source_hit():
    """Derandomized: hits where the host source keeps more than the GPU groups, refusals,
    completed write-backs and frees are reached under every profile."""
    make = _vllm()
    seen: Counter = Counter()

    @settings(max_examples=profile_examples(40, 100), deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(whole_manager_configs(), st.lists(st.integers(8, 48), min_size=3, max_size=3), STEPS)
    def run(config, lengths, steps):
        seen.update(run_whole_manager_program(config, lengths, steps, make))

    run()
    for path in ("hit", "longer_source_hit", "allocated", "refused", "transfers_done", "freed"):
        assert seen[path] > 0, f"{path} never reached: {dict(seen)}"


def test_a_host_hit_is_trimmed_to_the_reused_prefix():
    """r0 writes back and publishes its prompt, is freed; r1 on the same prompt hits the host
    source's published pages: vLLM and the reference hand out the same blocks per group."""
    make = _vllm()
    config = HiSparsePoolConfig(block_size=2, num_gpu_blocks=40, host_num_blocks=40, blocks_per_request=1,
                                num_resident_groups=1, max_model_len=32, max_in_flight_tokens=32, enable_caching=True)
    steps = [(0, 16, False, True), (0, 8, True, True), (1, 4, False, True)]
    seen = run_whole_manager_program(config, [24, 24, 24], steps, make)
    assert seen["hit"] == 1 and seen["allocated"] == 3, dict(seen)


def test_both_sides_refuse_an_unknown_request_and_a_second_admission():
    config = HiSparsePoolConfig(2, 12, 8, 1, 1, 16, 16)
    for side in (ReferenceHiSparseKVCacheManager(config), _vllm()(config)):
        with pytest.raises(InvalidFieldError, match="request_id"):
            side.manager_allocate("r-none", 1)
        side.manager_hit("r0", [1, 2, 3])
        with pytest.raises(InvalidFieldError, match="request_id"):
            side.manager_hit("r0", [1, 2, 3])
        with pytest.raises(InvalidFieldError, match="num_new_tokens"):
            side.manager_allocate("r0", 0)
