"""The KV-cache pool strategy (``kvref.models.strategies.pools.pool_configs``) goes through startup
where startup builds the drawn pool (#26): its block sizes are the ones
``resolve_kv_cache_block_sizes`` gives, a pool ``plan_kv_cache`` builds exactly as drawn comes from
``PoolConfig.from_plan``, and every other one says through ``PoolConfig.off_plan`` what startup
would not do. About 2 s at CI=true."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, Phase, find, given, settings

from kvref.impl.interface import PoolConfig
from kvref.models.strategies.pools import GROUP_SETS, pool_configs
from kvref.spec import EngineConfig, plan_kv_cache
from kvref.spec.kv_cache_interface import MambaSpec
from tests.conftest import profile_examples


def _replanned(pool: PoolConfig) -> PoolConfig:
    align = any(isinstance(g.kv_cache_spec, MambaSpec) and g.kv_cache_spec.mamba_cache_mode == "align"
                for g in pool.groups)
    engine = EngineConfig(max_model_len=pool.max_model_len, max_num_batched_tokens=pool.max_in_flight_tokens,
                          num_gpu_blocks_override=pool.num_blocks, enable_prefix_caching=pool.enable_caching,
                          mamba_cache_mode="align" if align else "none",
                          prefix_match_unit=pool.hash_block_size if len(pool.groups) > 1 and pool.enable_caching
                          else None)
    plan = plan_kv_cache({g.layer_names[0]: g.kv_cache_spec for g in pool.groups}, engine, 0)
    return PoolConfig.from_plan(plan, watermark=pool.watermark, use_eagle=pool.use_eagle)


@settings(max_examples=profile_examples(60, 150), deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(pool_configs(retention=True))
def test_a_pool_is_planned_or_says_why_not(pool):
    lcm = math.lcm(*(g.kv_cache_spec.block_size for g in pool.groups))
    if pool.origin == "plan":
        assert pool == _replanned(pool), "a pool from the plan door differs from what startup plans for it"
        assert pool.scheduler_block_size == lcm
    else:
        assert pool.origin.startswith("off-plan: generated pools aim at admission edges startup never sizes: ")
        why = pool.origin.split(": ", 2)[2]
        assert why, pool.origin
        # the grid startup never resolves is named, never passed off as planned
        if pool.scheduler_block_size != lcm:
            assert pool.scheduler_block_size == 2 * lcm and "twice startup's lcm" in why, pool.origin
        if pool.max_in_flight_tokens is None:
            assert "no scheduler behind it" in why, pool.origin


#: the first pool found is enough (shrinking it costs seconds and proves nothing more)
_FIND = settings(max_examples=500, database=None, suppress_health_check=list(HealthCheck), phases=[Phase.generate])


def test_the_plan_door_is_reached_and_the_coarser_grid_stays_off_plan():
    planned = find(pool_configs(group_sets=GROUP_SETS), lambda p: p.origin == "plan",
                   settings=_FIND)
    assert planned.num_blocks >= 2 and planned.max_in_flight_tokens is not None
    doubled = find(pool_configs(group_sets=("fa+swa",)),
                   lambda p: p.scheduler_block_size > math.lcm(*(g.kv_cache_spec.block_size for g in p.groups)),
                   settings=_FIND)
    assert doubled.origin.startswith("off-plan:") and "twice startup's lcm" in doubled.origin
