"""The reference scheduler's multi-module MTP prefill runway (vLLM's ``_reserve_prefill_lookahead``,
issue #28): the rule itself, and the scheduler applying it in its running and waiting loops."""

from __future__ import annotations

import pytest
from kvref.impl.interface import PoolConfig
from kvref.impl.reference.scheduler import Scheduler
from kvref.impl.reference.scheduler_prefill_lookahead import reserve_prefill_lookahead
from kvref.impl.request import Request
from kvref.impl.scheduler_types import EAGLE, ModelOutput, SchedulerConfig
from kvref.spec.errors import InvalidFieldError
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec


def _req(n: int) -> Request:
    return Request("r", list(range(n)), max_tokens=4)


@pytest.mark.parametrize("computed, new, lookahead, expected", [
    (0, 18, 3, 17),   # 2 left < 3: cut so that 3 are left
    (0, 19, 3, 17),   # 1 left: cut to leave 3
    (0, 20, 3, 20),   # the chunk finishes the prefill
    (0, 17, 3, 17),   # 3 left: the whole runway is there
    (18, 1, 3, 0),    # a chunk that cannot leave the runway is cut to nothing
    (0, 19, 1, 19),   # an EAGLE drafter's lookahead of 1 changes nothing
    (0, 19, 0, 19),
])
def test_a_chunk_never_ends_inside_the_runway(computed, new, lookahead, expected):
    assert reserve_prefill_lookahead(lookahead, _req(20), computed, new) == expected


def test_bad_arguments_are_named():
    with pytest.raises(InvalidFieldError, match="request"):
        reserve_prefill_lookahead(3, "r", 0, 4)
    with pytest.raises(InvalidFieldError, match="num_prefill_lookahead"):
        reserve_prefill_lookahead(-1, _req(8), 0, 4)


def _scheduler(lookahead: int) -> Scheduler:
    groups = (KVCacheGroupSpec(("full",), FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8,
                                                            dtype="float16")),)
    cfg = SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4, num_speculative_tokens=3,
                          speculative_method=EAGLE)
    pool = PoolConfig(num_blocks=40, groups=groups, max_model_len=64, scheduler_block_size=4, hash_block_size=4,
                      max_in_flight_tokens=cfg.max_in_flight_tokens, enable_caching=False, use_eagle=True,
                      num_prefill_lookahead=lookahead)
    return Scheduler(pool, cfg)


@pytest.mark.parametrize("prompt, lookahead, chunks", [
    (18, 3, [8, 7, 3]),  # the running loop cuts the second chunk (8 would leave 2)
    (18, 0, [8, 8, 2]),
    (10, 3, [7, 3]),     # the waiting loop cuts the admission (8 would leave 2)
    (10, 0, [8, 2]),
])
def test_the_scheduler_cuts_admission_and_running_chunks(prompt, lookahead, chunks):
    """Prefill chunks of a budget of 8 tokens: with a runway of 3 no chunk ends 1 or 2 tokens
    before the prompt's end, in either loop; without one the last chunk is whatever is left."""
    s = _scheduler(lookahead)
    s.add_request(_req(prompt))
    got = []
    for _ in chunks:
        out = s.schedule()
        got.append(out.scheduled[0].num_scheduled_tokens)
        s.update_from_output(out, ModelOutput({}))
    assert got == chunks
