"""kvref.spec — the *what*: KV cache specs, per-request bounds and startup pool sizing.

Pure functions and frozen dataclasses, stdlib only, no state (see shared/design/ARCHITECTURE.md).
"""

from .config import AUTO, EngineConfig
from .dtypes import DTYPE_SIZES, canonical_dtype, get_dtype_size
from .errors import InsufficientKVCacheError, InvalidFieldError, KVRefError
from .kv_cache_interface import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    has_admission_cap,
)
from .mathutil import cdiv, round_down, round_up

__all__ = [
    "AUTO", "EngineConfig", "DTYPE_SIZES", "canonical_dtype", "get_dtype_size",
    "InsufficientKVCacheError", "InvalidFieldError", "KVRefError",
    "AttentionSpec", "ChunkedLocalAttentionSpec", "CrossAttentionSpec", "EncoderOnlyAttentionSpec",
    "FullAttentionSpec", "KVCacheGroupSpec", "KVCacheSpec", "MambaSpec", "MLAAttentionSpec",
    "SlidingWindowSpec", "UniformTypeKVCacheSpecs", "has_admission_cap",
    "cdiv", "round_down", "round_up",
]
