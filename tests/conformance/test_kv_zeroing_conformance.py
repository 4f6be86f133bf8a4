"""KV zeroing records against vLLM 0.33.0's own ``KVCacheManager`` (issue #23): which new blocks are
recorded for the worker to zero (``take_new_block_ids``), the copy-on-write target, the groups an
async load writes (``skip_zeroing_group_ids``) and the re-recording after a failed load
(``record_blocks_for_zeroing``), by hand and on generated traces compared op by op."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from kvref.impl.interface import PoolConfig, make_manager
from kvref.impl.request import Request
from kvref.models.machines.kv_cache_manager import kv_cache_manager_machine
from kvref.spec.errors import InvalidFieldError
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec, SlidingWindowSpec
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


def _fa(dtype: str = "float32") -> FullAttentionSpec:
    return FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype=dtype)


def _pool(*specs, num_blocks: int = 30) -> PoolConfig:
    caching = not any(isinstance(s, MambaSpec) for s in specs)  # Mamba "none" runs without prefix caching
    return PoolConfig(num_blocks=num_blocks, groups=tuple(KVCacheGroupSpec((f"l{i}",), s) for i, s in enumerate(specs)),
                      max_model_len=64, scheduler_block_size=4, hash_block_size=4, enable_caching=caching)


def _both(pool: PoolConfig):
    require_vllm()
    return make_manager("reference", pool), make_manager("vllm", pool)


MAMBA = MambaSpec(block_size=4, shapes=((2, 3),), dtypes=("float16",))


@pytest.mark.parametrize("specs, zeroes", [
    ((_fa(), _fa()), False),                                   # one precision: nothing to zero
    ((_fa("float16"), _fa("float32")), True),                  # mixed precisions
    ((_fa(), SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="bfloat16",
                               sliding_window=4)), True),
    ((_fa(), MAMBA), True),                                    # Mamba layers: attention blocks only
])
def test_new_blocks_recorded_like_vllm(specs, zeroes):
    pool = _pool(*specs)
    ref, vllm = _both(pool)
    out = []
    for m in (ref, vllm):
        r = Request("r0", list(range(10)), max_tokens=4)
        ids = m.allocate_slots(r, 10)
        out.append((ids, m.take_new_block_ids(), m.take_new_block_ids()))
    assert out[0] == out[1]
    ids, taken, again = out[0]
    assert again == []  # drained
    attention = [b for g, s in zip(ids, specs) if not isinstance(s, MambaSpec) for b in g]
    assert taken == (attention if zeroes else [])


def test_async_load_groups_skip_zeroing_and_a_failed_load_rerecords_like_vllm():
    """An async load writes its blocks later: they are not recorded at allocation; when the load
    fails with 4 valid tokens, the blocks from token 4 on are recorded again (vLLM's
    ``_update_waiting_for_remote_kv``)."""
    pool = _pool(_fa("float16"), _fa("float32"))
    ref, vllm = _both(pool)
    out = []
    for m in (ref, vllm):
        r = Request("r0", list(range(13)), max_tokens=4)
        m.allocate_slots(r, 0, num_external_computed_tokens=12, delay_cache_blocks=True,
                         skip_zeroing_group_ids=(0,))
        first = m.take_new_block_ids()  # group 1 recorded, group 0 (loaded) skipped
        r.num_computed_tokens = 4
        m.record_blocks_for_zeroing("r0", 4)
        out.append((first, m.take_new_block_ids(), m.get_block_ids("r0")))
    assert out[0] == out[1]
    first, again, (g0, g1) = out[0]
    assert first == list(g1)
    assert again == list(g0[1:]) + list(g1[1:])


def test_record_blocks_for_zeroing_rejects_an_unaligned_start_and_changes_nothing():
    ref = make_manager("reference", _pool(_fa("float16"), _fa("float32")))
    r = Request("r0", list(range(9)), max_tokens=4)
    ref.allocate_slots(r, 9)
    ref.take_new_block_ids()
    with pytest.raises(InvalidFieldError, match="start_token"):
        ref.record_blocks_for_zeroing("r0", 3)
    with pytest.raises(InvalidFieldError, match="request_id"):
        ref.record_blocks_for_zeroing("nobody", 0)
    with pytest.raises(InvalidFieldError, match="skip_zeroing_group_ids"):
        ref.allocate_slots(Request("r1", [1, 2], max_tokens=1), 2, skip_zeroing_group_ids=(5,))
    assert ref.take_new_block_ids() == []


def test_generated_traces_compare_zeroing_records_with_vllm():
    """Derandomized (the reach assertions must not flake): mixed-precision and Mamba pools with
    async loads, some failing with a valid prefix; every op's zeroing records compared."""
    require_vllm()
    machine = kv_cache_manager_machine(("reference", "vllm"), group_sets=("fa+swa", "fa+fa", "fa+mamba",
                                                                          "fa+swa+swa"))
    run_state_machine_as_test(machine, settings=settings(max_examples=profile_examples(40, 100), derandomize=True,
                                                         database=None, stateful_step_count=40, deadline=None))
    assert machine.stats.zeroed_blocks > 0
    assert machine.stats.failed_loads > 0
