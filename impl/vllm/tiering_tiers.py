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


class TierShutdownError(RuntimeError):
    """What the shutdown of a tier built with ``fail_shutdown`` set raises (a third-party tier
    whose teardown fails: vLLM must still shut the other tiers down and keep the primary memory)."""


def _shutdown(tier, base) -> None:
    base.shutdown(tier)
    if tier.fail_shutdown:
        raise TierShutdownError(f"kvref: tier {tier.tier_type}: shutdown failed (injected)")


def _request_level_tier() -> type:
    if "RequestLevelTier" not in _CLASSES:
        from vllm.v1.kv_offload.base import OffloadPolicy, RequestOffloadingContext
        from vllm.v1.kv_offload.tiering.example.manager import ExampleSecondaryTierManager

        class RequestLevelTier(ExampleSecondaryTierManager):
            """vLLM's in-memory example tier asking for request-level offloading for every request."""

            fail_shutdown = False  # set by a trace: shutdown raises TierShutdownError

            def __init__(self, *args, fail_shutdown: bool = False, **kwargs) -> None:
                """``fail_shutdown`` (a tier config key): the tier's shutdown raises."""
                super().__init__(*args, **kwargs)
                self.fail_shutdown = fail_shutdown

            def on_new_request(self, req_context) -> RequestOffloadingContext:
                return RequestOffloadingContext(policy=OffloadPolicy.REQUEST_LEVEL)

            def shutdown(self) -> None:
                _shutdown(self, ExampleSecondaryTierManager)

        RequestLevelTier.__qualname__ = "RequestLevelTier"
        _CLASSES["RequestLevelTier"] = globals()["RequestLevelTier"] = RequestLevelTier
    return _CLASSES["RequestLevelTier"]


def _polled_tier() -> type:
    if "PolledTier" not in _CLASSES:
        from vllm.v1.kv_offload.base import LookupResult, ReqContext
        from vllm.v1.kv_offload.tiering.base import JobResult
        from vllm.v1.kv_offload.tiering.example.manager import ExampleSecondaryTierManager

        class PolledTier(ExampleSecondaryTierManager):
            """vLLM's example tier serving a peer, opted into the tier-poll thread: a peer's key
            request (:meth:`peer_request`) is served at the next round through the parent, whose
            HITs are pinned by ``create_store_job`` and released at the next poll (the peer reads
            at once), as vLLM's KVCR tier serves framework pins."""

            tolerates_off_thread_polling = True
            fail_shutdown = False  # set by a trace: shutdown raises TierShutdownError

            def shutdown(self) -> None:
                _shutdown(self, ExampleSecondaryTierManager)

            def __init__(self, *args, **kwargs) -> None:
                super().__init__(*args, **kwargs)
                self.peer_requests: list[tuple] = []
                self.served = 0

            def peer_request(self, keys) -> None:
                self.peer_requests.append(tuple(keys))

            serve_calls = 0  # serve_external_requests calls (tier-poll rounds and step ends)
            fail_serve = False  # set by a tier-poll program: serving raises (a transport error, say)
            #: set by a tier-poll program: (entered, release) events; serving blocks until released
            hang = None

            def serve_external_requests(self, parent) -> None:
                self.serve_calls += 1
                if self.hang is not None:
                    entered, release = self.hang
                    self.hang = None
                    entered.set()
                    release.wait()
                if self.fail_serve:
                    raise RuntimeError(f"kvref: tier {self.tier_type}: serving failed (injected)")
                pending, self.peer_requests = self.peer_requests, []
                for keys in pending:
                    ctx = ReqContext(req_id=f"peer:{self.served}")
                    self.served += 1
                    parent.on_new_request(ctx)
                    for key in keys:  # pin each HIT at once: a later key's promotion may evict it
                        if parent.lookup(key, ctx) is LookupResult.HIT:
                            job = parent.create_store_job([key], ctx)
                            self.completed_jobs.append(JobResult(job_id=job.job_id, success=True))
                    parent.on_request_finished(ctx)

        PolledTier.__qualname__ = "PolledTier"
        _CLASSES["PolledTier"] = globals()["PolledTier"] = PolledTier
    return _CLASSES["PolledTier"]


def __getattr__(name: str) -> type:
    if name == "PolledTier":
        return _polled_tier()
    if name == "RequestLevelTier":
        return _request_level_tier()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
