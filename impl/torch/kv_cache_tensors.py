"""Real KV cache memory: per-layer K/V views over backing tensors shared by the groups.

Layout, as vLLM's ``KVCacheTensor`` describes it: layer ``l`` of every group lives in backing
tensor ``l`` (groups *alias* the same bytes; sound because a block id belongs to one group at a
time), and a layer's page for block ``b`` starts at ``b * block_stride`` where ``block_stride`` is
the largest page among the groups (smaller pages are padded, like ``page_size_padded``). An
attention layer's page is ``[2, block_size, num_kv_heads, head_size]`` (K then V); a Mamba
layer's page holds its state tensor. Block 0 (the null block) is real memory that nothing
should read unmasked.

Because groups alias, a bookkeeping fault that hands a block to two owners shows up as corrupted
numbers in *another* group's attention, not only in its own.
"""

from __future__ import annotations

from math import prod

import torch

from kvref.spec.errors import InvalidFieldError, check_int
from kvref.spec.kv_cache_interface import AttentionSpec, KVCacheGroupSpec, MambaSpec

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float64": torch.float64}


def page_elems(spec, dtype: torch.dtype) -> int:
    """Elements of one block of one layer (in ``dtype`` units)."""
    if isinstance(spec, AttentionSpec):
        return 2 * spec.block_size * spec.num_kv_heads * spec.head_size
    if isinstance(spec, MambaSpec):
        return sum(prod(s) for s in spec.shapes)
    raise InvalidFieldError("kv_cache_spec", type(spec).__name__, "an AttentionSpec or a MambaSpec")


#: layers of one cache at most (a backing tensor each; real models have a few hundred)
MAX_LAYERS = 4096


class KVCacheTensors:
    """Backing memory for ``num_blocks`` blocks of every group, ``num_layers`` layers per group.

    Args:
        groups: the pool's KV cache groups.
        num_blocks: blocks in the pool (block 0 included).
        num_layers: layers per group (all groups get the same count; layer ``l`` of each group
            aliases backing tensor ``l``).
        dtype: element type of the data path (``None``: the first attention spec's dtype). On CPU,
            ``torch.float64`` makes attention checks near exact.
        device: where the cache lives.
    """

    def __init__(self, groups: tuple[KVCacheGroupSpec, ...], num_blocks: int, num_layers: int = 1,
                 dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> None:
        from kvref.impl.interface import MAX_NUM_BLOCKS

        from .block_pool import as_device

        check_int("num_blocks", num_blocks, minimum=1)
        if num_blocks > MAX_NUM_BLOCKS:
            raise InvalidFieldError("num_blocks", num_blocks, f"an int in [1, {MAX_NUM_BLOCKS}]")
        check_int("num_layers", num_layers, minimum=1)
        if num_layers > MAX_LAYERS:
            raise InvalidFieldError("num_layers", num_layers, f"an int in [1, {MAX_LAYERS}]")
        if not isinstance(groups, (tuple, list)) or not groups \
                or not all(isinstance(g, KVCacheGroupSpec) for g in groups):
            raise InvalidFieldError("groups", groups, "at least one KV cache group (a tuple of KVCacheGroupSpec)")
        device = as_device("device", device)
        if dtype is None:
            first = next((g.kv_cache_spec for g in groups if isinstance(g.kv_cache_spec, AttentionSpec)), None)
            dtype = TORCH_DTYPES[first.dtype] if first is not None else torch.float32
        if dtype not in TORCH_DTYPES.values():
            raise InvalidFieldError("dtype", dtype, "torch.float32, float16, bfloat16 or float64")
        self.groups = tuple(groups)
        self.num_blocks = num_blocks
        self.num_layers = num_layers
        self.dtype = dtype
        self.device = torch.device(device)
        self.block_stride = max(page_elems(g.kv_cache_spec, dtype) for g in groups)
        #: backing[l]: [num_blocks, block_stride], shared by layer l of every group
        self.backing = [torch.zeros((num_blocks, self.block_stride), dtype=dtype, device=self.device)
                        for _ in range(num_layers)]

    def kv(self, group_id: int, layer: int) -> torch.Tensor:
        """``[num_blocks, 2, block_size, num_kv_heads, head_size]`` view of one attention layer."""
        spec = self._spec(group_id, AttentionSpec)
        shape = (self.num_blocks, 2, spec.block_size, spec.num_kv_heads, spec.head_size)
        return self._view(layer, shape)

    def state(self, group_id: int, layer: int) -> torch.Tensor:
        """``[num_blocks, *shape]`` view of a Mamba layer's (first) state tensor."""
        spec = self._spec(group_id, MambaSpec)
        return self._view(layer, (self.num_blocks, *spec.shapes[0]))

    def _spec(self, group_id: int, cls):
        check_int("group_id", group_id, minimum=0)
        if group_id >= len(self.groups):
            raise InvalidFieldError("group_id", group_id, f"< {len(self.groups)}")
        spec = self.groups[group_id].kv_cache_spec
        if not isinstance(spec, cls):
            raise InvalidFieldError("group_id", group_id, f"a group with a {cls.__name__}")
        return spec

    def _view(self, layer: int, shape: tuple[int, ...]) -> torch.Tensor:
        check_int("layer", layer, minimum=0)
        if layer >= self.num_layers:
            raise InvalidFieldError("layer", layer, f"< {self.num_layers}")
        base = self.backing[layer]
        inner = prod(shape[1:])
        strides = [self.block_stride]
        acc = inner
        for d in shape[1:]:
            acc //= d
            strides.append(acc)
        return base.as_strided(shape, tuple(strides))

    def write_kv(self, group_id: int, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V at their slots (``slot = block * block_size + offset``).

        ``k``/``v``: ``[T, num_kv_heads, head_size]``; ``slots``: ``[T]`` int.
        """
        cache = self.kv(group_id, layer)
        bs = cache.shape[2]
        want = (slots.shape[0], *cache.shape[3:])
        if slots.dim() != 1 or tuple(k.shape) != want or tuple(v.shape) != want:
            raise InvalidFieldError("k/v", (tuple(k.shape), tuple(v.shape)), f"[T, Hkv, D] = {want} matching slots [T]")
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= self.num_blocks * bs):
            raise InvalidFieldError("slots", "out of range", f"slots in [0, {self.num_blocks * bs})")
        slots = slots.to(self.device).long()
        blk = torch.div(slots, bs, rounding_mode="floor")
        off = slots % bs
        cache[blk, 0, off] = k.to(self.dtype)
        cache[blk, 1, off] = v.to(self.dtype)
