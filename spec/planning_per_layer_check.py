"""vLLM 0.33.0's public per-layer memory check: ``check_enough_kv_cache_memory(vllm_config,
kv_cache_spec, available_memory)`` and ``estimate_max_model_len(vllm_config, kv_cache_spec, ...)``.

Engine startup uses the group-based check (:func:`kvref.spec.pool_sizing.check_enough_kv_cache_memory`);
this older entry point stays public in ``kv_cache_planning`` and sizes differently: the memory one
request needs is the *sum over layers* of each layer's ``max_memory_usage_bytes`` (no group padding,
no page rounding), while the null block is still held back with the bytes per block of the layers'
grouping (vLLM #47272 applied it here too). The estimate binary-searches that per-layer sum up to
``max_model_len``.
"""

from __future__ import annotations

from collections.abc import Mapping

from .config import EngineConfig
from .errors import InvalidFieldError, check_int
from .grouping import validate_layers
from .kv_cache_interface import KVCacheSpec
from .planning_packed import DEFAULT_KV_CACHE_LAYOUT, get_kv_cache_groups_for_layout
from .pool_sizing import no_memory_error, pool_bytes_per_block, too_long_error


def per_layer_memory_bytes(layers: Mapping[str, KVCacheSpec], config: EngineConfig, max_model_len: int) -> int:
    """vLLM's ``max_memory_usage_bytes(vllm_config, specs)``: the layers' bounds summed."""
    layers = validate_layers(layers, allow_empty=True)
    if not isinstance(config, EngineConfig):
        raise InvalidFieldError("config", config, "an EngineConfig")
    check_int("max_model_len", max_model_len, minimum=1)
    return sum(s.max_memory_usage_bytes(config, max_model_len) for s in layers.values())


def estimate_max_model_len_per_layer(layers: Mapping[str, KVCacheSpec], config: EngineConfig,
                                     available_memory: int, max_model_len: int) -> int:
    """The largest length in ``[1, max_model_len]`` whose per-layer sum fits ``available_memory``
    (0 when one token does not fit); vLLM's binary search, same probes."""
    check_int("available_memory", available_memory)
    check_int("max_model_len", max_model_len, minimum=1)
    if per_layer_memory_bytes(layers, config, 1) > available_memory:
        return 0
    left, right, result = 1, max_model_len, 1
    while left <= right:
        mid = (left + right) // 2
        if per_layer_memory_bytes(layers, config, mid) <= available_memory:
            result, left = mid, mid + 1
        else:
            right = mid - 1
    return result


def check_enough_kv_cache_memory_per_layer(layers: Mapping[str, KVCacheSpec], config: EngineConfig,
                                           available_memory: int, *,
                                           kv_cache_layout: str = DEFAULT_KV_CACHE_LAYOUT) -> None:
    """Raise :class:`InsufficientKVCacheError` as vLLM's per-layer ``check_enough_kv_cache_memory``
    does (no layers: nothing to check). ``max_model_len`` is ``config.resolved_max_model_len``."""
    layers = validate_layers(layers, allow_empty=True)
    if not isinstance(config, EngineConfig):
        raise InvalidFieldError("config", config, "an EngineConfig")
    check_int("available_memory", available_memory)
    if not layers:
        return
    # vLLM groups here without its partition check: a packed split that drops layers still sizes
    groups = get_kv_cache_groups_for_layout(layers, config.disable_hybrid_kv_cache_manager, kv_cache_layout,
                                            check_partition=False)
    check_memory = available_memory - pool_bytes_per_block(groups) if groups else available_memory
    max_model_len = config.resolved_max_model_len
    if check_memory <= 0:
        raise no_memory_error(check_memory)
    needed = per_layer_memory_bytes(layers, config, max_model_len)
    if needed <= check_memory:
        return
    estimated = estimate_max_model_len_per_layer(layers, config, check_memory, max_model_len)
    raise too_long_error(max_model_len, needed, check_memory, estimated,
                         "[kvref: per-layer sum, null block held back]")
