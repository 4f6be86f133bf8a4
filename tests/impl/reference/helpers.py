"""Small builders shared by the reference's unit tests."""

from __future__ import annotations

import math

from kvref.impl.interface import PoolConfig
from kvref.spec.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)


def fa(bs: int) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype="float32")


def swa(bs: int, window: int, extra: int = 0) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype="float32",
                             sliding_window=window, extra_retained_tokens=extra)


def local(bs: int, chunk: int) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype="float32",
                                     attention_chunk_size=chunk)


def cross(bs: int) -> CrossAttentionSpec:
    return CrossAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype="float32")


def mamba(bs: int, mode: str = "align", spec_blocks: int = 0) -> MambaSpec:
    return MambaSpec(block_size=bs, shapes=((2,),), dtypes=("float32",), mamba_cache_mode=mode,
                     num_speculative_blocks=spec_blocks)


def config(specs, num_blocks: int = 64, caching: bool = True, hbs: int | None = None, **kw) -> PoolConfig:
    sizes = [s.block_size for s in specs]
    sbs = math.lcm(*sizes)
    if hbs is None:
        hbs = sbs if (not caching or len(specs) == 1) else math.gcd(*sizes)
    groups = tuple(KVCacheGroupSpec((f"l{i}",), s) for i, s in enumerate(specs))
    return PoolConfig(num_blocks=num_blocks, groups=groups, max_model_len=kw.pop("max_model_len", 4096),
                      scheduler_block_size=sbs, hash_block_size=hbs, enable_caching=caching, **kw)
