"""HiSparse startup layout: how the sparse-MLA layers are split into host, resident and hot groups.

vLLM 0.33.0 plans HiSparse's KV-cache groups once at startup (``v1/hisparse/layout.py``,
``_lay_out_hisparse_groups`` and ``create_hisparse_layout``; issues #22/#23 of kvref). The sparse
MLA layers become the host-resident *source* group; the indexer layers one GPU group; and the
source layers are packed, in order, into GPU *hot* groups (each with a twin *resident* group) so
that no hot group's page outgrows the indexer group's page: all device groups share one block
pool, so a hot group wider than the indexer's page would not fit the pool's block. The packing
unit is an index group (a run of layers starting at an ``is_index_group_leader`` layer), never
split across hot groups. The host pool then holds ``host_budget // stride`` blocks and must fit
one request at ``max_model_len`` plus the null block and a copy-on-write tail.

These are those rules as functions of plain ints, so the conformance check can compare vLLM's
laid-out groups with them on generated layer sets.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from .errors import InvalidFieldError, check_int
from .mathutil import cdiv

HISPARSE_HOT_SUFFIX = ".hisparse_hot"
HISPARSE_RESIDENT_SUFFIX = ".hisparse_resident"
# vLLM's ``SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT``: a shared host mmap aligns each block to it
SHARED_HOST_BLOCK_ALIGNMENT = 4096


def check_hisparse_first_group(block_sizes: Collection[int], model_versions: Collection[str | None],
                               non_mla_layers: Sequence[str]) -> int:
    """vLLM's ``_partition_hisparse_specs`` and ``_lay_out_hisparse_groups`` checks on the first KV
    cache group (every MLA layer, and whatever else shares its uniform-type group), in vLLM's order:
    one block size (else the layers form no uniform-type group: "requires uniform sparse-MLA cache
    specs"), no DeepSeek-V4 MLA layer, MLA layers only. Returns the one GPU block size."""
    if isinstance(block_sizes, (str, bytes)) or not isinstance(block_sizes, Collection) or not block_sizes:
        raise InvalidFieldError("block_sizes", block_sizes, "a non-empty collection of block sizes")
    for b in block_sizes:
        check_int("block_size", b, minimum=1)
    if len(set(block_sizes)) != 1:
        raise InvalidFieldError("block_size", sorted(set(block_sizes)), "one block size for every HiSparse layer")
    if isinstance(model_versions, (str, bytes)) or not isinstance(model_versions, Collection):
        raise InvalidFieldError("model_versions", model_versions, "a collection of MLA model versions")
    if "deepseek_v4" in model_versions:
        raise InvalidFieldError("model_version", "deepseek_v4", "an MLA model version HiSparse supports (not DeepSeek V4)")
    if isinstance(non_mla_layers, (str, bytes)) or not isinstance(non_mla_layers, Sequence) \
            or not all(isinstance(n, str) for n in non_mla_layers):
        raise InvalidFieldError("non_mla_layers", non_mla_layers, "a list of layer names")
    if non_mla_layers:
        raise InvalidFieldError("layers", list(non_mla_layers), "MLA layers only in HiSparse's first cache group")
    return next(iter(block_sizes))


def hot_group_layers(source_layers: Sequence[tuple[str, int, bool]], indexer_page: int) -> list[list[str]]:
    """The source layer names of each hot group, in vLLM's order.

    ``source_layers`` is ``(name, page_size_bytes, is_index_group_leader)`` per sparse layer, in
    layer order. A new index group starts at a leader (or at the first layer); index groups are
    appended greedily to the current hot group while its summed page stays within
    ``indexer_page``; one index group alone may exceed it (it is never split).
    """
    check_int("indexer_page", indexer_page, minimum=1)
    if not isinstance(source_layers, (list, tuple)) or not source_layers:
        raise InvalidFieldError("source_layers", source_layers, "a non-empty list of (name, page, leader)")
    units: list[list[tuple[str, int]]] = []
    for entry in source_layers:
        if not isinstance(entry, tuple) or len(entry) != 3 or not isinstance(entry[0], str):
            raise InvalidFieldError("source_layers", entry, "(name: str, page_size_bytes: int, leader: bool)")
        name, page, leader = entry
        check_int("page_size_bytes", page, minimum=1)
        if leader or not units:
            units.append([])
        units[-1].append((name, page))
    groups: list[list[str]] = []
    current: list[str] = []
    current_page = 0
    for unit in units:
        unit_page = sum(page for _, page in unit)
        if current and current_page + unit_page > indexer_page:
            groups.append(current)
            current, current_page = [], 0
        current.extend(name for name, _ in unit)
        current_page += unit_page
    if current:
        groups.append(current)
    return groups


def hisparse_device_buffer_size(max_query_len: int, top_k: int, configured: int | None) -> int:
    """Hot-region rows per request: the configured size, else ``(max_query_len + 1) * top_k``.

    vLLM's ``ResolvedHiSparseConfig.from_vllm_config``: the worst-case union of every speculative
    step's top-k plus one top-k of LRU slack; a configured size below ``max_query_len * top_k``
    or above the int16 slot-index limit (32768) is rejected.
    """
    check_int("max_query_len", max_query_len, minimum=1)
    check_int("top_k", top_k, minimum=1)
    check_int("device_buffer_size", configured, minimum=1, allow_none=True)
    size = (max_query_len + 1) * top_k if configured is None else configured
    if size < max_query_len * top_k:
        raise InvalidFieldError("device_buffer_size", size, f">= max_query_len * top_k = {max_query_len * top_k}")
    if size > 32768:
        raise InvalidFieldError("device_buffer_size", size, "<= 32768 (the int16 slot-index limit)")
    return size


def hisparse_hot_blocks_per_request(device_buffer_size: int, block_size: int) -> int:
    """``HiSparseHotSpec.blocks_per_request``: the hot rows rounded up to whole GPU blocks."""
    check_int("device_buffer_size", device_buffer_size, minimum=1)
    check_int("block_size", block_size, minimum=1)
    return cdiv(device_buffer_size, block_size)


def hisparse_host_num_blocks(host_budget: int, source_page: int, shared_host_pool: bool, max_model_len: int,
                             block_size: int) -> tuple[int, int]:
    """``(host_num_blocks, host_block_stride)`` of ``create_hisparse_layout``.

    The stride is the source group's page, aligned to the shared mmap's block alignment when the
    host pool is shared. Every computed page needs a host block, so the pool must hold
    ``cdiv(max_model_len, block_size) + 2`` blocks (one request, the null block, a copy-on-write
    tail); fewer is a ValueError in vLLM, an :class:`InvalidFieldError` on ``host_budget`` here.
    """
    check_int("host_budget", host_budget, minimum=0)
    check_int("source_page", source_page, minimum=1)
    check_int("max_model_len", max_model_len, minimum=1)
    check_int("block_size", block_size, minimum=1)
    stride = cdiv(source_page, SHARED_HOST_BLOCK_ALIGNMENT) * SHARED_HOST_BLOCK_ALIGNMENT if shared_host_pool \
        else source_page
    num_blocks = host_budget // stride
    needed = cdiv(max_model_len, block_size) + 2
    if num_blocks <= 0 or num_blocks < needed:
        raise InvalidFieldError("host_budget", host_budget,
                                f"room for {needed} host blocks of {stride} bytes (max_model_len needs them)")
    return num_blocks, stride


def lay_out_hisparse_groups(source_layers: Sequence[tuple[str, int, bool]], indexer_page: int, block_size: int,
                            blocks_per_request: int) -> list[tuple[str, tuple[str, ...], int, int | None]]:
    """The device-side groups vLLM's ``_lay_out_hisparse_groups`` appends after the source and indexer.

    Every resident group first, then every hot group, each as ``(kind, layer names, page_size,
    blocks_per_request)``. A hot group's layers must share one page size (the group's page is one
    layer's page, not their sum); mixed pages are an :class:`InvalidFieldError`.
    """
    check_int("block_size", block_size, minimum=1)
    check_int("blocks_per_request", blocks_per_request, minimum=1)
    groups = hot_group_layers(source_layers, indexer_page)  # validates every entry first
    pages = {entry[0]: entry[1] for entry in source_layers}
    resident: list[tuple[str, tuple[str, ...], int, int | None]] = []
    hot: list[tuple[str, tuple[str, ...], int, int | None]] = []
    for names in groups:
        group_pages = sorted({pages[n] for n in names})
        if len(group_pages) != 1:
            raise InvalidFieldError("source_layers", names, f"one page size per hot group, got {group_pages}")
        resident.append(("resident", tuple(n + HISPARSE_RESIDENT_SUFFIX for n in names), group_pages[0], None))
        hot.append(("hot", tuple(n + HISPARSE_HOT_SUFFIX for n in names), group_pages[0], blocks_per_request))
    return resident + hot
