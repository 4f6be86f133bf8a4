"""vLLM's per-manager ``reachable_block_mask`` (issue #22/#23): which full blocks a manager
publishes to the prefix cache, and which blocks the offloading connector stores.

The engine only ever passes its scheduler block size as the alignment, so paths that other callers
take stay dark in an engine run: no alignment at all and a sub-block alignment (hybrid offloading,
where the alignment is the full-attention chunk size), decode context parallelism (wider blocks) and
the offloading connector's ``final_segment_end_block`` (the last, partial segment of a finished
request). This adapter calls vLLM's classmethod by keyword with exactly those arguments, so the
conformance check can compare it with the reference's on generated inputs; it adds nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvref.spec.errors import InvalidFieldError
from kvref.spec.kv_cache_interface import KVCacheSpec

from kvref.impl.vllm.loader import load_vllm
from kvref.impl.vllm.specs import to_vllm_spec

#: kvref manager kind -> vLLM 0.33.0's manager class name
MANAGER_CLASSES = {"full": "FullAttentionManager", "sliding_window": "SlidingWindowManager", "mamba": "MambaManager"}


def vllm_reachable_block_mask(kind: str, start_block: int, end_block: int, alignment_tokens: int | None,
                              kv_cache_spec: KVCacheSpec, use_eagle: bool, retention_interval: int | None,
                              reachable_boundaries: Sequence[int], dcp_world_size: int,
                              final_segment_end_block: int | None) -> list[bool] | None:
    """vLLM's ``<Manager>.reachable_block_mask`` for the kvref spec (None: every block is kept)."""
    if kind not in MANAGER_CLASSES:
        raise InvalidFieldError("kind", kind, f"one of {sorted(MANAGER_CLASSES)}")
    load_vllm()
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, MambaManager, SlidingWindowManager

    cls = {"full": FullAttentionManager, "sliding_window": SlidingWindowManager, "mamba": MambaManager}[kind]
    return cls.reachable_block_mask(start_block=start_block, end_block=end_block, alignment_tokens=alignment_tokens,
                                    kv_cache_spec=to_vllm_spec(kv_cache_spec), use_eagle=use_eagle,
                                    retention_interval=retention_interval,
                                    reachable_boundaries=list(reachable_boundaries), dcp_world_size=dcp_world_size,
                                    final_segment_end_block=final_segment_end_block)
