"""Which newly allocated KV blocks the worker must zero (vLLM 0.33.0 ``KVCacheConfig``).

A block handed out by the pool still holds whatever its last owner wrote. Two kinds of cache read
bytes before writing them: Mamba layers read their state before it is fully written (vLLM #35219),
and a cache mixing precisions can hand a block freed by one group to a group of another precision,
which then decodes the stale bytes as NaN/Inf. For those caches (``needs_kv_cache_zeroing``) the
scheduler-side managers record the ids of new attention blocks, the scheduler drains them every
step (``KVCacheManager.take_new_block_ids``) and sends them in ``SchedulerOutput.
new_block_ids_to_zero``; uniform-precision attention-only caches skip the work.

Pure functions over group specs; the recording itself is in the reference's single-type managers.
"""

from __future__ import annotations

from collections.abc import Sequence

from .errors import InvalidFieldError
from .kv_cache_interface import (
    AttentionSpec,
    CircularBufferSpec,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    UniformTypeKVCacheSpecs,
)


def iter_layer_specs(kv_cache_spec: KVCacheSpec) -> tuple[KVCacheSpec, ...]:
    """The per-layer specs a group's spec covers (a UniformType group keeps one per layer)."""
    if isinstance(kv_cache_spec, UniformTypeKVCacheSpecs):
        return tuple(kv_cache_spec.kv_cache_specs.values())
    if not isinstance(kv_cache_spec, KVCacheSpec):
        raise InvalidFieldError("kv_cache_spec", kv_cache_spec, "a KVCacheSpec")
    return (kv_cache_spec,)


def _groups(groups: Sequence[KVCacheGroupSpec]) -> tuple[KVCacheGroupSpec, ...]:
    if not isinstance(groups, (tuple, list)):
        raise InvalidFieldError("groups", groups, "a sequence of KVCacheGroupSpec")
    for i, g in enumerate(groups):
        if not isinstance(g, KVCacheGroupSpec):
            raise InvalidFieldError(f"groups[{i}]", g, "a KVCacheGroupSpec")
    return tuple(groups)


def has_mamba_layers(groups: Sequence[KVCacheGroupSpec]) -> bool:
    """Some layer of some group is a Mamba (linear-attention state) layer."""
    return any(isinstance(s, MambaSpec) for g in _groups(groups) for s in iter_layer_specs(g.kv_cache_spec))


def has_mixed_precision_kv_cache(groups: Sequence[KVCacheGroupSpec]) -> bool:
    """The attention layers use more than one cache dtype.

    vLLM keys precision by ``(dtype, kv_quant_mode)``; kvref's specs carry no quantization mode
    (vLLM's default ``KVQuantMode.NONE`` for every layer), so the dtype decides. vLLM also skips
    host-resident (HiSparse) groups, which kvref does not model.
    """
    dtypes = {s.dtype for g in _groups(groups) for s in iter_layer_specs(g.kv_cache_spec)
              if isinstance(s, AttentionSpec)}
    return len(dtypes) > 1


def needs_kv_cache_zeroing(groups: Sequence[KVCacheGroupSpec]) -> bool:
    """vLLM's ``KVCacheConfig.needs_kv_cache_zeroing``: Mamba layers or mixed precisions."""
    return has_mamba_layers(groups) or has_mixed_precision_kv_cache(groups)


def records_new_block_ids(kv_cache_spec: KVCacheSpec, needs_zeroing: bool) -> bool:
    """Whether a group's manager records its new blocks for zeroing: only when the cache needs
    zeroing, and only attention groups other than the circular buffer (its single ring block is
    written before it is read). ``kv_cache_spec`` is the scheduler's view of the group (vLLM's
    ``generate_scheduler_kv_cache_config`` replaces a UniformType wrapper by its first layer)."""
    if not isinstance(needs_zeroing, bool):
        raise InvalidFieldError("needs_zeroing", needs_zeroing, "True or False")
    if not isinstance(kv_cache_spec, KVCacheSpec):
        raise InvalidFieldError("kv_cache_spec", kv_cache_spec, "a KVCacheSpec")
    return (needs_zeroing and isinstance(kv_cache_spec, AttentionSpec)
            and not isinstance(kv_cache_spec, CircularBufferSpec))
