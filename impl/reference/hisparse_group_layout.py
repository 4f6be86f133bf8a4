"""A HiSparse coordinator over any group layout, for comparing which layouts vLLM 0.33.0's
``HiSparseCoordinator`` accepts (issue #22/#23).

:class:`~.hisparse_pool.HiSparsePool` builds only the layout vLLM's layout builder makes (host
source, indexer, resident and hot groups of one block size). The coordinator itself also meets
the layouts a hand-made ``KVCacheConfig`` gives it, and must reject the ones it cannot serve: two
host groups, a host group with no host capacity, a host group after a resident group, resident
groups of different block sizes or of another block size than the host's, resident groups with no
host group, no HiSparse group at all. This builds the reference's managers in the given order and
binds the reference coordinator, which raises :class:`~kvref.spec.errors.InvalidFieldError` for
each of those.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvref.spec.errors import InvalidFieldError, check_int
from kvref.spec.hisparse import HiSparseHotSpec, HiSparseResidentSpec
from kvref.spec.kv_cache_interface import FullAttentionSpec

from .full_attention_manager import FullAttentionManager
from .hisparse_block_pool import ReuseWatchingBlockPool
from .hisparse_coordinator import HiSparseCoordinator
from .hisparse_hot_manager import HiSparseHotManager
from .hisparse_resident_manager import HiSparseResidentManager
from .hisparse_source_manager import HiSparseSourceManager

#: the group kinds a layout is made of: the host source, the device indexer, a plain full-attention
#: group, a resident group and a hot group
GROUP_KINDS = ("source", "indexer", "full", "resident", "hot")


def check_group_layout(layout: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
    """``layout``: ``(kind, block_size)`` per group, in group order (kinds in :data:`GROUP_KINDS`)."""
    if isinstance(layout, (str, bytes)) or not isinstance(layout, (list, tuple)) or not layout:
        raise InvalidFieldError("layout", layout, "a non-empty list of (kind, block_size) pairs")
    out = []
    for i, entry in enumerate(layout):
        if not isinstance(entry, (list, tuple)) or len(entry) != 2 or entry[0] not in GROUP_KINDS:
            raise InvalidFieldError(f"layout[{i}]", entry, f"a (kind, block_size) pair, kind one of {GROUP_KINDS}")
        check_int(f"layout[{i}].block_size", entry[1], minimum=1)
        out.append((entry[0], entry[1]))
    return out


def hisparse_coordinator_for_layout(layout: Sequence[tuple[str, int]], host_num_blocks: int | None,
                                    num_gpu_blocks: int, max_model_len: int,
                                    blocks_per_request: int = 1) -> HiSparseCoordinator:
    """Build the managers of ``layout`` over one GPU pool and bind a HiSparse coordinator to them
    (vLLM ``get_hisparse_coordinator``); InvalidFieldError for a layout it cannot serve.
    ``host_num_blocks`` None: the config gives the host group no capacity."""
    layout = check_group_layout(layout)
    check_int("num_gpu_blocks", num_gpu_blocks, minimum=2)
    check_int("max_model_len", max_model_len, minimum=1)
    check_int("blocks_per_request", blocks_per_request, minimum=1)
    if host_num_blocks is None and any(kind == "source" for kind, _ in layout):
        raise InvalidFieldError("hisparse_host_num_blocks", None, "a host capacity for the HiSparse host group")
    hash_block_size = min(bs for _, bs in layout)
    pool = ReuseWatchingBlockPool(num_gpu_blocks, enable_caching=False, hash_block_size=hash_block_size)
    has_resident = any(kind == "resident" for kind, _ in layout)
    managers = []
    for gid, (kind, bs) in enumerate(layout):
        common = dict(kv_cache_group_id=gid, block_pool=pool, enable_caching=False, scheduler_block_size=bs)
        fa = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype="float32")
        if kind == "source":
            managers.append(HiSparseSourceManager(fa, **common))
        elif kind in ("indexer", "full"):
            managers.append(FullAttentionManager(fa, **common))
        elif kind == "resident":
            spec = HiSparseResidentSpec(block_size=bs, page_size=4 * bs)
            cap = spec.max_admission_blocks_per_request(max_model_len, max_model_len)
            managers.append(HiSparseResidentManager(spec, max_admission_blocks_per_request=cap, **common))
        else:
            spec = HiSparseHotSpec(block_size=bs, page_size=4 * bs, blocks_per_request=blocks_per_request)
            managers.append(HiSparseHotManager(spec, has_resident_groups=has_resident, **common))
    return HiSparseCoordinator(managers, num_gpu_blocks, host_num_blocks if host_num_blocks is not None else 1,
                               max_model_len)
