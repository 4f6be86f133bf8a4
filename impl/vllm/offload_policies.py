"""vLLM's CPU-tier cache policies (LRU, ARC, an out-of-tree one) driven call by call (#22).

The offloading manager only reaches the parts of a policy its traces happen to produce (ARC's
``touch`` of a ready T1 chunk, LRU's heap rebuild after >= 64 recency updates, the removal of a
T2 chunk, ``evict(0)``, the base class's per-group ``on_request_finished``). This adapter lets a
machine call vLLM's policy classes directly, resolved the way vLLM resolves them — by name
through ``CachePolicyFactory`` — and read back what the reference policies expose, so every
operation of a generated sequence is compared (``kvref.models.machines.offload_policies``).

:class:`TouchPerGroupLRUCachePolicy` is an *out-of-tree* policy in vLLM's sense: not registered,
found by class name and module path (``get_cache_policy_cls(name, module_path)``, the
``cache_policy_module_path`` route), and it keeps the base class's compatibility
``on_request_finished`` (one ``touch`` per KV cache group) instead of LRU's head-to-tail commit.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

OUT_OF_TREE_MODULE = __name__


def __getattr__(name: str) -> Any:
    """``TouchPerGroupLRUCachePolicy`` — vLLM's LRU with the base ``CachePolicy.on_request_finished``
    (a touch per group) — built on first access (vLLM's factory reads it by name from this module),
    so importing this module does not import vLLM (tests/impl/vllm/test_lazy_imports.py)."""
    if name != "TouchPerGroupLRUCachePolicy":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from vllm.v1.kv_offload.cpu.policies.base import CachePolicy
    from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

    cls = type(name, (LRUCachePolicy,), {"on_request_finished": CachePolicy.on_request_finished,
                                         "__module__": __name__, "__doc__": __getattr__.__doc__})
    globals()[name] = cls
    return cls


def _factory() -> Any:
    from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

    return CachePolicyFactory


def policy_class(name: str, module_path: str | None = None) -> type:
    """The class vLLM's factory resolves for ``name`` (registered, or out-of-tree from a module)."""
    return _factory().get_cache_policy_cls(name, module_path)


def register_policy(name: str, module_path: str, class_name: str) -> None:
    """vLLM's ``register_cache_policy`` (refuses a taken name with ValueError)."""
    _factory().register_cache_policy(name, module_path, class_name)


def registered_policies() -> list[str]:
    return sorted(_factory()._registry)


class VllmPolicy:
    """One vLLM policy object plus the ChunkStatus structs it holds, with the reference's surface."""

    def __init__(self, name: str, cache_capacity: int, module_path: str | None = None) -> None:
        self.policy = policy_class(name, module_path)(cache_capacity)
        self.kind = "arc" if hasattr(self.policy, "t1") else "lru"

    @staticmethod
    def new_context(req_id: str, positions: dict[bytes, int]) -> Any:
        from vllm.v1.kv_offload.base import ReqContext

        ctx = ReqContext(req_id=req_id)
        for key, pos in positions.items():
            ctx.set_offload_key_position(key, pos)
        return ctx

    @staticmethod
    def new_chunk(chunk_id: int, ref_cnt: int) -> Any:
        from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus

        chunk = ChunkStatus(chunk_id)
        chunk.ref_cnt = ref_cnt
        return chunk

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.policy, method)(*args)

    def get(self, key: bytes) -> tuple[int, int] | None:
        chunk = self.policy.get(key)
        return None if chunk is None else (int(chunk.chunk_id), int(chunk.ref_cnt))

    def evict(self, n: int, protected: set[bytes]) -> list[tuple[bytes, int]] | None:
        out = self.policy.evict(n, protected)
        return None if out is None else [(key, int(chunk.chunk_id)) for key, chunk in out]

    def touch(self, keys: Iterable[bytes], ctx: Any) -> None:
        self.policy.touch(keys, ctx)

    def on_request_finished(self, groups: Sequence[Sequence[bytes]], insertion_only: set[bytes],
                            reused: set[bytes], ctx: Any) -> None:
        self.policy.on_request_finished(groups, insertion_only, reused, ctx)

    def observe(self) -> dict[str, Any]:
        """ARC: the four lists in order and the target; LRU: ranks and the evictable set."""
        p = self.policy
        if self.kind == "arc":
            return {"t1": list(p.t1), "t2": list(p.t2), "b1": list(p.b1), "b2": list(p.b2),
                    "target": float(p.target_t1_size)}
        return {"ranks": dict(p._ranks), "evictable": set(p._evictable), "resident": set(p.chunks)}
