"""kvref.spec — the *what*: KV cache specs, per-request bounds and startup pool sizing.

Pure functions and frozen dataclasses, stdlib only, no state (the layering is in the README).
"""

from .config import AUTO, EngineConfig
from .dtypes import DTYPE_SIZES, canonical_dtype, get_dtype_size
from .errors import (
    InsufficientKVCacheError,
    InvalidFieldError,
    KVCacheGroupingError,
    KVRefError,
    SpecMergeError,
    WindowSizeMismatchError,
)
from .kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    HiddenStateCacheSpec,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    has_admission_cap,
)
from .mathutil import cdiv, round_down, round_up
from .block_sizes import resolve_kv_cache_block_sizes
from .grouping import get_kv_cache_groups
from .planning import GroupPlan, KVCachePlan, plan_kv_cache
from .pool_sizing import pool_bytes_per_block

__all__ = [
    "AUTO", "EngineConfig", "DTYPE_SIZES", "canonical_dtype", "get_dtype_size",
    "InsufficientKVCacheError", "InvalidFieldError", "KVRefError", "KVCacheGroupingError", "SpecMergeError",
    "WindowSizeMismatchError",
    "AttentionSpec", "ChunkedLocalAttentionSpec", "CrossAttentionSpec", "EncoderOnlyAttentionSpec",
    "FullAttentionSpec", "HiddenStateCacheSpec", "KVCacheGroupSpec", "KVCacheSpec", "MambaSpec", "MLAAttentionSpec",
    "SlidingWindowSpec", "UniformTypeKVCacheSpecs", "has_admission_cap",
    "cdiv", "round_down", "round_up",
    "GroupPlan", "KVCachePlan", "plan_kv_cache", "get_kv_cache_groups", "pool_bytes_per_block",
    "resolve_kv_cache_block_sizes",
]
