"""The pool <-> scheduler rules are one rule set for every scheduler, and the road from a runtime
pool back to startup's arguments is one mapping (#26).

``check_scheduler_pool`` is what both the reference ``Scheduler`` and vLLM's adapter
(``VllmScheduler``) call: a broken pool is refused by both with the same field named (the adapter
used to check only the in-flight budget and ran an EAGLE mismatch silently). ``engine_config_for``
is a fixed point of startup planning: the engine arguments it gives for a planned pool plan that
same pool again. About 2 s at CI=true (one vLLM scheduler per refused case, vLLM imported once).
"""

from __future__ import annotations

import dataclasses

import pytest

from kvref.impl.interface import PoolConfig
from kvref.impl.reference.scheduler import Scheduler
from kvref.impl.scheduler_types import EAGLE, SchedulerConfig, check_scheduler_pool, engine_config_for
from kvref.spec import EngineConfig, plan_kv_cache
from kvref.spec.errors import InvalidFieldError
from kvref.spec.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from tests.vllm_env import require_vllm

ATTN = dict(num_kv_heads=1, head_size=4, dtype="float16")

#: a user's layers and engine arguments, as vLLM would get them
USER_SETUPS = {
    "full": ({"l0": FullAttentionSpec(block_size=16, **ATTN), "l1": FullAttentionSpec(block_size=16, **ATTN)},
             EngineConfig(block_size=16, max_model_len=256, max_num_batched_tokens=64, max_num_seqs=4,
                          num_gpu_blocks_override=40)),
    "full+swa async": ({"l0": FullAttentionSpec(block_size=8, **ATTN),
                        "l1": SlidingWindowSpec(block_size=8, sliding_window=24, **ATTN)},
                       EngineConfig(block_size=8, max_model_len=128, max_num_batched_tokens=32, max_num_seqs=3,
                                    max_concurrent_batches=2, num_gpu_blocks_override=60)),
    "full+mamba align": ({"l0": FullAttentionSpec(block_size=16, **ATTN),
                          "m0": MambaSpec(block_size=16, shapes=((2, 8),), dtypes=("float16",),
                                          mamba_cache_mode="align")},
                         EngineConfig(block_size=16, max_model_len=128, max_num_batched_tokens=32, max_num_seqs=2,
                                      mamba_cache_mode="align", num_gpu_blocks_override=30)),
}


def _scheduler_config(engine: EngineConfig, **kw) -> SchedulerConfig:
    return SchedulerConfig(max_num_batched_tokens=engine.max_num_batched_tokens, max_num_seqs=engine.max_num_seqs,
                           async_scheduling=engine.max_concurrent_batches == 2, **kw)


@pytest.mark.parametrize("name", sorted(USER_SETUPS))
def test_engine_config_for_a_planned_pool_plans_that_pool_again(name):
    layers, engine = USER_SETUPS[name]
    pool = PoolConfig.from_plan(plan_kv_cache(layers, engine, 0))
    cfg = _scheduler_config(engine)
    assert cfg.engine_settings() == dict(max_num_batched_tokens=engine.max_num_batched_tokens,
                                         max_num_seqs=engine.max_num_seqs,
                                         max_concurrent_batches=engine.max_concurrent_batches)
    back = engine_config_for(cfg, groups=pool.groups, max_model_len=pool.max_model_len,
                             scheduler_block_size=pool.scheduler_block_size, hash_block_size=pool.hash_block_size,
                             enable_caching=pool.enable_caching, num_blocks=pool.num_blocks)
    layers_again = {name: g.kv_cache_spec for g in pool.groups for name in g.layer_names}
    again = PoolConfig.from_plan(plan_kv_cache(layers_again, back, 0))
    assert again == pool
    assert pool.max_in_flight_tokens == cfg.max_in_flight_tokens  # the scheduler can run on it
    check_scheduler_pool(pool, cfg)


def _broken_cases():
    layers, engine = USER_SETUPS["full"]
    pool = PoolConfig.from_plan(plan_kv_cache(layers, engine, 0))
    cfg = _scheduler_config(engine)
    eagle = dataclasses.replace(cfg, num_speculative_tokens=2, speculative_method=EAGLE)
    return {
        "in-flight budget of another pipeline depth": (pool, dataclasses.replace(cfg, async_scheduling=True),
                                                       "pool.max_in_flight_tokens"),
        "chunk cap above every request": (pool, dataclasses.replace(cfg, long_prefill_token_threshold=257),
                                          "long_prefill_token_threshold"),
        "EAGLE drafter, pool without the block drop": (pool, eagle, "pool.use_eagle"),
        "block drop without an EAGLE drafter": (dataclasses.replace(pool, use_eagle=True), cfg, "pool.use_eagle"),
    }


@pytest.mark.parametrize("case", sorted(_broken_cases()))
def test_the_reference_refuses_a_broken_pool_naming_the_field(case):
    pool, cfg, field = _broken_cases()[case]
    with pytest.raises(InvalidFieldError) as exc:
        Scheduler(pool, cfg)
    assert exc.value.field == field


def test_a_consistent_eagle_pool_passes():
    pool, cfg, _ = _broken_cases()["EAGLE drafter, pool without the block drop"]
    check_scheduler_pool(dataclasses.replace(pool, use_eagle=True), cfg)
    check_scheduler_pool(dataclasses.replace(pool, num_hash_lookahead_tokens=1), cfg)  # hashes cover the token


@pytest.mark.vllm
@pytest.mark.parametrize("case", sorted(_broken_cases()))
def test_vllm_s_adapter_refuses_the_same_pools_with_the_same_field(case):
    require_vllm()
    from kvref.impl.vllm.scheduler import VllmScheduler

    pool, cfg, field = _broken_cases()[case]
    with pytest.raises(InvalidFieldError) as exc:
        VllmScheduler(pool, cfg)
    assert exc.value.field == field


def test_engine_config_for_rejects_bad_fields_by_name():
    cfg = SchedulerConfig()
    layers, engine = USER_SETUPS["full"]
    pool = PoolConfig.from_plan(plan_kv_cache(layers, engine, 0))
    good = dict(groups=pool.groups, max_model_len=64, scheduler_block_size=16, hash_block_size=16,
                enable_caching=True)
    for field, bad in (("groups", ()), ("groups", (1,)), ("max_model_len", 0), ("hash_block_size", "16"),
                       ("enable_caching", 1), ("num_blocks", 0)):
        with pytest.raises(InvalidFieldError) as exc:
            engine_config_for(cfg, **{**good, field: bad})
        assert exc.value.field == field
    with pytest.raises(InvalidFieldError) as exc:
        engine_config_for(object(), **good)
    assert exc.value.field == "config"
