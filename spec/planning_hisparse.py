"""HiSparse startup sizing: the device pool, the host pool, their tensors and both concurrency figures.

vLLM 0.33.0 sizes a HiSparse model's KV cache in ``v1/hisparse/layout.py`` (``get_hisparse_kv_cache_config``,
``_build_hisparse_kv_cache_tensors``, ``get_hisparse_steady_state_concurrency``), reached from
``get_kv_cache_configs`` (the HiSparse branches of ``_pool_bytes_per_block_from_builder``,
``_estimate_max_model_len_from_groups.fits`` and auto-fit) and ``update_kv_cache_capacity``
(kvref issues #22/#23). The device groups (indexer, resident, hot) share one GPU pool; the sparse
source layers live in a separate host pool whose size is ``host_pool_gib`` of the HiSparseConnector.
So a request is bounded twice: by the GPU blocks its device groups need at admission and by the host
blocks its source pages need; the engine reports the smaller figure.

Rules, in vLLM's order:

1. bytes per device block: the widest device group's summed pages, rounded up (block-outermost
   layouts) to every hot page, so a hot page never straddles a block;
2. ``num_gpu_blocks_override`` replaces the memory by ``override × bytes_per_block``; one block is
   the null block, held back in the check and in auto-fit;
3. a length fits when the device groups' blocks fit the memory *and* the HiSparse config can be
   built at that length (the host pool holds ``cdiv(len, block_size) + 2`` blocks, the connector
   names a host pool, the layout can express the pool); auto-fit and the "estimated maximum model
   length" use that test, the enough-memory check only the device part;
4. the config then fails on the host pool, then on the layout;
5. ``max_concurrency = min(num_blocks / device blocks per request, host blocks / host blocks per
   request)``; the steady-state figure charges running requests only ``ACTIVE_TAIL_PAGES`` resident
   pages (they read the rest from host) and one admitted request its full window.

Layers are plain tuples, as in :mod:`kvref.spec.hisparse_layout`: source layers
``(name, page_size_bytes, is_index_group_leader)``, indexer layers ``(name, page_size_bytes)``; two
layers share one vLLM spec (one tensor) exactly when these fields match.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .errors import InsufficientKVCacheError, InvalidFieldError, check_int
from .hisparse_layout import (hisparse_device_buffer_size, hisparse_hot_blocks_per_request,
                              hisparse_host_num_blocks, lay_out_hisparse_groups)
from .mathutil import cdiv
from .planning_packed import check_layout, is_block_compact, is_block_outermost, is_layer_compact
from .pool_sizing import no_memory_error, too_long_error

#: vLLM's ``v1/hisparse/types.ACTIVE_TAIL_PAGES``: resident pages a request reading from host pins
ACTIVE_TAIL_PAGES = 2
#: vLLM's host source pool layout (``KVCacheLayout.LBNHC``: layer-outermost)
HOST_LAYOUT = "LBNHC"


@dataclass(frozen=True)
class HiSparseTensor:
    """One ``KVCacheTensor`` of the plan: the layers sharing one spec in one group."""

    size: int
    layers: tuple[str, ...]
    layer_stride: int
    block_stride: int
    offset: int
    host_resident: bool


@dataclass(frozen=True)
class HiSparsePlan:
    """What vLLM builds for a HiSparse model: the device groups (indexer first), the pools and figures.

    ``device_groups`` are ``(kind, layer names, page_size, hot blocks_per_request)`` with kind
    ``indexer``, ``resident`` or ``hot``; ``blocks_per_request`` is, per device group, the blocks one
    ``max_model_len`` request takes at admission; ``host_blocks_per_request`` the host blocks it takes.
    """

    device_groups: tuple[tuple[str, tuple[str, ...], int, int | None], ...]
    bytes_per_block: int
    num_blocks: int
    host_num_blocks: int
    host_block_stride: int
    max_model_len: int
    blocks_per_request: tuple[int, ...]
    steady_blocks_per_request: tuple[int, ...]
    host_blocks_per_request: int
    max_concurrency: float
    steady_state_concurrency: float
    kv_cache_size_tokens: int
    tensors: tuple[HiSparseTensor, ...]

    def check_invariants(self) -> None:
        """The figures agree with each other: steady state never below admission concurrency."""
        assert len(self.blocks_per_request) == len(self.device_groups) == len(self.steady_blocks_per_request)
        assert all(0 < s <= a for s, a in zip(self.steady_blocks_per_request, self.blocks_per_request))
        # never below admission's figure: exactly so in reals, within float rounding as computed
        assert (self.steady_state_concurrency >= self.max_concurrency
                or math.isclose(self.steady_state_concurrency, self.max_concurrency, rel_tol=1e-12))
        assert self.kv_cache_size_tokens == int(self.max_concurrency * self.max_model_len)
        assert self.host_num_blocks >= self.host_blocks_per_request + 2  # one request, the null block, a tail
        assert all(t.size == self.bytes_per_block * self.num_blocks for t in self.tensors if not t.host_resident)
        assert all(t.size <= self.host_block_stride * self.host_num_blocks for t in self.tensors if t.host_resident)


def hisparse_max_concurrency(num_blocks: int, device_blocks: int, host_num_blocks: int, host_blocks: int) -> float:
    """``get_max_concurrency_for_kv_cache_config`` with a host group: the smaller of both pools' limits."""
    check_int("num_blocks", num_blocks)
    check_int("device_blocks", device_blocks, minimum=1)
    check_int("host_num_blocks", host_num_blocks)
    check_int("host_blocks", host_blocks, minimum=1)
    return min(num_blocks / device_blocks, host_num_blocks / host_blocks)


def hisparse_steady_state_concurrency(num_blocks: int, admission_blocks: int, steady_blocks: int,
                                      host_num_blocks: int, host_blocks: int) -> float:
    """``get_hisparse_steady_state_concurrency``: all but one request at steady state plus one admitted.

    Below one admission window the GPU figure is the admission ratio; above it, one request holds its
    window and every further one its steady blocks. The host limit is the same as at admission.
    """
    check_int("num_blocks", num_blocks)
    check_int("admission_blocks", admission_blocks, minimum=1)
    check_int("steady_blocks", steady_blocks, minimum=1)
    if steady_blocks > admission_blocks:
        raise InvalidFieldError("steady_blocks", steady_blocks, f"<= admission_blocks = {admission_blocks}")
    check_int("host_num_blocks", host_num_blocks)
    check_int("host_blocks", host_blocks, minimum=1)
    if num_blocks < admission_blocks:
        gpu = num_blocks / admission_blocks
    else:
        gpu = 1 + (num_blocks - admission_blocks) / steady_blocks
    return min(gpu, host_num_blocks / host_blocks)


def _check_layers(source: object, indexer: object) -> None:
    if not isinstance(source, (list, tuple)) or not source:
        raise InvalidFieldError("source_layers", source, "a non-empty list of (name, page, leader)")
    if not isinstance(indexer, (list, tuple)):
        raise InvalidFieldError("indexer_layers", indexer, "a list of (name, page_size_bytes)")
    for entry in indexer:
        if not isinstance(entry, tuple) or len(entry) != 2 or not isinstance(entry[0], str):
            raise InvalidFieldError("indexer_layers", entry, "(name: str, page_size_bytes: int)")
        check_int("page_size_bytes", entry[1], minimum=1)


def _spec_runs(layers: Sequence[tuple]) -> list[tuple[tuple, list[str]]]:
    """Layers grouped by identical spec fields, in first-appearance order (vLLM's ``layers_by_spec``)."""
    runs: dict[tuple, list[str]] = {}
    for name, *fields in layers:
        runs.setdefault(tuple(fields), []).append(name)
    return list(runs.items())


def _layout_ok(kv_cache_layout: str, page_sizes: set[int], num_groups: int) -> bool:
    """Whether the device pool can be expressed: ``validate_kv_cache_layout`` (mixed pages need a
    block-compact layout, and with several groups not a layer-compact one), then the hot/resident
    tensors' demand for a block-outermost layout."""
    if len(page_sizes) > 1 and (not is_block_compact(kv_cache_layout)
                                or (num_groups > 1 and is_layer_compact(kv_cache_layout))):
        return False
    return is_block_outermost(kv_cache_layout)


def plan_hisparse_kv_cache(source: Sequence[tuple[str, int, bool]], indexer: Sequence[tuple[str, int]],
                           block_size: int, top_k: int, device_buffer_size: int | None, host_budget: int | None,
                           max_model_len: int, available_memory: int, *, max_in_flight_tokens: int,
                           num_gpu_blocks_override: int | None = None, auto_fit: bool = False,
                           kv_cache_layout: str = "BLNHC", shared_host_pool: bool = False) -> HiSparsePlan:
    """Size a HiSparse model's pools as vLLM 0.33.0 does (one worker, MLA layers only).

    ``host_budget`` is ``host_pool_gib`` in bytes, ``None`` when no HiSparseConnector names one;
    ``max_model_len`` is the model's length (the upper bound when ``auto_fit``).

    Raises:
        InvalidFieldError: bad input, or the rule that rejects the setting (``indexer_page``,
            ``device_buffer_size``, ``source_layers``, ``host_budget``, ``host_pool_gib``,
            ``kv_cache_layout``).
        InsufficientKVCacheError: the device pool cannot hold one request (or auto-fit finds no length).
    """
    _check_layers(source, indexer)
    check_int("block_size", block_size, minimum=1)
    check_int("max_model_len", max_model_len, minimum=1)
    check_int("available_memory", available_memory, minimum=0)
    check_int("max_in_flight_tokens", max_in_flight_tokens, minimum=1)
    check_int("num_gpu_blocks_override", num_gpu_blocks_override, minimum=1, allow_none=True)
    check_int("host_budget", host_budget, minimum=0, allow_none=True)
    check_layout(kv_cache_layout)
    if not isinstance(auto_fit, bool):
        raise InvalidFieldError("auto_fit", auto_fit, "a bool")
    indexer_page = sum(page for _, page in indexer)
    check_int("indexer_page", indexer_page, minimum=1)  # vLLM partitions the layers first
    size = hisparse_device_buffer_size(1, top_k, device_buffer_size)
    hot_blocks = hisparse_hot_blocks_per_request(size, block_size)
    laid = lay_out_hisparse_groups(source, indexer_page, block_size, hot_blocks)
    device = (("indexer", tuple(n for n, _ in indexer), indexer_page, None), *laid)
    widths = [indexer_page] + [len(names) * page for _, names, page, _ in laid]
    bpb = max(widths)
    if is_block_outermost(kv_cache_layout):
        bpb = bpb + (-bpb % math.lcm(*[page for kind, _, page, _ in laid if kind == "hot"]))
    source_page = sum(page for _, page, _ in source)
    page_sizes = {page for _, page in indexer} | {page for _, _, page, _ in laid}
    layout_ok = _layout_ok(kv_cache_layout, page_sizes, len(device))

    def admission(length: int) -> list[int]:
        resident = cdiv(min(max_in_flight_tokens, length), block_size)
        return [cdiv(length, block_size)] + [resident if kind == "resident" else blocks for kind, _, _, blocks in laid]

    def host_blocks(length: int) -> tuple[int, int]:
        if host_budget is None:
            raise InvalidFieldError("host_pool_gib", None, "a HiSparseConnector with host_pool_gib")
        return hisparse_host_num_blocks(host_budget, source_page, shared_host_pool, length, block_size)

    def fits(length: int, memory: int) -> bool:
        try:
            host_blocks(length)
        except InvalidFieldError:
            return False
        return layout_ok and bpb * sum(admission(length)) <= memory

    def estimate(memory: int, upper: int) -> int:
        if not fits(1, memory):
            return 0
        left, right, result = 1, upper, 1
        while left <= right:
            mid = (left + right) // 2
            if fits(mid, memory):
                result, left = mid, mid + 1
            else:
                right = mid - 1
        return result

    memory = available_memory if num_gpu_blocks_override is None else num_gpu_blocks_override * bpb
    check_memory = memory - bpb
    length = max_model_len
    if auto_fit:
        fitted = estimate(check_memory, max_model_len)
        if fitted <= 0:
            raise InsufficientKVCacheError(
                "Cannot auto-fit max_model_len: not enough GPU memory available to serve even a single token. "
                f"[kvref: HiSparse, {check_memory} bytes after the null block.]",
                estimated_max_model_len=0, needed_bytes=bpb * sum(admission(1)), available_bytes=check_memory,
                reason=InsufficientKVCacheError.AUTO_FIT_FAILED)
        length = min(fitted, max_model_len)
    if check_memory <= 0:
        raise no_memory_error(check_memory)
    needed = bpb * sum(admission(length))
    if needed > check_memory:
        raise too_long_error(length, needed, check_memory, estimate(check_memory, length))
    host_num_blocks, host_stride = host_blocks(length)
    if not layout_ok:
        raise InvalidFieldError("kv_cache_layout", kv_cache_layout,
                                f"a block-outermost layout that can express HiSparse's pages {sorted(page_sizes)}")
    num_blocks = memory // bpb

    tensors: list[HiSparseTensor] = []
    offset = 0
    for (page, _leader), names in _spec_runs(source):
        layer_stride = host_num_blocks * page  # layer-outermost: a layer's blocks are contiguous
        tensors.append(HiSparseTensor(source_page * host_num_blocks, tuple(names), layer_stride, page,
                                      offset * layer_stride // page, True))
        offset += len(names) * page
    offset = 0
    for (page,), names in _spec_runs(indexer):
        tensors.append(HiSparseTensor(bpb * num_blocks, tuple(names), page, bpb, offset, False))
        offset += len(names) * page
    for _, names, page, _ in laid:
        tensors.append(HiSparseTensor(bpb * num_blocks, names, page, bpb, 0, False))

    per_request = admission(length)
    steady = [min(b, ACTIVE_TAIL_PAGES) if kind == "resident" else b
              for (kind, _, _, _), b in zip(device, per_request)]
    host_per_request = cdiv(length, block_size)
    concurrency = hisparse_max_concurrency(num_blocks, sum(per_request), host_num_blocks, host_per_request)
    plan = HiSparsePlan(
        device_groups=device, bytes_per_block=bpb, num_blocks=num_blocks, host_num_blocks=host_num_blocks,
        host_block_stride=host_stride, max_model_len=length, blocks_per_request=tuple(per_request),
        steady_blocks_per_request=tuple(steady), host_blocks_per_request=host_per_request,
        max_concurrency=concurrency,
        steady_state_concurrency=hisparse_steady_state_concurrency(num_blocks, sum(per_request), sum(steady),
                                                                   host_num_blocks, host_per_request),
        kv_cache_size_tokens=int(concurrency * length), tensors=tuple(tensors))
    return plan
