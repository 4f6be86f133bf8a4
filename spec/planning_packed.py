"""Grouping under a block-outermost KV cache layout (vLLM 0.33.0 ``VLLM_KV_CACHE_LAYOUT=BLHNC``).

vLLM's physical layout is a stride permutation of the logical axes ``[L, B, H, N, C]``
(``vllm/v1/kv_cache_layout.py``, RFC vllm#42082). When the block axis ``B`` is outermost, every
block holds the pages of all layers side by side, so layers of *different* page sizes can share a
group without padding: ``get_kv_cache_groups`` then tries ``_get_packed_kv_cache_groups`` before
unifying page sizes. This module models that step and the layout check
(``validate_kv_cache_layout``): a layout whose pages are not contiguous inside a block (``H``
before ``L``/``B``), or a layer-outermost layout with several groups, cannot express mixed page
sizes and vLLM refuses it at startup.

With no ``block_stride_alignment`` (kvref does not model kernel stride alignment) bytes per block
are the widest group's summed pages under every layout, so :func:`~kvref.spec.pool_sizing.pool_bytes_per_block`
is unchanged.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from .errors import InvalidFieldError, KVCacheGroupingError
from .grouping import (
    Layers,
    get_kv_cache_groups,
    is_kv_cache_spec_uniform,
    unify_hybrid_kv_cache_specs,
    validate_layers,
)
from .kv_cache_interface import (
    CircularBufferSpec,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from .mathutil import cdiv
from .planning_hidden_state import _split_hidden_state_layers

#: vLLM's ``KVCacheLayout`` members: physical order of the logical axes L=0, B=1, H=2, N=3, C=4
KV_CACHE_LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
DEFAULT_KV_CACHE_LAYOUT = "LBNHC"


def check_layout(layout: object) -> str:
    """``layout`` if it names a vLLM layout, else :class:`InvalidFieldError` on ``kv_cache_layout``."""
    if not isinstance(layout, str) or layout not in KV_CACHE_LAYOUTS:
        raise InvalidFieldError("kv_cache_layout", layout, f"one of {sorted(KV_CACHE_LAYOUTS)}")
    return layout


def is_block_outermost(layout: str) -> bool:
    return KV_CACHE_LAYOUTS[check_layout(layout)][0] == 1


def is_layer_compact(layout: str) -> bool:
    return KV_CACHE_LAYOUTS[check_layout(layout)][0] == 0


def is_block_compact(layout: str) -> bool:
    """Each page's ``[H, N, C]`` bytes are one contiguous run (``L`` and ``B`` outermost)."""
    return set(KV_CACHE_LAYOUTS[check_layout(layout)][:2]) == {0, 1}


def approximate_gcd(values: list[int], lower_bound: int = 1) -> int:
    """The chunk ``d`` in ``[lower_bound, max(values)]`` that minimises the total upward padding
    ``sum(ceil(x / d) * d - x)``, ties to the larger ``d`` (``lower_bound`` itself when it exceeds
    every value); vLLM's ``_approximate_gcd``."""
    if not isinstance(values, (list, tuple)) or not values or not all(type(x) is int and x >= 1 for x in values):
        raise InvalidFieldError("values", values, "a non-empty list of positive ints")
    if type(lower_bound) is not int:
        raise InvalidFieldError("lower_bound", lower_bound, "an int")
    low = max(1, lower_bound)
    if low > max(values):
        return low
    # min over (padding, -d): least padding, ties to the larger chunk
    return min(range(low, max(values) + 1), key=lambda d: (sum((d - x % d) % d for x in values), -d))


def _max_layers_per_page_size(spec: UniformTypeKVCacheSpecs) -> int:
    """Layers sharing the most common page size (a balanced bucket's pattern repeats)."""
    return Counter(s.page_size_bytes for s in spec.kv_cache_specs.values()).most_common(1)[0][1]


def get_packed_kv_cache_groups(layers: Layers, check_partition: bool = True) -> tuple[KVCacheGroupSpec, ...] | None:
    """Group mixed-page-size layers for a block-outermost layout; None when all pages are equal.

    Layers go greedily into uniform-type buckets (model order). A *balanced* bucket (as many
    layers of each page size) is a repeating pattern; those buckets split into groups of the same
    number of pattern repeats, chosen by :func:`approximate_gcd` with the largest mixed balanced
    bucket as floor (it must stay whole). State buckets (Mamba, circular buffers, and sliding
    windows when nothing repeats) split further so that a group fits in the bytes a block needs
    anyway instead of widening it.

    ``check_partition=False`` keeps vLLM's groups when a split drops layers (what its per-layer
    memory check sizes, as it never checks the partition); an empty group always fails.
    """
    layers = validate_layers(layers, allow_empty=True)
    if not isinstance(check_partition, bool):
        raise InvalidFieldError("check_partition", check_partition, "True or False")
    if len({s.page_size_bytes for s in layers.values()}) <= 1:
        return None
    buckets: list[Layers] = []
    for name, spec in layers.items():
        for bucket in buckets:
            if UniformTypeKVCacheSpecs.is_uniform_type({**bucket, name: spec}):
                bucket[name] = spec
                break
        else:
            buckets.append({name: spec})

    bucketed = []
    for bucket in buckets:
        uniform = UniformTypeKVCacheSpecs.from_specs(bucket)
        by_page: dict[int, list[str]] = defaultdict(list)
        for name, spec in bucket.items():
            by_page[spec.page_size_bytes].append(name)
        balanced = len({len(names) for names in by_page.values()}) == 1  # 1:1 patterns only
        bucketed.append((uniform, by_page, balanced))

    floor = max((_max_layers_per_page_size(u) for u, by_page, bal in bucketed if bal and len(by_page) > 1), default=0)
    repeats = (approximate_gcd([_max_layers_per_page_size(u) for u, _, bal in bucketed if bal], lower_bound=floor)
               if floor else None)

    def num_groups_for(u: UniformTypeKVCacheSpecs, balanced: bool) -> int:
        return cdiv(_max_layers_per_page_size(u), repeats) if balanced and repeats is not None else 1

    def is_state_bucket(u: UniformTypeKVCacheSpecs) -> bool:
        first = u.first_spec
        return isinstance(first, (MambaSpec, CircularBufferSpec)) or (
            repeats is None and isinstance(first, SlidingWindowSpec))

    def widest_group_bytes(by_page: dict[int, list[str]], n: int) -> int:
        return sum(cdiv(len(names), n) * page for page, names in by_page.items())

    anchor = max(widest_group_bytes(by_page, len(u.kv_cache_specs) if is_state_bucket(u) else num_groups_for(u, bal))
                 for u, by_page, bal in bucketed)
    groups: list[KVCacheGroupSpec] = []
    for u, by_page, bal in bucketed:
        n = num_groups_for(u, bal)
        if anchor and is_state_bucket(u):
            per_block = max(anchor // u.first_spec.page_size_bytes, 1)
            n = max(n, cdiv(len(u.kv_cache_specs), per_block))
        if n == 1:
            groups.append(KVCacheGroupSpec(tuple(u.kv_cache_specs), u))
            continue
        pattern_repeats = list(zip(*by_page.values()))  # an unbalanced bucket keeps only full repeats
        if n > len(pattern_repeats) or (check_partition
                                        and len(pattern_repeats) * len(by_page) < len(u.kv_cache_specs)):
            # vLLM 0.33.0 splits an unbalanced state bucket (e.g. sliding-window layers of two head
            # counts, 3:1) by whole pattern repeats: the split drops layers (its partition check
            # asserts) or makes an empty group (StopIteration in from_specs); startup fails either way
            raise KVCacheGroupingError(
                f"cannot pack {type(u.first_spec).__name__} layers with page sizes "
                f"{ {page: len(names) for page, names in by_page.items()} } into {n} groups of whole "
                "pattern repeats (vLLM 0.33.0 fails at startup)")
        for i in range(n):
            names = tuple(name for rep in pattern_repeats[i::n] for name in rep)
            groups.append(KVCacheGroupSpec(names, UniformTypeKVCacheSpecs.from_specs(
                {name: u.kv_cache_specs[name] for name in names})))
    return tuple(groups)


def get_kv_cache_groups_for_layout(layers: Layers, disable_hybrid_kv_cache_manager: bool, layout: str,
                                   check_partition: bool = True) -> tuple[KVCacheGroupSpec, ...]:
    """vLLM's ``get_kv_cache_groups`` under ``layout``: the packed grouping comes after the uniform
    and uniform-type cases and before page-size unification, for block-outermost layouts only."""
    layout = check_layout(layout)
    layers = validate_layers(layers, allow_empty=True)
    for name, flag in (("disable_hybrid_kv_cache_manager", disable_hybrid_kv_cache_manager),
                       ("check_partition", check_partition)):
        if not isinstance(flag, bool):
            raise InvalidFieldError(name, flag, "True or False")
    if not is_block_outermost(layout):
        return get_kv_cache_groups(layers, disable_hybrid_kv_cache_manager)
    promoted = unify_hybrid_kv_cache_specs(layers) if disable_hybrid_kv_cache_manager else layers
    if promoted and not is_kv_cache_spec_uniform(promoted) and UniformTypeKVCacheSpecs.from_specs(promoted) is None:
        attention, hidden = _split_hidden_state_layers(promoted)  # packed without the hidden-state layers
        packed = get_packed_kv_cache_groups(attention, check_partition) if attention else None
        if packed:
            return packed + tuple(KVCacheGroupSpec((name,), spec) for name, spec in hidden.items())
    return get_kv_cache_groups(layers, disable_hybrid_kv_cache_manager)


def validate_kv_cache_layout(layout: str, groups: tuple[KVCacheGroupSpec, ...]) -> None:
    """vLLM's ``validate_kv_cache_layout``: mixed page sizes need each page contiguous inside its
    block and, with several groups, the layer axis inside the block axis; else
    :class:`InvalidFieldError` on ``kv_cache_layout`` (vLLM: a ``ValueError`` naming BLHNC)."""
    from .pool_sizing import validate_groups

    layout = check_layout(layout)
    groups = tuple(validate_groups(groups))
    specs = [g.kv_cache_spec.layer_spec(n) if isinstance(g.kv_cache_spec, UniformTypeKVCacheSpecs)
             else g.kv_cache_spec for g in groups for n in g.layer_names]
    pages = {s.page_size_bytes for s in specs}
    if len(pages) > 1 and (not is_block_compact(layout) or (len(groups) > 1 and is_layer_compact(layout))):
        raise InvalidFieldError("kv_cache_layout", layout,
                                f"a block-outermost layout (e.g. BLHNC) for mixed page sizes {sorted(pages)}")
    # vLLM's compute_layout_strides: a padded page (page_size_padded) must be one run per
    # (layer, block); with heads stored outside it (LHBNC, BHLNC) only one head can be padded.
    order = KV_CACHE_LAYOUTS[layout]
    heads_outside_page = order.index(2) < max(order.index(0), order.index(1))
    padded = sorted({n for g in groups for n in g.layer_names
                     if _padded_heads(g, n) > 1} if heads_outside_page else ())
    if padded:
        raise InvalidFieldError("kv_cache_layout", layout,
                                f"a layout with L and B outside the heads (padded pages of {padded[:3]} have "
                                "several heads); vLLM asserts in compute_layout_strides")


def _padded_heads(group: KVCacheGroupSpec, name: str) -> int:
    """Heads of layer ``name``'s page when the page is padded, else 0 (Mamba pages have one head)."""
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        spec = spec.layer_spec(name)
    if getattr(spec, "page_size_padded", None) is None:
        return 0
    return getattr(spec, "num_kv_heads", 1)
