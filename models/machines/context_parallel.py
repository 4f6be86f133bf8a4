"""Context-parallel pools for the KV-manager machine (issue #23: DCP/PCP at runtime).

:func:`with_context_parallel` turns a generated pool into the pool a DCP/PCP deployment hands
vLLM's ``KVCacheManager``: ``dcp_world_size`` / ``pcp_world_size`` set, every group vLLM's hybrid
coordinator accepts under them (full attention stays DCP-sharded, unless drawn as a replicated
draft; every other group replicated, as Mamba state always is), and the block sizes re-resolved the
way startup resolves them (``resolve_kv_cache_block_sizes``: the scheduler block is the lcm of the
managers' DCP-scaled blocks; one group hashes at its scaled block). The machine then compares the
reference with vLLM's own classes on these pools after every operation, so the scaled block tables,
hit lengths at the sharded block, fine-grained hits that DCP turns on (a Mamba block equal to the
hash block), copy-on-write and events carrying the scaled ``block_size`` all meet vLLM's code.
"""

from __future__ import annotations

import dataclasses
from math import lcm

from hypothesis import strategies as st

from kvref.impl.interface import PoolConfig
from kvref.spec.context_parallel import check_context_parallel
from kvref.spec.errors import InvalidFieldError
from kvref.spec.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec


@st.composite
def context_parallel_draws(draw) -> tuple[int, int, bool]:
    """``(dcp_world_size, pcp_world_size, replicate_a_draft)``: DCP 2 or 4 in three pools of four,
    PCP 2 one time in four, and sometimes a second full-attention group replicated (a draft model
    that opted out of sharding)."""
    dcp = draw(st.sampled_from((1, 2, 2, 4)))
    pcp = draw(st.sampled_from((1, 1, 1, 2)))
    return dcp, pcp, draw(st.booleans())


def with_context_parallel(pool: PoolConfig, dcp_world_size: int, pcp_world_size: int,
                          replicate_draft: bool = False) -> PoolConfig:
    """``pool`` run under DCP/PCP, with groups and block sizes vLLM accepts there.

    Unchanged when both sizes are 1 or the pool has a chunked-local group (its lookups need the
    group's own block to be the scheduler block, which DCP scaling of another group breaks). PCP is
    dropped (1) where vLLM refuses it (with prefix caching: a Mamba group beside others, a
    sliding-window or Mamba group alone).
    """
    if (dcp_world_size == 1 and pcp_world_size == 1) or any(
            isinstance(g.kv_cache_spec, ChunkedLocalAttentionSpec) for g in pool.groups):
        return pool
    groups, seen_full = [], 0
    for g in pool.groups:
        spec = g.kv_cache_spec
        if isinstance(spec, FullAttentionSpec):
            seen_full += 1
            # a second full-attention group may be a draft that opted out of sharding
            sharded = not (replicate_draft and seen_full == 2)
        else:
            sharded = False  # vLLM's hybrid coordinator accepts only replicated non-full-attention groups
        if spec.dcp_sharded != sharded:
            spec = dataclasses.replace(spec, dcp_sharded=sharded)
        groups.append(dataclasses.replace(g, kv_cache_spec=spec))
    try:
        check_context_parallel([g.kv_cache_spec for g in groups], dcp_world_size, pcp_world_size,
                               pool.enable_caching)
    except InvalidFieldError:  # the groups suit DCP: only PCP can be refused (Mamba, a lone window)
        pcp_world_size = 1
    sizes = [g.kv_cache_spec.effective_block_size(dcp_world_size) for g in groups]
    sbs = lcm(pool.scheduler_block_size, *sizes)
    hbs = sizes[0] if len(groups) == 1 and pool.enable_caching else pool.hash_block_size
    interval = pool.prefix_cache_retention_interval
    if interval is not None:
        interval = interval // pool.scheduler_block_size * sbs
    return dataclasses.replace(pool, groups=tuple(groups), scheduler_block_size=sbs, hash_block_size=hbs,
                               prefix_cache_retention_interval=interval, dcp_world_size=dcp_world_size,
                               pcp_world_size=pcp_world_size)
