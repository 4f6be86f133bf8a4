"""kvref's second, independent implementation: KV-cache bookkeeping in tensors, real K/V data.

``make_manager(pool_config, device=None)`` builds a :class:`TorchKVCacheManager` (CUDA when
present, else CPU). The data path lives in :mod:`.kv_cache_tensors`, :mod:`.paged_attention`,
:mod:`.mamba_state` and :mod:`.offload_copy`; its hot operations (K/V write, paged attention,
block copies) also as Triton kernels in :mod:`.triton_kernels` (optional: ``attention_backend=
"triton"`` / ``OffloadCopier(backend="triton")``; needs triton, interpreted on CPU).
"""

from __future__ import annotations

from kvref.impl.interface import PoolConfig

from .manager import TorchKVCacheManager, resolve_device

__all__ = ["TorchKVCacheManager", "make_manager", "resolve_device"]


def make_manager(pool_config: PoolConfig, device=None) -> TorchKVCacheManager:
    """Factory for the shared ``make_manager(kind, pool_config)``: register it as kind ``"torch"``."""
    return TorchKVCacheManager(pool_config, device=device)
