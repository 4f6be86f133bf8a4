"""An out-of-tree secondary tier for vLLM's ``SecondaryTierFactory`` (``module_path`` config).

vLLM 0.33.0 ships no CPU-runnable tier that asks for the REQUEST_LEVEL offload policy (only the
P2P and KVCR tiers do, and they need peers or the ``kvcr`` library), yet the tiering manager's
request-level path (cascading chunks already in the primary tier, parking the ones still being
written, holding a request's finalization until they drain) is its own code. A user's out-of-tree
tier is how that path runs in production, so kvref loads one the same way:
``{"type": "RequestLevelTier", "module_path": "kvref.impl.vllm.tiering_tiers"}``. It is vLLM's
example tier with one change, its policy. The class subclasses vLLM's, so it is built when first
asked for (vLLM's factory does ``getattr(module, "RequestLevelTier")``, answered by the module
``__getattr__``): importing this module does not import vLLM (#26).
"""

from __future__ import annotations

_CLASSES: dict[str, type] = {}


def _request_level_tier() -> type:
    if not _CLASSES:
        from vllm.v1.kv_offload.base import OffloadPolicy, RequestOffloadingContext
        from vllm.v1.kv_offload.tiering.example.manager import ExampleSecondaryTierManager

        class RequestLevelTier(ExampleSecondaryTierManager):
            """vLLM's in-memory example tier asking for request-level offloading for every request."""

            def on_new_request(self, req_context) -> RequestOffloadingContext:
                return RequestOffloadingContext(policy=OffloadPolicy.REQUEST_LEVEL)

        RequestLevelTier.__qualname__ = "RequestLevelTier"
        _CLASSES["RequestLevelTier"] = globals()["RequestLevelTier"] = RequestLevelTier
    return _CLASSES["RequestLevelTier"]


def __getattr__(name: str) -> type:
    if name == "RequestLevelTier":
        return _request_level_tier()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
