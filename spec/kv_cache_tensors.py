"""Where every layer's KV bytes live: the planned ``KVCacheConfig.kv_cache_tensors`` of vLLM 0.33.0.

After sizing the pool, vLLM's ``get_kv_cache_config_from_groups`` (``v1/core/kv_cache_planning.py``)
tells each worker how to carve its one backing allocation of ``bytes_per_block × num_blocks`` bytes
into per-layer views: one ``KVCacheTensor`` per run of identical layer specs in a group, with a
byte ``offset`` and the ``layer_stride`` / ``block_stride`` vLLM's ``compute_layout_strides``
(``v1/kv_cache_interface.py``) derives from the resolved ``KVCacheLayout`` (RFC vllm#42082). The
worker reads layer ``layers[l]``'s page of block ``b`` at ``offset + l * layer_stride +
b * block_stride``. A wrong offset or stride does not show in any block count: the worker just
reads and writes another layer's bytes, so kvref plans the tensors too and conform-planning compares
them with vLLM's field by field (the generated fault ``gen.kv_cache_planning.706.inc``, #22).

Rules, in vLLM's order:

1. every group aliases the whole allocation from byte 0 (a block id is owned by one group at a
   time), so every tensor's ``size`` is ``bytes_per_block × num_blocks``;
2. a group's layers split into runs of equal specs, in first-appearance order (a plain group is one
   run; a packed :class:`~kvref.spec.kv_cache_interface.UniformTypeKVCacheSpecs` group one run per
   distinct layer spec, in its ``kv_cache_specs`` order);
3. each run's strides follow the layout's physical order of the logical axes ``[L, B, H, N, C]``
   (a page is ``H`` heads × ``N`` tokens × ``C`` bytes; a Mamba state is one head and one "token"
   of the whole state), innermost first; a padded page (``page_size_padded``) widens the stride of
   the innermost of ``L``/``B`` to the padded size; under a block-outermost layout the block stride
   is fixed to ``bytes_per_block`` (all groups' pages of one block sit side by side);
4. the next run of the group starts after this one: ``len(layers) × page`` bytes later under a
   block-outermost layout (it shares every block), ``len(layers) × layer_stride`` under a
   layer-outermost one (it owns whole regions).

kvref's specs carry no ``block_stride_alignment`` (docs/differences.md), so a layer-outermost block
stride is never padded beyond the page and bytes per block need no rounding; HiSparse pools are
laid out by :mod:`kvref.spec.planning_hisparse`.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Iterable

from .errors import InvalidFieldError, check_int
from .kv_cache_interface import AttentionSpec, KVCacheGroupSpec, KVCacheSpec, MambaSpec, UniformTypeKVCacheSpecs
from .planning_packed import KV_CACHE_LAYOUTS, check_layout, is_block_outermost
from .pool_sizing import pool_bytes_per_block, validate_groups

#: vLLM's logical axes of the 5D view: layer, block, head, token (state), content bytes
DIM_L, DIM_B, DIM_H, DIM_N, DIM_C = range(5)


@dataclass(frozen=True)
class KVCacheTensor:
    """vLLM's ``KVCacheTensor`` (same field names): one run of equal-spec layers in the allocation.

    Layer ``layers[l]``'s page of block ``b`` starts ``offset + l * layer_stride + b * block_stride``
    bytes into the backing allocation of ``size`` bytes. ``host_resident`` is vLLM's flag for a
    HiSparse host pool; a plain plan's tensors are all device-resident.
    """

    size: int
    layers: tuple[str, ...]
    layer_stride: int
    block_stride: int
    offset: int = 0
    host_resident: bool = False


def page_shape(spec: KVCacheSpec) -> tuple[int, int, int]:
    """``(H, N, C)`` of one page of ``spec``: vLLM's ``compute_layer_kv_cache_shape_bytes`` after the
    block axis (``num_heads``, ``get_num_kernel_states(block_size)``, ``state_content_size_bytes``).

    An attention page is ``num_kv_heads`` heads × ``block_size`` tokens × the per-(head, token) bytes
    (kvref has no ``num_head_slots`` and one state per token); a Mamba page is one head × one state ×
    the whole unpadded state (vLLM's ``MambaSpec.num_heads = 1``, ``tokens_per_state = -1``).
    """
    if isinstance(spec, AttentionSpec):
        return spec.num_kv_heads, spec.block_size, spec.state_content_size_bytes
    if isinstance(spec, MambaSpec):
        return 1, 1, spec.unpadded_page_size_bytes
    raise InvalidFieldError("kv_cache_spec", type(spec).__name__,
                            "an attention or Mamba layer spec (HiSparse pools: kvref.spec.planning_hisparse)")


def layout_strides(spec: KVCacheSpec, num_blocks: int, num_layers: int, kv_cache_layout: str, *,
                   block_stride: int | None = None) -> tuple[int, int, int, int, int]:
    """Byte strides of ``num_layers`` layers of ``spec`` over ``num_blocks`` blocks, in logical
    ``[L, B, H, N, C]`` order: vLLM's ``compute_layout_strides`` without kernel-block splitting.

    Strides grow from the innermost physical axis outwards (each is the previous one times the
    previous axis's length); ``block_stride`` fixes the block axis (what vLLM passes as
    ``fixed_strides[B]``); a padded page rounds the stride of the innermost of ``L``/``B`` up to
    ``page_size_padded``, which needs every axis outside the page to be ``L``, ``B`` or of length 1.

    Raises:
        InvalidFieldError: bad input (``kv_cache_spec``, ``num_blocks``, ``num_layers``,
            ``kv_cache_layout``, ``block_stride``), or a padded page with several heads under a
            layout that stores heads outside the page (``kv_cache_layout``; vLLM asserts there).
    """
    check_int("num_blocks", num_blocks, minimum=1)
    check_int("num_layers", num_layers, minimum=1)
    order = KV_CACHE_LAYOUTS[check_layout(kv_cache_layout)]
    check_int("block_stride", block_stride, minimum=1, allow_none=True)
    shape = (num_layers, num_blocks, *page_shape(spec))
    padded = getattr(spec, "page_size_padded", None)
    grid_end = max(order.index(DIM_L), order.index(DIM_B)) + 1
    if padded is not None and prod(shape[d] for d in order[:grid_end]) != num_layers * num_blocks:
        raise InvalidFieldError("kv_cache_layout", kv_cache_layout,
                                f"a layout with L and B outside the page for a padded page of {shape[DIM_H]} heads")
    strides = [0] * 5
    current = 1
    for physical in reversed(range(5)):
        dim = order[physical]
        if padded is not None and physical == grid_end - 1:
            # the inner bytes are the unpadded page here (<= page_size_padded, which the spec checks)
            current = max(current, padded)
        strides[dim] = block_stride if dim == DIM_B and block_stride is not None else current
        current = strides[dim] * shape[dim]
    return strides[0], strides[1], strides[2], strides[3], strides[4]


def _spec_runs(group: KVCacheGroupSpec) -> list[tuple[KVCacheSpec, list[str]]]:
    """vLLM's ``layers_by_spec``: the group's layers by equal spec, in first-appearance order."""
    spec = group.kv_cache_spec
    runs: dict[KVCacheSpec, list[str]] = {}
    if isinstance(spec, UniformTypeKVCacheSpecs):
        for name, layer in spec.kv_cache_specs.items():
            runs.setdefault(layer, []).append(name)
    elif group.layer_names:
        runs[spec] = list(group.layer_names)
    return list(runs.items())


def kv_cache_tensors(groups: Iterable[KVCacheGroupSpec], num_blocks: int,
                     kv_cache_layout: str) -> tuple[KVCacheTensor, ...]:
    """The ``kv_cache_tensors`` vLLM 0.33.0 plans for ``groups`` (the worker's groups, in order) in a
    pool of ``num_blocks`` blocks under ``kv_cache_layout``; empty for an attention-free model.

    Raises:
        InvalidFieldError: bad input (``groups``, ``num_blocks``, ``kv_cache_layout``), a spec without
            a page shape (``kv_cache_spec``), or a layout that cannot lay out a padded page.
    """
    groups = validate_groups(groups)
    check_int("num_blocks", num_blocks, minimum=1)
    check_layout(kv_cache_layout)
    if not groups:
        return ()
    bytes_per_block = pool_bytes_per_block(groups)
    if bytes_per_block <= 0:
        raise InvalidFieldError("groups", [g.layer_names for g in groups], "groups with at least one layer")
    size = bytes_per_block * num_blocks
    block_outermost = is_block_outermost(kv_cache_layout)
    tensors: list[KVCacheTensor] = []
    for group in groups:
        offset = 0
        for spec, names in _spec_runs(group):
            layer_stride, block_stride, *_ = layout_strides(
                spec, num_blocks, len(names), kv_cache_layout,
                block_stride=bytes_per_block if block_outermost else None)
            tensors.append(KVCacheTensor(size, tuple(names), layer_stride, block_stride, offset))
            # block-outermost runs share every block; layer-outermost ones own whole regions
            offset += len(names) * (spec.page_size_bytes if block_outermost else layer_stride)
    return tuple(tensors)


def check_kv_cache_tensors(groups: Iterable[KVCacheGroupSpec], num_blocks: int, kv_cache_layout: str,
                           tensors: Iterable[KVCacheTensor]) -> None:
    """The placement guarantees a worker relies on (AssertionError when one is broken): every layer
    of every group in exactly one tensor, one allocation size, and every byte a tensor's view
    addresses inside the allocation (no page starts before byte 0 or ends past ``size``)."""
    groups = validate_groups(groups)
    tensors = list(tensors)
    layers = [n for g in groups for n in g.layer_names]
    placed = [n for t in tensors for n in t.layers]
    assert sorted(placed) == sorted(layers), (placed, layers)
    specs = {n: (g.kv_cache_spec.kv_cache_specs[n] if isinstance(g.kv_cache_spec, UniformTypeKVCacheSpecs)
                 else g.kv_cache_spec) for g in groups for n in g.layer_names}
    assert len({t.size for t in tensors}) <= 1, [t.size for t in tensors]
    for i, t in enumerate(tensors):
        assert t.layers, f"kv_cache_tensors[{i}] places no layer"
        spec = specs[t.layers[0]]
        _, _, h, n, _ = layout_strides(spec, num_blocks, len(t.layers), kv_cache_layout,
                                       block_stride=t.block_stride)
        heads, states, content = page_shape(spec)
        # C is innermost under every layout (stride 1): the view's last byte ends this far in
        end = (t.offset + (len(t.layers) - 1) * t.layer_stride + (num_blocks - 1) * t.block_stride
               + (heads - 1) * h + (states - 1) * n + content)
        assert t.offset >= 0 and end <= t.size, f"kv_cache_tensors[{i}] addresses bytes {t.offset}..{end} of {t.size}"
