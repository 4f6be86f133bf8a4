"""Startup pool sizing: bytes per block, blocks per max-length request, the enough-memory check,
auto-fit of ``max_model_len`` and the max-concurrency report (vLLM 0.33.0 ``kv_cache_planning``).

One number converts memory into blocks everywhere: :func:`pool_bytes_per_block` (vLLM's
``_pool_bytes_per_block``, vLLM #41069). A request of ``max_model_len`` tokens needs
``bytes_per_block × Σ_groups blocks_g`` bytes, where ``blocks_g`` counts whole block ids of group
``g`` (:func:`group_blocks_per_request`); the per-group count of a sliding-window or chunked-local
group is its admission cap, the same number the runtime gate uses (vLLM #40946).

All functions are pure: ``max_model_len`` is an argument, not a config field mutated and restored
as vLLM does during its binary search.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from .errors import InsufficientKVCacheError, InvalidFieldError, check_int
from .kv_cache_interface import KVCacheGroupSpec, KVCacheSpec, UniformTypeKVCacheSpecs
from .mathutil import cdiv

if TYPE_CHECKING:  # pragma: no cover
    from .config import EngineConfig

GiB = 1 << 30
CONSERVING_MEMORY_URL = "https://docs.vllm.ai/en/latest/configuration/conserving_memory/"


def check_config(config: object) -> None:
    """``config`` must be an :class:`~kvref.spec.config.EngineConfig` (a wrong object used to fail
    as ``AttributeError`` deep inside a formula)."""
    from .config import EngineConfig

    if not isinstance(config, EngineConfig):
        raise InvalidFieldError("config", config, "an EngineConfig")


def format_gib(num_bytes: int) -> str:
    """vLLM's ``format_gib``: GiB rounded to 2 decimals."""
    check_int("num_bytes", num_bytes)
    return f"{round(num_bytes / GiB, 2)}"


def no_memory_error(check_memory: int, note: str = "") -> InsufficientKVCacheError:
    """vLLM's startup failure when no block is left once the null block is held back (its message,
    then kvref's ``note``). One text for the group-based and the per-layer check (#26)."""
    return InsufficientKVCacheError(
        "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
        "initializing the engine (this flag also controls CPU memory reservation on the CPU backend, "
        f"despite its name). See {CONSERVING_MEMORY_URL} for more details." + (f" {note}" if note else ""),
        estimated_max_model_len=0, needed_bytes=0, available_bytes=check_memory,
        reason=InsufficientKVCacheError.NO_MEMORY)


def too_long_error(max_model_len: int, needed: int, check_memory: int, estimated: int,
                   note: str = "") -> InsufficientKVCacheError:
    """vLLM's startup failure when one request of ``max_model_len`` tokens needs ``needed`` bytes,
    more than ``check_memory`` (its message with the estimate when one token fits, then kvref's
    ``note``). One text for the group-based and the per-layer check (#26)."""
    estimated_msg = (f"Based on the available memory, the estimated maximum model length is {estimated}. "
                     if estimated > 0 else "")
    return InsufficientKVCacheError(
        f"To serve at least one request with the model's max seq len ({max_model_len}), "
        f"({format_gib(needed)} GiB KV cache is needed, which is larger than the available KV cache memory "
        f"({format_gib(check_memory)} GiB). {estimated_msg}Try increasing `gpu_memory_utilization` (which also "
        "controls CPU memory on the CPU backend) or decreasing `max_model_len` when initializing the engine. "
        f"See {CONSERVING_MEMORY_URL} for more details." + (f" {note}" if note else ""),
        estimated_max_model_len=estimated, needed_bytes=needed, available_bytes=check_memory,
        reason=InsufficientKVCacheError.TOO_LONG)


def validate_groups(groups: object) -> "list[KVCacheGroupSpec]":
    """``groups`` as a list after checking every item is a :class:`KVCacheGroupSpec`."""
    if isinstance(groups, (str, bytes, Mapping)) or not isinstance(groups, Iterable):
        raise InvalidFieldError("groups", groups, "a sequence of KVCacheGroupSpec")
    groups = list(groups)
    for i, g in enumerate(groups):
        if not isinstance(g, KVCacheGroupSpec):
            raise InvalidFieldError(f"groups[{i}]", g, "a KVCacheGroupSpec")
        spec = g.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs) and set(g.layer_names) - set(spec.kv_cache_specs):
            raise InvalidFieldError(f"groups[{i}].layer_names", g.layer_names,
                                    "names of the layers in its UniformTypeKVCacheSpecs")
    return groups


def layer_spec(group: KVCacheGroupSpec, layer_name: str) -> KVCacheSpec:
    """The spec of one layer of a group (its own one inside a :class:`UniformTypeKVCacheSpecs`)."""
    if not isinstance(group, KVCacheGroupSpec):
        raise InvalidFieldError("group", group, "a KVCacheGroupSpec")
    if not isinstance(layer_name, str) or layer_name not in group.layer_names:
        raise InvalidFieldError("layer_name", layer_name, f"one of the group's layers {list(group.layer_names)}")
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec.kv_cache_specs[layer_name]
    return spec


def pool_bytes_per_block(groups: Iterable[KVCacheGroupSpec]) -> int:
    """Bytes one block id takes in the shared pool: the largest group's sum of layer pages.

    Every group aliases the same backing memory, one page per layer of the group per block, so a
    block id costs the widest group's pages; shorter (padded) groups waste the rest. This is the
    divisor of ``num_blocks = memory // bytes_per_block`` and of the override conversion
    (vLLM #41069). Layer-outermost layout (vLLM's default ``LBNHC``), no stride
    alignment.
    """
    groups = validate_groups(groups)
    if not groups:
        return 0
    return max(sum(layer_spec(g, n).page_size_bytes for n in g.layer_names) for g in groups)


def group_blocks_per_request(spec: KVCacheSpec, config: "EngineConfig", max_model_len: int) -> int:
    """Block ids one request of ``max_model_len`` tokens may hold at once in a group with ``spec``.

    ``cdiv(max_memory_usage_bytes, page_size_bytes)``; for a uniform-type group the largest count
    among its layers. For sliding-window / chunked-local specs this equals
    ``max_admission_blocks_per_request(max_in_flight_tokens, max_model_len)``.
    """
    if not isinstance(spec, KVCacheSpec):
        raise InvalidFieldError("spec", spec, "a KVCacheSpec")
    check_config(config)
    check_int("max_model_len", max_model_len, minimum=0)
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec.max_memory_usage_pages(config, max_model_len)
    return cdiv(spec.max_memory_usage_bytes(config, max_model_len), spec.page_size_bytes)


def needed_bytes_for(groups: "tuple[KVCacheGroupSpec, ...]", config: "EngineConfig", max_model_len: int) -> int:
    """Bytes one request of ``max_model_len`` tokens needs: ``bytes_per_block × Σ_g blocks_g``
    (vLLM's ``_max_memory_usage_bytes_from_groups``; charges group padding correctly)."""
    groups = validate_groups(groups)
    check_config(config)
    check_int("max_model_len", max_model_len, minimum=0)
    if not groups:
        return 0
    total = sum(group_blocks_per_request(g.kv_cache_spec, config, max_model_len) for g in groups)
    return pool_bytes_per_block(groups) * total


def estimate_max_model_len(groups: "tuple[KVCacheGroupSpec, ...]", config: "EngineConfig",
                           available_memory: int, upper: int) -> int:
    """Largest ``L`` in ``[1, upper]`` whose request fits in ``available_memory``; 0 if ``L = 1``
    does not fit. Binary search, as vLLM's ``_estimate_max_model_len_from_groups`` (the need is
    monotone in ``L``, so the answer is the same as a linear scan)."""
    groups = validate_groups(groups)
    check_config(config)
    check_int("available_memory", available_memory)
    check_int("upper", upper, minimum=0)
    def fits(length: int) -> bool:
        return needed_bytes_for(groups, config, length) <= available_memory

    if not fits(1):
        return 0
    left, right, result = 1, upper, 1
    while left <= right:
        mid = (left + right) // 2
        if fits(mid):
            result, left = mid, mid + 1
        else:
            right = mid - 1
    return result


def check_enough_kv_cache_memory(groups: "tuple[KVCacheGroupSpec, ...]", config: "EngineConfig",
                                 check_memory: int, max_model_len: int) -> None:
    """Raise :class:`InsufficientKVCacheError` unless one request of ``max_model_len`` tokens fits.

    ``check_memory`` is the pool memory minus the null block (vLLM #47272: BlockPool withholds
    block 0 for good). Same order and texts as vLLM's ``_check_enough_kv_cache_memory``, plus the
    block arithmetic behind them.
    """
    groups = validate_groups(groups)
    check_config(config)
    check_int("check_memory", check_memory)
    check_int("max_model_len", max_model_len, minimum=0)
    bpb = pool_bytes_per_block(groups)
    if check_memory <= 0:
        raise no_memory_error(
            check_memory, f"[kvref: {max(check_memory + bpb, 0)} bytes hold {max(check_memory + bpb, 0) // bpb} "
            f"block(s) of {bpb} bytes; block 0 is the null block, so no block is usable.]")
    needed = needed_bytes_for(groups, config, max_model_len)
    if needed <= check_memory:
        return
    estimated = estimate_max_model_len(groups, config, check_memory, max_model_len)
    per_group = [group_blocks_per_request(g.kv_cache_spec, config, max_model_len) for g in groups]
    raise too_long_error(
        max_model_len, needed, check_memory, estimated,
        f"[kvref: one request needs {sum(per_group)} blocks (per group {per_group}) of {bpb} bytes = {needed} "
        f"bytes; the pool has {check_memory // bpb} usable blocks ({check_memory} bytes after holding back "
        "the null block).]")


def auto_fit_max_model_len(groups: "tuple[KVCacheGroupSpec, ...]", config: "EngineConfig",
                           check_memory: int, original_max_model_len: int) -> int:
    """``max_model_len = -1``/``auto``: the largest length up to the model's own that fits.

    Searches with ``check_memory`` (null block already held back, vLLM #48724), so memory for
    exactly 64 blocks auto-fits to ``63 × block_size`` for a one-layer full-attention model.
    """
    groups = validate_groups(groups)
    check_config(config)
    check_int("check_memory", check_memory)
    check_int("original_max_model_len", original_max_model_len, minimum=0)
    fitted = estimate_max_model_len(groups, config, check_memory, original_max_model_len)
    if fitted <= 0:
        raise InsufficientKVCacheError(
            "Cannot auto-fit max_model_len: not enough GPU memory available to serve even a single token. "
            "Try increasing `gpu_memory_utilization`. "
            f"[kvref: {check_memory} bytes after the null block; one token needs "
            f"{needed_bytes_for(groups, config, 1)} bytes.]",
            estimated_max_model_len=0, needed_bytes=needed_bytes_for(groups, config, 1),
            available_bytes=check_memory, reason=InsufficientKVCacheError.AUTO_FIT_FAILED)
    return min(fitted, original_max_model_len)


def max_concurrency(scheduler_groups: "tuple[KVCacheGroupSpec, ...]", config: "EngineConfig",
                    max_model_len: int, num_blocks: int) -> float:
    """Requests of ``max_model_len`` tokens the pool holds at once (vLLM's
    ``get_max_concurrency_for_kv_cache_config``).

    NOTE: vLLM divides ``num_blocks`` *including* the null block, so the figure is slightly
    optimistic; kvref reports the same number. Infinite when a request needs no block.
    """
    scheduler_groups = validate_groups(scheduler_groups)
    check_config(config)
    check_int("max_model_len", max_model_len, minimum=0)
    check_int("num_blocks", num_blocks)
    per_request = sum(cdiv(g.kv_cache_spec.max_memory_usage_bytes(config, max_model_len),
                           g.kv_cache_spec.page_size_bytes) for g in scheduler_groups)
    if per_request == 0:
        return float("inf")
    return num_blocks / per_request
