"""HiSparse KV-cache groups: their specs and the pure block-count rules of their managers.

HiSparse keeps a request's KV on the host (the *source* group, a full-attention group bound to a
private host pool) and reads only part of it from the GPU: *resident* pages (a write-back cache of
host pages, ``HiSparseResidentSpec``) and, once the request can read from host, a fixed *hot*
region of ``blocks_per_request`` blocks (``HiSparseHotSpec``). Neither auxiliary group is ever
prefix-cached: the host source owns the prefix cache.

The functions below are the admission counts of vLLM 0.33.0's ``HiSparseSourceManager``,
``HiSparseHotManager`` and ``HiSparseResidentManager`` (``v1/core/single_type_kv_cache_manager.py``)
and the transition rule of ``HiSparseCoordinator.update_residency`` (``v1/hisparse/coordinator.py``),
as functions of plain ints so that the reference managers and the conformance checks share one
statement of each rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from .errors import InvalidFieldError, check_int
from .kv_cache_interface import _UNIFORM_TYPE_BASE, KVCacheSpec, _checked_sizing
from .mathutil import cdiv

if TYPE_CHECKING:
    from .config import EngineConfig


@dataclass(frozen=True, kw_only=True)
class HiSparseHotSpec(KVCacheSpec):
    """A per-request hot region: ``blocks_per_request`` blocks, allocated whole and only once the
    request must read host-backed history; freed with the request (vLLM ``HiSparseHotSpec``)."""

    page_size: int
    blocks_per_request: int

    manager_name: ClassVar[str] = "HiSparseHotManager"
    prefix_cacheable: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("HiSparseHotSpec.page_size", self.page_size, minimum=1)
        check_int("HiSparseHotSpec.blocks_per_request", self.blocks_per_request, minimum=1)

    @property
    def page_size_bytes(self) -> int:
        return self.page_size

    @_checked_sizing
    def max_memory_usage_bytes(self, config: "EngineConfig", max_model_len: int | None = None) -> int:
        return self.blocks_per_request * self.page_size

    @_checked_sizing
    def max_num_blocks_per_req(self, config: "EngineConfig", max_len: int) -> int:
        return self.blocks_per_request


@dataclass(frozen=True, kw_only=True)
class HiSparseResidentSpec(KVCacheSpec):
    """GPU-resident pages of host-backed KV (vLLM ``HiSparseResidentSpec``): one block per page
    the request writes, capped at admission by the in-flight window, since older pages move to host
    and their blocks are reclaimed."""

    page_size: int

    manager_name: ClassVar[str] = "HiSparseResidentManager"
    prefix_cacheable: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("HiSparseResidentSpec.page_size", self.page_size, minimum=1)

    @property
    def page_size_bytes(self) -> int:
        return self.page_size

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        return resident_max_admission_blocks(self.block_size, max_in_flight_tokens, max_model_len)

    @_checked_sizing
    def max_memory_usage_bytes(self, config: "EngineConfig", max_model_len: int | None = None) -> int:
        max_len = config.max_model_len if max_model_len is None else max_model_len
        in_flight = getattr(config, "max_in_flight_tokens", None) or max_len
        return self.max_admission_blocks_per_request(in_flight, max_len) * self.page_size


_UNIFORM_TYPE_BASE.update({HiSparseHotSpec: HiSparseHotSpec, HiSparseResidentSpec: HiSparseResidentSpec})


def resident_max_admission_blocks(block_size: int, max_in_flight_tokens: int, max_model_len: int) -> int:
    """Resident blocks admission reserves for one request: ``cdiv(min(in_flight, max_len), bs)``.

    Only the pages a step can write need GPU blocks at admission; older pages are written back and
    their blocks reclaimed (vLLM ``HiSparseResidentSpec.max_admission_blocks_per_request``)."""
    check_int("block_size", block_size, minimum=1)
    check_int("max_in_flight_tokens", max_in_flight_tokens, minimum=1)
    check_int("max_model_len", max_model_len, minimum=1)
    return cdiv(min(max_in_flight_tokens, max_model_len), block_size)


def hot_needs_region(total_computed_tokens: int, num_local_computed_tokens: int, is_running: bool,
                     hot_required: bool) -> bool:
    """Whether the hot manager counts its region at admission.

    A hot region is needed to read host-backed history: an external import (computed tokens beyond
    the local hit), a new request resuming a host prefix (a local hit before it runs), or a request
    the coordinator already asked to transition. A running request keeps its earlier answer."""
    check_int("total_computed_tokens", total_computed_tokens, minimum=0)
    check_int("num_local_computed_tokens", num_local_computed_tokens, minimum=0)
    for name, value in (("is_running", is_running), ("hot_required", hot_required)):
        if not isinstance(value, bool):
            raise InvalidFieldError(name, value, "True or False")
    host_import = total_computed_tokens > num_local_computed_tokens
    resumes_host_prefix = num_local_computed_tokens > 0 and not is_running
    return host_import or resumes_host_prefix or hot_required


def hot_blocks_to_allocate(blocks_per_request: int, num_held: int) -> int:
    """Blocks still missing from a request's hot region (it is allocated whole, once)."""
    check_int("blocks_per_request", blocks_per_request, minimum=1)
    check_int("num_held", num_held, minimum=0)
    return max(blocks_per_request - num_held, 0)


def resident_blocks_to_allocate(block_size: int, num_tokens: int, total_computed_tokens: int,
                                num_local_computed_tokens: int, num_held: int, tail_resident: bool,
                                apply_admission_cap: bool, max_admission_blocks: int) -> int:
    """New resident blocks an allocation for ``num_tokens`` takes (vLLM
    ``HiSparseResidentManager.get_num_blocks_to_allocate``).

    * External import (``total_computed_tokens > num_local_computed_tokens``): the last imported
      page gets a writable GPU block unless it is already resident (``tail_resident``), plus the
      pages past the import that neither the import nor the table already covers. The admission
      cap does not apply.
    * Otherwise: pages up to ``cdiv(num_tokens, bs)`` (capped at ``max_admission_blocks`` under
      the admission gate) beyond what the table holds or the local host hit covers: host-hit pages
      are null placeholders, read from host.
    """
    check_int("block_size", block_size, minimum=1)
    check_int("num_tokens", num_tokens, minimum=0)
    check_int("total_computed_tokens", total_computed_tokens, minimum=0)
    check_int("num_local_computed_tokens", num_local_computed_tokens, minimum=0)
    check_int("num_held", num_held, minimum=0)
    check_int("max_admission_blocks", max_admission_blocks, minimum=1)
    for name, value in (("tail_resident", tail_resident), ("apply_admission_cap", apply_admission_cap)):
        if not isinstance(value, bool):
            raise InvalidFieldError(name, value, "True or False")
    if total_computed_tokens > num_local_computed_tokens:
        imported_pages = cdiv(total_computed_tokens, block_size)
        return int(not tail_resident) + max(cdiv(num_tokens, block_size) - max(imported_pages, num_held), 0)
    required = cdiv(num_tokens, block_size)
    if apply_admission_cap:
        required = min(required, max_admission_blocks)
    return max(required - max(num_held, cdiv(num_local_computed_tokens, block_size)), 0)


def source_admission_count(num_required: int, num_host_free: int, num_gpu_blocks: int) -> int:
    """What the host source adds to the GPU admission count: 0 while the private host pool can back
    every page, else ``num_gpu_blocks + 1`` — a count no GPU pool can satisfy, so the allocation
    is refused (the sentinel Mamba uses too). Host blocks never count against the GPU pool."""
    check_int("num_required", num_required, minimum=0)
    check_int("num_host_free", num_host_free, minimum=0)
    check_int("num_gpu_blocks", num_gpu_blocks, minimum=1)
    return num_gpu_blocks + 1 if num_required > num_host_free else 0


def transition_watermark(hot_blocks_per_request: Sequence[int], num_blocks: int) -> int:
    """Free GPU blocks below which a request that cannot read from host is asked to take a hot
    region: ``max(sum of hot regions, num_blocks // 10)``, so admissions find evictable pages
    rather than pinned ones (vLLM ``HiSparseCoordinator.__init__``)."""
    if isinstance(hot_blocks_per_request, (str, bytes)) or not isinstance(hot_blocks_per_request, (tuple, list)):
        raise InvalidFieldError("hot_blocks_per_request", hot_blocks_per_request, "a tuple or list of ints >= 1")
    for i, n in enumerate(hot_blocks_per_request):
        check_int(f"hot_blocks_per_request[{i}]", n, minimum=1)
    check_int("num_blocks", num_blocks, minimum=1)
    return max(sum(hot_blocks_per_request), num_blocks // 10)


def needs_hot_transition(num_gpu_free: int, watermark: int, fills_admission_window: bool) -> bool:
    """Whether ``update_residency`` asks a request that cannot yet read from host for its hot
    region: the shared pool is below the watermark, or the request already holds the resident
    pages admission reserved for it (keeping more pinned would outgrow its admission)."""
    check_int("num_gpu_free", num_gpu_free, minimum=0)
    check_int("watermark", watermark, minimum=0)
    if not isinstance(fills_admission_window, bool):
        raise InvalidFieldError("fills_admission_window", fills_admission_window, "True or False")
    return num_gpu_free < watermark or fills_admission_window


@dataclass(frozen=True)
class HiSparsePoolConfig:
    """A HiSparse pool as vLLM's HiSparse layout builds it, in group order: the host *source*
    (full attention, ``host_num_blocks`` host blocks), the device *indexer* (full attention), then
    ``num_resident_groups`` times a resident group followed by a hot group, all of one
    ``block_size`` (vLLM requires host and resident block sizes to match). ``num_gpu_blocks``
    includes the null block, as in vLLM. ``num_resident_groups=0`` is a host-only layout: vLLM's
    ``HiSparseCoordinator`` accepts it (it binds the host pool and plans no residency), though its
    layout builder always adds a resident group."""

    block_size: int
    num_gpu_blocks: int
    host_num_blocks: int
    blocks_per_request: int
    num_resident_groups: int
    max_model_len: int
    max_in_flight_tokens: int
    #: prefix caching: the host source publishes a page's hash once its host copy is durable, and
    #: a later hit on it adopts the page's GPU copies (vLLM ``HiSparseCoordinator``)
    enable_caching: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.enable_caching, bool):
            raise InvalidFieldError("HiSparsePoolConfig.enable_caching", self.enable_caching, "True or False")
        check_int("HiSparsePoolConfig.block_size", self.block_size, minimum=1)
        check_int("HiSparsePoolConfig.num_gpu_blocks", self.num_gpu_blocks, minimum=2)
        check_int("HiSparsePoolConfig.host_num_blocks", self.host_num_blocks, minimum=2)
        check_int("HiSparsePoolConfig.blocks_per_request", self.blocks_per_request, minimum=1)
        check_int("HiSparsePoolConfig.num_resident_groups", self.num_resident_groups, minimum=0)
        check_int("HiSparsePoolConfig.max_model_len", self.max_model_len, minimum=1)
        check_int("HiSparsePoolConfig.max_in_flight_tokens", self.max_in_flight_tokens, minimum=1)

    @property
    def page_size(self) -> int:
        return 4 * self.block_size

    def resident_spec(self) -> HiSparseResidentSpec:
        return HiSparseResidentSpec(block_size=self.block_size, page_size=self.page_size)

    def hot_spec(self) -> HiSparseHotSpec:
        return HiSparseHotSpec(block_size=self.block_size, page_size=self.page_size,
                               blocks_per_request=self.blocks_per_request)

    @property
    def group_kinds(self) -> tuple[str, ...]:
        return ("source", "indexer") + ("resident", "hot") * self.num_resident_groups
