"""Grouping layers into KV cache groups (vLLM 0.33.0 ``kv_cache_planning.get_kv_cache_groups``).

A KV cache group is a set of layers that share one block table: the manager allocates block ids
for the group, and every layer of the group stores its own page of each block. The decision
ladder, in vLLM's order:

1. ``disable_hybrid_kv_cache_manager``: promote sliding-window / chunked-local layers to full
   attention where they coexist with full attention (:func:`unify_hybrid_kv_cache_specs`).
2. All layers mergeable into one spec → one group (:func:`is_kv_cache_spec_uniform`).
3. All layers of one *type* (same token slots, different page sizes) → one group holding a
   :class:`UniformTypeKVCacheSpecs`.
4. Otherwise a hybrid model: make every page the same size (:func:`unify_kv_cache_spec_page_size`:
   scale ``block_size`` when the page divides the largest, else pad Mamba and non-MLA attention
   pages), then split each type into groups of equal layer count
   (:func:`group_layers_with_uniform_page_size`). If the pages cannot be unified, MLA next to
   plain sliding-window layers falls back to one full-allocation group; anything else fails.

This is the ladder under the layer-outermost layouts (vLLM's default ``LBNHC``); block-outermost
layouts try vLLM's packed grouping before step 4 (:mod:`kvref.spec.planning_packed`). Hidden-state
cache layers are set apart before step 4 and come back as groups of their own
(:mod:`kvref.spec.planning_hidden_state`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import fields, replace

from .errors import InvalidFieldError, KVCacheGroupingError, SpecMergeError
from .kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    _check_specs,
)
from .mathutil import cdiv
from .planning_hidden_state import _add_hidden_state_groups, _split_hidden_state_layers

Layers = dict[str, KVCacheSpec]


def validate_layers(layers: object, allow_empty: bool = False) -> Layers:
    """A copy of ``layers`` after checking it is a mapping of layer name → per-layer spec of a type
    vLLM 0.33.0 registers; :class:`InvalidFieldError` otherwise."""
    if not isinstance(layers, Mapping) or (not layers and not allow_empty):
        raise InvalidFieldError("layers", layers,
                                "a non-empty mapping of layer name -> KVCacheSpec (attention-free models need no plan)")
    for name, spec in layers.items():
        if not isinstance(name, str) or not name:
            raise InvalidFieldError("layers", name, "non-empty str layer names")
        if not isinstance(spec, KVCacheSpec) or isinstance(spec, UniformTypeKVCacheSpecs):
            raise InvalidFieldError(f"layers[{name!r}]", spec, "a per-layer KVCacheSpec")
        if spec.uniform_type_base() is None:
            raise InvalidFieldError(
                f"layers[{name!r}]", type(spec).__name__,
                "a spec type vLLM 0.33.0 registers (EncoderOnlyAttentionSpec layers have no KV cache: leave them out)")
    return dict(layers)


def merge_specs(specs: list[KVCacheSpec]) -> KVCacheSpec:
    """The group spec of ``specs``: ``type(specs[0]).merge(specs)``, as vLLM calls it."""
    _check_specs("specs", specs, mapping=False)
    return type(specs[0]).merge(specs)


def is_kv_cache_spec_uniform(layers: Layers) -> bool:
    """Whether all layers merge into one spec.

    Only a plain merge failure means "no"; different window sizes on full-attention layers
    propagate (:class:`~kvref.spec.errors.WindowSizeMismatchError`), as vLLM's ``ValueError`` does.
    """
    layers = validate_layers(layers, allow_empty=True)
    if not layers:
        return True
    try:
        merge_specs(list(layers.values()))
    except SpecMergeError:
        return False
    return True


def _is_uniform_or_uniform_type(layers: Layers) -> bool:
    return is_kv_cache_spec_uniform(layers) or UniformTypeKVCacheSpecs.is_uniform_type(layers)


def _promoted_page_size_padded(spec: AttentionSpec, block_size: int) -> int | None:
    if spec.page_size_padded is None:
        return None
    return max(spec.page_size_padded, spec.unpadded_page_size_bytes * block_size // spec.block_size)


def promote_local_kv_cache_specs(layers: Layers) -> Layers:
    """Allocate sliding-window and chunked-local layers like full attention (compute unchanged).

    Only when full attention is present too; the promoted layers take the full-attention block
    size when that is unique and drop ``extra_retained_tokens``. The result must be uniform (or of
    one uniform type), else :class:`KVCacheGroupingError` (vLLM: "Failed to promote local KV cache
    specs to one unified type").
    """
    layers = validate_layers(layers, allow_empty=True)
    promoted = dict(layers)
    if _is_uniform_or_uniform_type(promoted):
        return promoted
    specs = list(promoted.values())
    has_full = any(isinstance(s, FullAttentionSpec) for s in specs)
    has_local = any(isinstance(s, (SlidingWindowSpec, ChunkedLocalAttentionSpec)) for s in specs)
    full_block_sizes = {s.block_size for s in specs if isinstance(s, FullAttentionSpec)}
    full_block_size = next(iter(full_block_sizes)) if len(full_block_sizes) == 1 else None
    if has_full and has_local:
        for name, spec in layers.items():
            if not isinstance(spec, (SlidingWindowSpec, ChunkedLocalAttentionSpec)):
                continue
            block_size = full_block_size or spec.block_size
            kwargs = {f.name: getattr(spec, f.name) for f in fields(spec)
                      if f.init and f.name != "extra_retained_tokens"}
            kwargs.update(block_size=block_size, page_size_padded=_promoted_page_size_padded(spec, block_size))
            promoted[name] = FullAttentionSpec(**kwargs)
    if not _is_uniform_or_uniform_type(promoted):
        raise KVCacheGroupingError(
            "Failed to promote local KV cache specs to one unified type (the hybrid KV cache manager "
            "is disabled, but these layers cannot share one group: "
            f"{sorted({type(s).__name__ for s in promoted.values()})}).")
    return promoted


def unify_hybrid_kv_cache_specs(layers: Layers) -> Layers:
    """``--disable-hybrid-kv-cache-manager``: promote local-attention layers, separately for
    DCP-replicated attention layers and for all others (vLLM partitions the same way)."""
    layers = validate_layers(layers, allow_empty=True)
    partitions: defaultdict[bool, Layers] = defaultdict(dict)
    for name, spec in layers.items():
        partitions[isinstance(spec, AttentionSpec) and not spec.dcp_sharded][name] = spec
    result = dict(layers)
    for part in partitions.values():
        promoted = promote_local_kv_cache_specs(part)
        if promoted != part:
            result.update(promoted)
    return result


class _PageSizeNotUnifiable(Exception):
    """An MLA (or other non-paddable) page does not divide the largest page."""


def unify_kv_cache_spec_page_size(layers: Layers) -> Layers:
    """Give every layer the largest page size.

    A smaller page that divides the largest one scales its ``block_size`` by the ratio; Mamba
    pages (independent of block size) and non-MLA attention pages that do not divide it are
    padded (``page_size_padded``). MLA pages that do not divide it cannot be unified.
    """
    layers = validate_layers(layers, allow_empty=True)
    page_sizes = {s.page_size_bytes for s in layers.values()}
    if len(page_sizes) <= 1:
        return layers
    max_page = max(page_sizes)
    unified: Layers = {}
    for name, spec in layers.items():
        page = spec.page_size_bytes
        if page == max_page:
            new = spec
        elif isinstance(spec, MambaSpec):
            new = replace(spec, page_size_padded=max_page)
        elif max_page % page == 0:
            try:
                new = replace(spec, block_size=spec.block_size * (max_page // page))
            except InvalidFieldError as exc:  # a padded page smaller than the scaled one (vLLM asserts)
                raise _PageSizeNotUnifiable(f"Layer {name}: {exc}") from None
        elif isinstance(spec, AttentionSpec) and not isinstance(spec, MLAAttentionSpec):
            new = replace(spec, page_size_padded=max_page)
        else:
            raise _PageSizeNotUnifiable(
                f"Layer {name}: page size {page} does not divide the largest page size {max_page} "
                "and cannot be padded (padding is only supported for non-MLA attention and Mamba layers)")
        if new.page_size_bytes != max_page:  # vLLM asserts; e.g. an MLA alignment that re-pads
            raise _PageSizeNotUnifiable(
                f"Layer {name}: page size {page} cannot be brought to the largest page size {max_page} "
                f"(got {new.page_size_bytes})")
        unified[name] = new
    return unified


def _full_allocation_fallback(layers: Layers) -> tuple[KVCacheGroupSpec, ...] | None:
    """MLA next to plain sliding-window layers whose pages cannot be unified: allocate the
    sliding-window layers like full attention, all layers in one uniform-type group."""
    specs = list(layers.values())
    if any(isinstance(s, ChunkedLocalAttentionSpec) for s in specs):
        return None
    if not (any(isinstance(s, MLAAttentionSpec) for s in specs)
            and any(isinstance(s, SlidingWindowSpec) for s in specs)):
        return None
    try:
        promoted = promote_local_kv_cache_specs(layers)
    except KVCacheGroupingError:
        return None
    uniform = UniformTypeKVCacheSpecs.from_specs(promoted)
    if uniform is None:
        return None
    return (KVCacheGroupSpec(tuple(uniform.kv_cache_specs), uniform),)


def group_size_for(layer_counts: list[int]) -> int:
    """Layers per group for hybrid models: the smallest type's layer count, unless the largest is
    below 1.5× of it, then the largest (fewer padding layers: 12 SWA + 13 full → groups of 13)."""
    if not isinstance(layer_counts, (list, tuple)) or not layer_counts or not all(type(n) is int and n >= 1 for n in layer_counts):
        raise InvalidFieldError("layer_counts", layer_counts, "a non-empty list of layer counts (ints >= 1)")
    smallest, largest = min(layer_counts), max(layer_counts)
    return largest if largest < smallest * 1.5 else smallest


def group_layers_with_uniform_page_size(layers: Layers) -> tuple[KVCacheGroupSpec, ...]:
    """Split hybrid layers (all pages equal) into groups of :func:`group_size_for` layers.

    Layers with equal specs form a bucket; a bucket joins an earlier one when their specs merge
    (e.g. full attention with and without a promoted window). Each bucket becomes
    ``cdiv(len, group_size)`` groups, layer ``i`` going to group ``i mod n`` (round robin, so that
    pipeline stages stay balanced); the last groups may be short (padding).
    """
    layers = validate_layers(layers, allow_empty=True)
    same_spec: dict[KVCacheSpec, list[str]] = {}
    for name, spec in layers.items():
        same_spec.setdefault(spec, []).append(name)
    name_buckets: list[list[str]] = []
    spec_buckets: list[list[KVCacheSpec]] = []
    for spec, names in same_spec.items():
        for bucket_names, bucket_specs in zip(name_buckets, spec_buckets):
            try:
                merge_specs([*bucket_specs, spec])
            except (SpecMergeError, KVCacheGroupingError):
                continue
            bucket_names.extend(names)
            bucket_specs.append(spec)
            break
        else:
            name_buckets.append(list(names))
            spec_buckets.append([spec])
    group_size = group_size_for([len(b) for b in name_buckets])
    grouped: list[list[str]] = []
    for names in name_buckets:
        num_groups = cdiv(len(names), group_size)
        grouped.extend(names[i::num_groups] for i in range(num_groups))
    return tuple(KVCacheGroupSpec(tuple(g), merge_specs([layers[n] for n in g])) for g in grouped)


def get_kv_cache_groups(layers: Layers, disable_hybrid_kv_cache_manager: bool = False) -> tuple[KVCacheGroupSpec, ...]:
    """Group ``layers`` (layer name → spec, in model order) the way vLLM 0.33.0 does.

    Raises :class:`KVCacheGroupingError` where vLLM's grouping fails on the same layers.
    """
    layers = validate_layers(layers, allow_empty=True)
    if not isinstance(disable_hybrid_kv_cache_manager, bool):
        raise InvalidFieldError("disable_hybrid_kv_cache_manager", disable_hybrid_kv_cache_manager, "True or False")
    if disable_hybrid_kv_cache_manager:
        layers = unify_hybrid_kv_cache_specs(layers)
    if not layers:
        return ()
    if is_kv_cache_spec_uniform(layers):
        return (KVCacheGroupSpec(tuple(layers), merge_specs(list(layers.values()))),)
    uniform = UniformTypeKVCacheSpecs.from_specs(layers)
    if uniform is not None:
        return (KVCacheGroupSpec(tuple(layers), uniform),)
    # hidden-state layers keep their own block table: grouped apart, aligned at the end
    attention, hidden = _split_hidden_state_layers(layers)
    if not attention:  # vLLM fails on min() of no buckets
        raise KVCacheGroupingError(f"hidden-state layers {sorted(hidden)} alone, with different specs")
    try:
        unified = unify_kv_cache_spec_page_size(attention)
    except _PageSizeNotUnifiable as exc:
        fallback = None if hidden else _full_allocation_fallback(layers)
        if fallback is None:
            raise KVCacheGroupingError(str(exc)) from None
        return fallback
    return _add_hidden_state_groups(group_layers_with_uniform_page_size(unified), hidden)


def check_exact_partition(groups: tuple[KVCacheGroupSpec, ...], layers: Layers) -> None:
    """Every layer in exactly one group (vLLM's ``_check_exact_partition``); AssertionError if not."""
    from .pool_sizing import validate_groups

    groups = tuple(validate_groups(groups))
    layers = validate_layers(layers, allow_empty=True)
    seen: set[str] = set()
    for g in groups:
        overlap = seen & set(g.layer_names)
        assert not overlap, f"KV cache groups overlap: {sorted(overlap)}"
        seen |= set(g.layer_names)
    missing = set(layers) - seen
    assert not missing, f"KV cache groups miss layers: {sorted(missing)}"
