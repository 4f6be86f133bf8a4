"""Hidden-state cache layers in the grouping (vLLM 0.33.0 ``get_kv_cache_groups``'s last step).

vLLM's ``extract_hidden_states`` stores the hidden states of some layers in the KV cache
(:class:`~kvref.spec.kv_cache_interface.HiddenStateCacheSpec`). Those layers use their own block
table: where the model is not uniform (step 2 and 3 of the ladder in :mod:`kvref.spec.grouping`
did not apply), they are taken out before the attention layers are grouped and come back as one
group per layer, their pages aligned to the attention groups' common page:

* the common page must hold at least one token of the widest hidden-state layer; where tensor
  parallelism shrank it below that, every attention group's block size (and padded page) is
  scaled up by ``cdiv(max_per_token, common_page)`` (``_ensure_min_page_size``);
* a hidden-state layer's block size is the largest divisor of the attention groups' gcd block size
  whose tokens fit in the common page, and its page is padded to the common page, so every group
  keeps one page size (the block pool has one block size in bytes).

Under a block-outermost layout that packs the attention layers, the hidden-state layers are
appended unchanged (the packed blocks are strided by the widest group, no alignment is needed).
"""

from __future__ import annotations

from dataclasses import replace
from math import gcd

from .dtypes import get_dtype_size
from .errors import KVCacheGroupingError
from .kv_cache_interface import (
    AttentionSpec,
    HiddenStateCacheSpec,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
)
from .mathutil import cdiv


def _split_hidden_state_layers(layers: dict[str, KVCacheSpec]) -> tuple[dict[str, KVCacheSpec],
                                                                       dict[str, HiddenStateCacheSpec]]:
    """(the other layers, the hidden-state layers), each in model order."""
    hidden = {n: s for n, s in layers.items() if isinstance(s, HiddenStateCacheSpec)}
    return {n: s for n, s in layers.items() if n not in hidden}, hidden


def _hidden_state_bytes_per_token(spec: HiddenStateCacheSpec) -> int:
    """Bytes of one token of a hidden-state layer (heads x head size x dtype size)."""
    return spec.num_kv_heads * spec.head_size * get_dtype_size(spec.dtype)


def _largest_divisor_at_most(value: int, limit: int) -> int:
    """The largest divisor of ``value`` that is at most ``limit`` (1 at least)."""
    for candidate in range(min(value, limit), 0, -1):
        if value % candidate == 0:
            return candidate
    return 1


def _ensure_min_page_size(groups: list[KVCacheGroupSpec], common_page: int,
                         hidden: dict[str, HiddenStateCacheSpec]) -> tuple[list[KVCacheGroupSpec], int]:
    """Scale every group's block size (and padded page) so that ``common_page`` holds one token of
    the widest hidden-state layer; the (possibly scaled) groups and common page."""
    widest = max(_hidden_state_bytes_per_token(s) for s in hidden.values())
    if widest <= common_page:
        return groups, common_page
    scale = cdiv(widest, common_page)
    scaled = []
    for g in groups:
        spec = g.kv_cache_spec
        kw: dict = {"block_size": spec.block_size * scale}
        if isinstance(spec, (AttentionSpec, MambaSpec)) and spec.page_size_padded is not None:
            kw["page_size_padded"] = spec.page_size_padded * scale
        scaled.append(KVCacheGroupSpec(g.layer_names, replace(spec, **kw)))
    return scaled, common_page * scale


def _add_hidden_state_groups(groups: tuple[KVCacheGroupSpec, ...],
                            hidden: dict[str, HiddenStateCacheSpec]) -> tuple[KVCacheGroupSpec, ...]:
    """The attention ``groups`` (one page size) followed by one group per hidden-state layer,
    aligned to their common page as the module docstring says."""
    if not hidden:
        return groups
    pages = {g.kv_cache_spec.page_size_bytes for g in groups}
    if len(pages) != 1:  # vLLM asserts in get_uniform_page_size
        raise KVCacheGroupingError(
            f"hidden-state layers {sorted(hidden)} need the other layers' groups to share one page size "
            f"(got {sorted(pages)})")
    scaled, common_page = _ensure_min_page_size(list(groups), pages.pop(), hidden)
    group_block_size = gcd(*(g.kv_cache_spec.block_size for g in scaled))
    for name, spec in hidden.items():
        max_block_size = max(common_page // _hidden_state_bytes_per_token(spec), 1)
        block_size = _largest_divisor_at_most(group_block_size, max_block_size)
        scaled.append(KVCacheGroupSpec((name,), replace(spec, block_size=block_size, page_size_padded=common_page)))
    return tuple(scaled)
