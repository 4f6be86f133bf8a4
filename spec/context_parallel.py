"""Decode / prefill context parallelism at runtime (vLLM 0.33.0 ``dcp_world_size``, ``pcp_world_size``).

Under decode context parallelism (DCP) every rank holds a slice of each block's token positions,
so a block of a *DCP-sharded* spec covers ``block_size × dcp_world_size`` tokens as the scheduler
sees them: vLLM's ``SingleTypeKVCacheManager`` scales its ``block_size`` (allocation, caching,
``BlockStored.block_size``) and ``FullAttentionManager.find_longest_cache_hit`` views the request's
hashes at the scaled size. A *replicated* spec (``dcp_sharded=False``: Mamba state, a draft
model's attention that opted out) keeps its own block size, and its manager runs with world sizes
1. Prefill context parallelism (PCP) scales nothing in the KV cache manager; it only narrows which
groups vLLM accepts. The scheduler hands the manager ``dcp_world_size`` from
``parallel_config.decode_context_parallel_size`` and ``pcp_world_size=1``; a ``KVCacheManager``
built directly may get any ``pcp_world_size``.

What vLLM refuses (by assertion), only with prefix caching on:

* several groups (``HybridKVCacheCoordinator``): under DCP every group must be full attention or
  replicated; under PCP every group must be full attention or replicated attention (not Mamba);
* any coordinator: sliding-window, chunked-local and Mamba lookups assert DCP = PCP = 1, with the
  manager's sizes (1 when replicated), except that the one-group coordinator hands them the
  engine's PCP size (they fail at the first lookup; kvref refuses them up front).

With prefix caching off vLLM checks nothing, and the scaled block sizes still shape allocation.
Source: ``vllm/v1/core/single_type_kv_cache_manager.py`` (``__init__``, the managers'
``find_longest_cache_hit``), ``kv_cache_coordinator.py`` (``HybridKVCacheCoordinator.__init__``)
and ``kv_cache_utils.py`` (``resolve_dcp_kv_block_size``, ``partial_hash_hits_enabled``).
"""

from __future__ import annotations

from collections.abc import Sequence

from .errors import InvalidFieldError, check_int, check_sequence
from .kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

#: specs whose vLLM manager asserts DCP = PCP = 1 in ``find_longest_cache_hit``
_LOOKUP_REFUSES_CP = (SlidingWindowSpec, ChunkedLocalAttentionSpec, MambaSpec)


def _check_spec(spec: object) -> None:
    if not isinstance(spec, KVCacheSpec):
        raise InvalidFieldError("kv_cache_spec", spec, "a KVCacheSpec")


def manager_world_sizes(spec: KVCacheSpec, dcp_world_size: int, pcp_world_size: int) -> tuple[int, int]:
    """``(dcp, pcp)`` a group's manager runs with: the engine's sizes for a DCP-sharded spec, ``(1, 1)``
    for a replicated one (vLLM ``SingleTypeKVCacheManager.__init__``)."""
    _check_spec(spec)
    check_int("dcp_world_size", dcp_world_size, minimum=1)
    check_int("pcp_world_size", pcp_world_size, minimum=1)
    return (dcp_world_size, pcp_world_size) if spec.dcp_sharded else (1, 1)


def manager_block_size(spec: KVCacheSpec, dcp_world_size: int) -> int:
    """Tokens per block as the group's manager counts them: ``block_size × DCP`` when sharded
    (vLLM ``resolve_dcp_kv_block_size``)."""
    _check_spec(spec)
    return spec.effective_block_size(dcp_world_size)


def check_context_parallel(specs: Sequence[KVCacheSpec], dcp_world_size: int, pcp_world_size: int,
                           enable_caching: bool) -> None:
    """Refuse the world sizes vLLM's coordinator or a manager's lookup would assert on.

    Args:
        specs: the groups' specs as the coordinator sees them (one layer's spec per group).
        dcp_world_size / pcp_world_size: the engine's context-parallel sizes (>= 1).
        enable_caching: prefix caching on (without it vLLM checks nothing).

    Raises:
        InvalidFieldError: naming ``dcp_world_size`` or ``pcp_world_size`` and the group.
    """
    check_sequence("specs", specs, "a sequence of KVCacheSpec")
    for spec in specs:
        _check_spec(spec)
    check_int("dcp_world_size", dcp_world_size, minimum=1)
    check_int("pcp_world_size", pcp_world_size, minimum=1)
    if not enable_caching or (dcp_world_size == 1 and pcp_world_size == 1):
        return
    for i, spec in enumerate(specs):
        name = type(spec).__name__
        if len(specs) > 1:
            if pcp_world_size > 1 and not (isinstance(spec, FullAttentionSpec)
                                           or (isinstance(spec, AttentionSpec) and not spec.dcp_sharded)):
                raise InvalidFieldError("pcp_world_size", pcp_world_size,
                                        f"1: with prefix caching and several groups PCP supports only full "
                                        f"attention and replicated attention groups (group {i} is {name})")
            if dcp_world_size > 1 and not (isinstance(spec, FullAttentionSpec) or not spec.dcp_sharded):
                raise InvalidFieldError("dcp_world_size", dcp_world_size,
                                        f"1: with prefix caching and several groups DCP supports only full "
                                        f"attention and replicated groups (group {i} is a sharded {name})")
        if not isinstance(spec, _LOOKUP_REFUSES_CP):
            continue
        if spec.dcp_sharded and dcp_world_size > 1:
            raise InvalidFieldError("dcp_world_size", dcp_world_size, f"1: a DCP-sharded {name} group (group "
                                                                       f"{i}) has no DCP prefix-cache lookup in vLLM")
        # the unitary coordinator hands the lookup the engine's PCP size, the hybrid one the manager's
        if pcp_world_size > 1 and (len(specs) == 1 or spec.dcp_sharded):
            raise InvalidFieldError("pcp_world_size", pcp_world_size, f"1: a {name} group (group {i}) has no "
                                                                       "PCP prefix-cache lookup in vLLM")
