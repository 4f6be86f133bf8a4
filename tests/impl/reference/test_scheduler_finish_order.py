"""The order in which the reference frees requests that vLLM walks as a ``set`` (#28): check-run's
replay hands over the recorded order (``Scheduler.finish_order_hint``), since the recording
process's string-hash order cannot be reproduced in the checking one; without a hint the
reference walks its own set, as vLLM does beside it."""

from __future__ import annotations

import pytest

from kvref.impl.interface import PoolConfig
from kvref.impl.reference.scheduler import Scheduler
from kvref.impl.request import Request
from kvref.impl.scheduler_types import SchedulerConfig
from kvref.models.machines.scheduler import _attn
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

IDS = ("req-a", "req-b", "req-c")


def _scheduler_holding_three():
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4)
    pool = PoolConfig.off_plan("three short requests whose frees are ordered", num_blocks=20,
                               groups=(KVCacheGroupSpec(("full",), _attn(FullAttentionSpec, 4)),), max_model_len=32,
                               scheduler_block_size=4, hash_block_size=4,
                               max_in_flight_tokens=cfg.max_in_flight_tokens, enable_caching=True)
    s = Scheduler(pool, cfg)
    for i, rid in enumerate(IDS):
        s.add_request(Request(rid, [10 * i + t for t in range(8)], max_tokens=4))
    s.schedule()
    freed: list[str] = []
    inner = s._free_request
    s._free_request = lambda r: (freed.append(r.request_id), inner(r))[1]
    return s, freed


@pytest.mark.parametrize("hint", [IDS, IDS[::-1], ("req-b", "req-c", "req-a")])
def test_encoder_mismatch_errors_are_freed_in_the_replayed_order(hint):
    s, freed = _scheduler_holding_three()
    s.finish_order_hint = hint
    s.encoder.encoder_cache_mismatch_reqs.update(IDS)
    s._finish_encoder_mismatches()
    assert freed == list(hint)
    assert not s.requests and not s.encoder.encoder_cache_mismatch_reqs
    s.check_invariants()


def test_without_a_hint_the_reference_walks_its_own_set_and_ids_missing_from_a_hint_come_last():
    s, freed = _scheduler_holding_three()
    s.encoder.encoder_cache_mismatch_reqs.update(IDS)
    s._finish_encoder_mismatches()
    assert freed == list(set(IDS))
    s, freed = _scheduler_holding_three()
    s.finish_order_hint = ("req-c",)
    s.encoder.encoder_cache_mismatch_reqs.update(IDS)
    s._finish_encoder_mismatches()
    assert freed[0] == "req-c" and sorted(freed) == sorted(IDS)
