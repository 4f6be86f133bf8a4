"""``scheduler_block_size`` and ``hash_block_size`` (vLLM 0.33.0 ``resolve_kv_cache_block_sizes``).

The scheduler rounds token counts to ``scheduler_block_size``; request block hashes are computed
every ``hash_block_size`` tokens. Both are resolved once at startup and threaded through the
scheduler, the KV cache manager, the coordinator and every single-type manager (
vLLM #44165), which assert ``scheduler_block_size % hash_block_size == 0`` and
``scheduler_block_size % group_block_size == 0`` for every group. Resolution here guarantees both
(scheduler size = lcm of group sizes, hash size divides every prefix-cacheable group's size) or
rejects the configuration with :class:`~kvref.spec.errors.InvalidFieldError`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from .errors import InvalidFieldError, check_int
from .kv_cache_interface import KVCacheGroupSpec, KVCacheSpec, MambaSpec, UniformTypeKVCacheSpecs

if TYPE_CHECKING:  # pragma: no cover
    from .config import EngineConfig


def group_block_size(group: KVCacheGroupSpec, dcp_world_size: int) -> int:
    """Tokens per block of a group as its manager sees them: ``block_size × DCP`` when sharded."""
    if not isinstance(group, KVCacheGroupSpec):
        raise InvalidFieldError("group", group, "a KVCacheGroupSpec")
    check_int("dcp_world_size", dcp_world_size, minimum=1)
    return group.kv_cache_spec.effective_block_size(dcp_world_size)


def resolve_dcp_kv_cache_spec(spec: KVCacheSpec, dcp_world_size: int) -> KVCacheSpec:
    """``spec`` with its block size scaled to the tokens one block spans under DCP (vLLM
    ``resolve_dcp_kv_cache_spec``): a DCP-sharded spec's block covers ``block_size × dcp_world_size``
    tokens; a replicated one, or DCP 1, is returned unchanged; a uniform-type spec is scaled with
    every layer spec inside it. What a connector keying blocks by tokens (the Mooncake store) sees."""
    if not isinstance(spec, KVCacheSpec):
        raise InvalidFieldError("spec", spec, "a KVCacheSpec")
    check_int("dcp_world_size", dcp_world_size, minimum=1)
    block_size = spec.effective_block_size(dcp_world_size)
    if block_size == spec.block_size:
        return spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return dataclasses.replace(spec, block_size=block_size, kv_cache_specs={
            name: resolve_dcp_kv_cache_spec(layer, dcp_world_size) for name, layer in spec.kv_cache_specs.items()})
    return dataclasses.replace(spec, block_size=block_size)


def _layer_specs(group: KVCacheGroupSpec):
    spec = group.kv_cache_spec
    return spec.kv_cache_specs.values() if isinstance(spec, UniformTypeKVCacheSpecs) else (spec,)


def cache_block_size(groups: "tuple[KVCacheGroupSpec, ...]") -> int:
    """``cache_config.block_size`` after startup: the smallest block size among prefix-cacheable
    groups (all groups when none is), as the engine core sets it before resolving."""
    from .pool_sizing import validate_groups

    groups = tuple(validate_groups(groups))
    cacheable = [g.kv_cache_spec.block_size for g in groups if g.kv_cache_spec.prefix_cacheable]
    return min(cacheable or [g.kv_cache_spec.block_size for g in groups])


def resolve_kv_cache_block_sizes(groups: "tuple[KVCacheGroupSpec, ...]", config: "EngineConfig") -> tuple[int, int]:
    """Return ``(scheduler_block_size, hash_block_size)`` for the scheduler-side groups.

    * One group: ``block_size × DCP`` (DCP only when the group is sharded) for both; an explicit
      ``prefix_match_unit`` other than that is rejected while prefix caching or a connector is on.
    * Several groups: the scheduler size is the lcm of the group sizes. The hash size equals it
      when nothing hashes (no prefix caching, no connector) or a Mamba group is not in ``align``
      mode; otherwise it is ``prefix_match_unit`` or the gcd of the prefix-cacheable group sizes,
      and every prefix-cacheable group size must be a multiple of it.
    """
    from .config import EngineConfig
    from .pool_sizing import validate_groups

    if not isinstance(config, EngineConfig):
        raise InvalidFieldError("config", config, "an EngineConfig")
    groups = tuple(validate_groups(groups))
    dcp = config.dcp_world_size
    hashing = config.enable_prefix_caching or config.has_kv_connector
    if len(groups) <= 1:
        if groups and not groups[0].kv_cache_spec.dcp_sharded:
            dcp = 1
        bs = (cache_block_size(groups) if groups else config.block_size) * dcp
        if config.prefix_match_unit not in (None, bs) and len(groups) == 1 and hashing:
            raise InvalidFieldError(
                "prefix_match_unit", config.prefix_match_unit,
                f"None or {bs}: with a single KV cache group, prefix-cache hits land on the block size ({bs})")
        return bs, bs
    sizes = [group_block_size(g, dcp) for g in groups]
    scheduler_block_size = math.lcm(*sizes)
    if not hashing:
        return scheduler_block_size, scheduler_block_size
    if any(isinstance(s, MambaSpec) and s.mamba_cache_mode != "align" for g in groups for s in _layer_specs(g)):
        return scheduler_block_size, scheduler_block_size
    hashing_sizes = [bs for g, bs in zip(groups, sizes) if g.kv_cache_spec.prefix_cacheable] or sizes
    hash_block_size = config.prefix_match_unit if config.prefix_match_unit is not None else math.gcd(*hashing_sizes)
    if any(bs % hash_block_size for bs in hashing_sizes):
        raise InvalidFieldError(
            "prefix_match_unit", hash_block_size,
            f"a divisor of every prefix-cacheable KV cache group block size (group block sizes {sizes}, "
            f"prefix-cacheable {hashing_sizes})")
    return scheduler_block_size, hash_block_size


#: vLLM 0.33.0 managers that can match prefix-cache hits at ``hash_block_size`` granularity inside
#: a larger block (``supports_fine_grained_hash_lookup``)
_FINE_GRAINED_MANAGERS = frozenset({"FullAttentionManager", "MambaManager"})


def partial_hash_hits_enabled(groups: "tuple[KVCacheGroupSpec, ...]", hash_block_size: int,
                              dcp_world_size: int = 1) -> bool:
    """Whether aligned Mamba states allow prefix-cache hits finer than a block (vLLM's
    ``partial_hash_hits_enabled`` with the managers' capabilities): a Mamba ``align`` layer whose
    block is larger than the hash block (or as large, with DCP), and every other prefix-cacheable
    group either fine-grained or hashed at its own block size."""
    from .pool_sizing import validate_groups

    groups = tuple(validate_groups(groups))
    check_int("hash_block_size", hash_block_size, minimum=1)
    check_int("dcp_world_size", dcp_world_size, minimum=1)
    if not any(isinstance(s, MambaSpec) and s.mamba_cache_mode == "align"
               and ((dcp_world_size == 1 and s.block_size > hash_block_size)
                    or (dcp_world_size > 1 and s.block_size >= hash_block_size))
               for g in groups for s in _layer_specs(g)):
        return False
    return all(not g.kv_cache_spec.prefix_cacheable or g.kv_cache_spec.manager_name in _FINE_GRAINED_MANAGERS
               or group_block_size(g, dcp_world_size) == hash_block_size for g in groups)


def resolve_cache_hit_alignment_tokens(groups: "tuple[KVCacheGroupSpec, ...]", config: "EngineConfig",
                                       scheduler_block_size: int, hash_block_size: int) -> int:
    """Token granularity at which prefix-cache hits land: ``hash_block_size`` when partial hash
    hits are enabled, else ``scheduler_block_size`` (vLLM's ``resolve_cache_hit_alignment_tokens``)."""
    from .pool_sizing import check_config, validate_groups

    groups = tuple(validate_groups(groups))
    check_config(config)
    check_int("scheduler_block_size", scheduler_block_size, minimum=1)
    check_int("hash_block_size", hash_block_size, minimum=1)
    if not config.enable_prefix_caching or len(groups) <= 1:
        return scheduler_block_size
    if partial_hash_hits_enabled(groups, hash_block_size, config.dcp_world_size):
        return hash_block_size
    return scheduler_block_size
