"""A HiSparse pool behind vLLM 0.33.0's whole ``KVCacheManager`` vs the reference's (#22;
models/conformance/hisparse_kv_manager.py, also run by ``kvref verify --against vllm`` in
conform-kv-manager): hits, ``allocate_slots`` (the host source's longer hit trimmed to the reused
prefix), write-backs and frees, the whole pool state compared after every step, and with KV cache
events on both managers' events after every operation, in both report modes (``"full"`` announces
a prefix hit). CI=true: about 12 s for the module after vLLM's import."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings

from kvref.models.conformance.hisparse_kv_manager import (ReferenceHiSparseKVCacheManager, run_whole_manager_program,
                                                          whole_manager_programs)
from kvref.spec.errors import InvalidFieldError
from kvref.spec.hisparse import HiSparsePoolConfig
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


def _vllm():
    require_vllm()
    from kvref.impl.vllm.hisparse_kv_manager import VllmHiSparseKVCacheManager

    return VllmHiSparseKVCacheManager


def test_generated_programs_agree_with_kv_events_and_reach_the_host_only_hit():
    """Derandomized: hits where the host source keeps more than the GPU groups, hits on the host
    alone (the GPU groups hit 0 tokens) looked up in report mode "full" with events on, refusals,
    completed write-backs, frees, and both pools' BlockStored / BlockRemoved events are reached
    under every profile (CI=true: 80 programs, about 20 s)."""
    make = _vllm()
    seen: Counter = Counter()

    @settings(max_examples=profile_examples(40, 80), deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(whole_manager_programs())
    def run(program):
        seen.update(run_whole_manager_program(make_vllm=make, **program))

    run()
    for path in ("hit", "longer_source_hit", "source_only_hit", "full_hit", "full_source_only_hit", "allocated",
                 "refused", "transfers_done", "freed", "event_BlockStored", "event_BlockStored_cpu",
                 "event_BlockRemoved"):
        assert seen[path] > 0, f"{path} never reached: {dict(seen)}"


#: r0 and r2 (a prompt of its own) run and finish; r2 again: its prefix is still published on the
#: host, not on the GPU (r0's second chunk took r2's GPU blocks), so the GPU groups hit 0 tokens
#: while the host source hits (vLLM's HybridKVCacheCoordinator leaves that group's hit untruncated)
_HOST_ONLY = dict(
    config=HiSparsePoolConfig(block_size=4, num_gpu_blocks=17, host_num_blocks=10, blocks_per_request=1,
                              num_resident_groups=1, max_model_len=32, max_in_flight_tokens=32, enable_caching=True),
    lengths=[29, 8, 8], steps=[(0, 23, False, False), (2, 8, False, True), (0, 6, False, False), (2, 1, False, False)],
    prompts=("shared", "shared", "own"), events=(True, ("incremental", "incremental", "full")))
#: r0 writes back and publishes, is freed; r1 on the same prompt hits the host source in mode "full"
_FULL_HIT = dict(
    config=HiSparsePoolConfig(block_size=2, num_gpu_blocks=40, host_num_blocks=40, blocks_per_request=1,
                              num_resident_groups=1, max_model_len=32, max_in_flight_tokens=32, enable_caching=True),
    lengths=[24, 24, 24], steps=[(0, 16, False, True), (0, 8, True, True), (1, 4, False, True)],
    events=(True, ("incremental", "full", "incremental")))


def test_a_full_lookup_of_a_host_only_hit_announces_nothing():
    """vLLM announces a reused prefix only for a hit of more than 0 tokens: a lookup in mode "full"
    that finds the prefix on the host alone publishes no BlockStored on either side (and the
    admission after it leaves the hot group without a table on both: kvref used to make one)."""
    seen = run_whole_manager_program(make_vllm=_vllm(), **_HOST_ONLY)
    assert seen["full_source_only_hit"] == 1 and seen["event_BlockStored_cpu"] > 0, dict(seen)


def test_a_full_mode_host_hit_is_announced_on_both_sides():
    seen = run_whole_manager_program(make_vllm=_vllm(), **_FULL_HIT)
    assert seen["full_hit"] == 1 and seen["event_BlockStored_cpu"] > 0, dict(seen)


def _planted(kind: str):
    """vLLM's whole manager with a fault planted in its KV event path: ``"zero_hit"`` announces a
    "full" lookup's blocks also at a 0-token hit (the generated fault gen.kv_cache_manager.313.dec:
    the hit guard ``> 0`` made ``> -1``), ``"never"`` announces no reused prefix at all."""
    base = _vllm()

    class Planted(base):  # type: ignore[misc, valid-type]
        def __init__(self, config, enable_kv_cache_events=False):
            super().__init__(config, enable_kv_cache_events=enable_kv_cache_events)
            mgr = self._mgr
            if kind == "never":
                mgr.coordinator.emit_cached_block_events = lambda request, blocks: None
                return
            lookup = mgr.get_computed_blocks

            def get_computed_blocks(request, *args, **kwargs):
                blocks, num_hit, boundary = lookup(request, *args, **kwargs)
                if num_hit == 0 and mgr.enable_kv_cache_events and request.kv_cache_report_mode == "full":
                    mgr.coordinator.emit_cached_block_events(request, blocks.blocks)
                return blocks, num_hit, boundary

            mgr.get_computed_blocks = get_computed_blocks

    return Planted


@pytest.mark.parametrize("kind, program", [("zero_hit", _HOST_ONLY), ("never", _FULL_HIT)])
def test_a_fault_planted_in_vllms_event_path_is_found(kind, program):
    with pytest.raises(AssertionError, match="after get_computed_blocks: KV cache events kvref"):
        run_whole_manager_program(make_vllm=_planted(kind), **program)


def test_bad_program_arguments_are_refused():
    with pytest.raises(InvalidFieldError, match="events"):
        run_whole_manager_program(make_vllm=_vllm(), **dict(_FULL_HIT, events=(True, ("full",))))
    with pytest.raises(InvalidFieldError, match="events"):
        run_whole_manager_program(make_vllm=_vllm(), **dict(_FULL_HIT, events=("yes", ("full",) * 3)))
    with pytest.raises(InvalidFieldError, match="prompts"):
        run_whole_manager_program(make_vllm=_vllm(), **dict(_FULL_HIT, prompts=("shared", "shared", "mine")))


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
        with pytest.raises(InvalidFieldError, match="report_mode"):
            side.manager_hit("r1", [1, 2, 3], report_mode="everything")
