"""pytest plugin: vLLM's ``KVCacheManager`` replaced by kvref's reference (issue #23's "done when").

Loaded with ``-p kvref_standin`` into a pytest run of vLLM 0.33.0's own, unmodified
``tests/v1/core`` (see ``run_v1core.py`` beside it). At ``pytest_configure`` -- before vLLM's test
modules are imported -- ``vllm.v1.core.kv_cache_manager.KVCacheManager`` and the name vLLM's
``Scheduler`` imported are bound to :class:`StandInKVCacheManager`, so every test that builds a KV
cache manager (directly or through vLLM's ``Scheduler``) runs kvref's
``kvref.impl.reference.kv_cache_manager.KVCacheManager`` instead of vLLM's.

The stand-in only translates at the boundary; every decision is the reference's:

* vLLM's ``KVCacheConfig`` -> kvref's ``PoolConfig`` (each spec becomes the kvref spec class of the
  same name, field by field; torch dtypes become dtype names);
* vLLM's ``Request`` -> a kvref ``Request`` mirror per request id, re-synchronised (tokens,
  computed tokens, status, preemptions) before every call; the block hashes the reference reads
  are the vLLM request's own ``block_hashes`` (vLLM's ``KVCacheManager`` reads them the same way);
* kvref ``KVCacheBlocks`` <-> vLLM ``KVCacheBlocks`` (the container only; the blocks inside are the
  reference's ``KVCacheBlock`` objects, whose attributes carry vLLM's names);
* kvref KV events and prefix-cache stats -> vLLM's dataclasses of the same names and fields.

What the reference does not model raises :class:`StandInGap` with a ``kvref stand-in: <feature>``
message, so the runner can group failures by the missing feature. Which tests built a stand-in is
written to ``$KVREF_STANDIN_USAGE`` (JSON: node id -> number of managers built).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import pytest

_USAGE: dict[str, int] = {}
_BUILT = [0]


class StandInGap(NotImplementedError):
    """A vLLM feature the reference does not model (the message names it)."""

    def __init__(self, feature: str) -> None:
        super().__init__(f"kvref stand-in: {feature}")


# ---------------------------------------------------------------------------------------- specs


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _to_kvref_spec(vspec: Any) -> Any:
    """The kvref spec of the same class name as a vLLM spec, with the fields both have."""
    from kvref.spec import hisparse, kv_cache_interface

    name = type(vspec).__name__
    cls = getattr(kv_cache_interface, name, None) or getattr(hisparse, name, None)
    if cls is None:
        raise StandInGap(f"KV cache spec {name}")
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init or not hasattr(vspec, f.name):
            continue
        value = getattr(vspec, f.name)
        if f.name == "dtype":
            value = _dtype_name(value)
        elif f.name == "dtypes":
            value = tuple(_dtype_name(d) for d in value)
        elif f.name == "shapes":
            # vLLM takes a bare shape (ints) as one state; kvref wants one tuple per state
            value = (tuple(value),) if all(isinstance(s, int) for s in value) else tuple(tuple(s) for s in value)
        elif f.name == "kv_cache_specs":
            value = {k: _to_kvref_spec(v) for k, v in value.items()}
        kwargs[f.name] = value
    return cls(**kwargs)


def _to_pool_config(kv_cache_config: Any, **kw: Any) -> Any:
    from kvref.impl.interface import PoolConfig
    from kvref.spec.kv_cache_interface import KVCacheGroupSpec

    groups, roles = [], []
    for g in kv_cache_config.kv_cache_groups:
        role = getattr(g, "role", None)
        roles.append("default" if role is None else str(getattr(role, "value", role)))
        groups.append(KVCacheGroupSpec(tuple(g.layer_names), _to_kvref_spec(g.kv_cache_spec),
                                       is_eagle_group=bool(getattr(g, "is_eagle_group", False))))
    return PoolConfig.off_plan("vLLM's own unit tests hand KVCacheManager a KVCacheConfig built field by field",
                               num_blocks=kv_cache_config.num_blocks, groups=tuple(groups),
                               prefix_cache_retention_interval=getattr(kv_cache_config,
                                                                       "prefix_cache_retention_interval", None),
                               group_roles=tuple(roles),
                               hisparse_host_num_blocks=getattr(kv_cache_config, "hisparse_host_num_blocks", None),
                               **kw)


# ---------------------------------------------------------------------------------------- requests


class _VllmRequestHashes:
    """The hasher the reference manager reads: the vLLM request's own ``block_hashes``."""

    def __init__(self, owner: "StandInKVCacheManager") -> None:
        self.owner = owner

    def block_hashes(self, request: Any) -> list:
        return self.owner._vllm_requests[request.request_id].block_hashes

    def peek(self, request_id: str) -> list | None:
        vreq = self.owner._vllm_requests.get(request_id)
        return None if vreq is None else vreq.block_hashes

    def forget(self, request_id: str) -> None:
        return None

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.owner._vllm_requests

    def check_invariants(self) -> None:
        return None


def _status(vstatus: Any) -> Any:
    from kvref.impl.request import RequestStatus

    name = getattr(vstatus, "name", "")
    if name == "RUNNING":
        return RequestStatus.RUNNING
    if name == "PREEMPTED":
        return RequestStatus.PREEMPTED
    if name.startswith("FINISHED"):
        return RequestStatus.FINISHED
    return RequestStatus.WAITING


def _lora(vlora: Any) -> Any:
    from kvref.impl.request import LoRARequest

    if vlora is None:
        return None
    return LoRARequest(lora_name=vlora.lora_name, lora_int_id=vlora.lora_int_id,
                       lora_path=vlora.lora_path or vlora.lora_name)


# ---------------------------------------------------------------------------------------- manager


class StandInKVCacheManager:
    """vLLM 0.33.0's ``KVCacheManager`` signature and methods, answered by kvref's reference."""

    def __init__(self, kv_cache_config: Any, max_model_len: int, scheduler_block_size: int,
                 hash_block_size: int, max_in_flight_tokens: int | None = None, enable_caching: bool = True,
                 use_eagle: bool = False, num_hash_lookahead_tokens: int = 0, num_prefill_lookahead: int = 0,
                 log_stats: bool = False, enable_kv_cache_events: bool = False, dcp_world_size: int = 1,
                 pcp_world_size: int = 1, metrics_collector: Any = None, watermark: float = 0.0,
                 enable_mamba_shared_prefix_checkpoint: bool = False) -> None:
        from kvref.impl.reference.kv_cache_manager import KVCacheManager

        _BUILT[0] += 1
        if metrics_collector is not None:
            raise StandInGap("KVCacheMetricsCollector (block residency metrics)")
        config = _to_pool_config(
            kv_cache_config, max_model_len=max_model_len, scheduler_block_size=scheduler_block_size,
            hash_block_size=hash_block_size, max_in_flight_tokens=max_in_flight_tokens,
            enable_caching=enable_caching, watermark=watermark, use_eagle=use_eagle,
            enable_kv_cache_events=enable_kv_cache_events, num_hash_lookahead_tokens=int(num_hash_lookahead_tokens),
            log_stats=log_stats, num_prefill_lookahead=num_prefill_lookahead,
            dcp_world_size=dcp_world_size, pcp_world_size=pcp_world_size,
            enable_mamba_shared_prefix_checkpoint=enable_mamba_shared_prefix_checkpoint)
        self._ref = KVCacheManager(config)
        self._vllm_requests: dict[str, Any] = {}
        self._mirrors: dict[str, Any] = {}
        if self._ref.hasher is not None:
            self._ref.hasher = _VllmRequestHashes(self)
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.use_eagle = use_eagle
        self.log_stats = log_stats
        self.metrics_collector = None
        self.mamba_shared_prefix_checkpoint = self._ref.mamba_shared_prefix_checkpoint
        self.coordinator = _coordinator_view(self._ref.coordinator, kv_cache_config)
        self.block_pool = self._ref.block_pool
        # vLLM's tests call the pool's cache_full_blocks with vLLM's signature (the request first;
        # its hashes are read from it): route those calls, leave the reference's own untouched
        self.block_pool.__class__ = _standin_pool_class(type(self.block_pool))
        self.block_pool._standin = self
        self.num_kv_cache_groups = self._ref.num_kv_cache_groups
        self.watermark_blocks = self._ref.watermark_blocks
        self.kv_cache_event_metadata = self._ref.kv_cache_event_metadata
        self.retained_hit_group_ids = tuple(
            i for i, m in enumerate(self.coordinator.single_type_managers) if getattr(m, "retains_longer_hit", False))
        self.empty_kv_cache_blocks = self._vllm_blocks(self._ref.empty_kv_cache_blocks)

    # -------------------------------------------------------------- translation

    def _mirror(self, vreq: Any) -> Any:
        from kvref.impl.request import Request

        rid = vreq.request_id
        kreq = self._mirrors.get(rid)
        if kreq is None or self._vllm_requests.get(rid) is not vreq:
            prompt = vreq.prompt_token_ids
            if prompt is None:
                prompt = [0] * vreq.num_prompt_tokens
            kreq = Request(request_id=rid, prompt_token_ids=[0], cache_salt=vreq.cache_salt,
                           lora_request=_lora(vreq.lora_request),
                           session_id=getattr(vreq, "session_id", None))
            # vLLM's tests use placeholder ids (negative, or an empty prompt) that kvref's Request
            # refuses; the reference reads only the count and the ids it publishes in events
            kreq.prompt_token_ids = list(prompt)
            self._mirrors[rid] = kreq
            self._vllm_requests[rid] = vreq
        kreq.output_token_ids = list(vreq.output_token_ids)
        kreq.num_computed_tokens = vreq.num_computed_tokens
        kreq.num_in_flight_tokens = getattr(vreq, "num_in_flight_tokens", 0)
        kreq.num_output_placeholders = getattr(vreq, "num_output_placeholders", 0)
        kreq.num_preemptions = vreq.num_preemptions
        kreq.status = _status(vreq.status)
        kreq.skip_reading_prefix_cache = bool(getattr(vreq, "skip_reading_prefix_cache", False))
        # the scheduler stores get_computed_blocks' junction on the request (sparse retention)
        kreq.shared_prefix_boundary = getattr(vreq, "shared_prefix_boundary", 0)
        return kreq

    def _forget(self, rid: str) -> None:
        self._mirrors.pop(rid, None)
        self._vllm_requests.pop(rid, None)

    @staticmethod
    def _vllm_blocks(kblocks: Any) -> Any:
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks as VllmKVCacheBlocks

        return None if kblocks is None else VllmKVCacheBlocks(tuple(kblocks.blocks))

    def _ref_blocks(self, vblocks: Any) -> Any:
        from kvref.impl.reference.kv_cache_manager import KVCacheBlocks

        if vblocks is None:
            return None
        if not any(vblocks.blocks):
            return self._ref.empty_kv_cache_blocks
        return KVCacheBlocks(tuple(vblocks.blocks))

    # -------------------------------------------------------------- vLLM's API

    @property
    def usage(self) -> float:
        return self._ref.usage

    @property
    def prefix_cache_stats(self) -> Any:
        return self._ref.prefix_cache_stats

    def make_prefix_cache_stats(self) -> Any:
        from vllm.v1.metrics.stats import PrefixCacheStats

        stats = self._ref.make_prefix_cache_stats()
        if stats is None:
            return None
        out = PrefixCacheStats()
        for f in dataclasses.fields(stats):
            if hasattr(out, f.name):
                setattr(out, f.name, getattr(stats, f.name))
        return out

    def prefix_cache_lookup_enabled(self, request: Any) -> bool:
        return self._ref.prefix_cache_lookup_enabled(self._mirror(request))

    def record_prefix_cache_stats(self, request: Any, num_hits: int) -> None:
        self._ref.record_prefix_cache_stats(self._mirror(request), num_hits)

    def get_computed_blocks(self, request: Any, max_cache_hit_length: int | None = None) -> tuple:
        blocks, num_hit, boundary = self._ref.get_computed_blocks(self._mirror(request), max_cache_hit_length)
        return self._vllm_blocks(blocks), num_hit, boundary

    def get_computed_blocks_for_connector(self, request: Any, max_cache_hit_length: int | None = None) -> Any:
        out = self._ref.get_computed_blocks_for_connector(self._mirror(request), max_cache_hit_length)
        if isinstance(out, tuple):
            return (self._vllm_blocks(out[0]),) + tuple(out[1:])
        return self._vllm_blocks(out)

    def allocate_slots(self, request: Any, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: Any = None, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                       num_encoder_tokens: int = 0, full_sequence_must_fit: bool = False,
                       reserved_blocks: int = 0, has_scheduled_reqs: bool = True,
                       skip_zeroing_group_ids: tuple[int, ...] = ()) -> Any:
        out = self._ref.allocate_slots(
            self._mirror(request), num_new_tokens, num_new_computed_tokens, self._ref_blocks(new_computed_blocks),
            num_lookahead_tokens=num_lookahead_tokens, num_external_computed_tokens=num_external_computed_tokens,
            delay_cache_blocks=delay_cache_blocks, num_encoder_tokens=num_encoder_tokens,
            full_sequence_must_fit=full_sequence_must_fit, reserved_blocks=reserved_blocks,
            has_scheduled_reqs=has_scheduled_reqs, skip_zeroing_group_ids=tuple(skip_zeroing_group_ids))
        return self._vllm_blocks(out)

    def free(self, request: Any) -> None:
        self._ref.free(self._mirror(request))
        self._forget(request.request_id)

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        self._ref.remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)

    def pop_blocks_for_free(self, request: Any) -> list:
        out = self._ref.pop_blocks_for_free(self._mirror(request))
        self._forget(request.request_id)
        return out

    def evict_blocks(self, block_ids: set[int]) -> None:
        self._ref.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        return self._ref.reset_prefix_cache()

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return self._ref.get_num_common_prefix_blocks(running_request_id)

    def take_events(self) -> list:
        import vllm.distributed.kv_events as vev
        from vllm.v1.core import kv_cache_manager as vkcm

        out = []
        for ev in self._ref.take_events():
            if type(ev).__module__.startswith("vllm."):
                # a test queued vLLM's own event on the pool: handed back as is; the reference
                # leaves a BlockStored of an unknown group unannotated, vLLM also logs it
                idx = getattr(ev, "group_idx", None)
                if isinstance(ev, vev.BlockStored) and idx is not None \
                        and not 0 <= idx < len(self.kv_cache_event_metadata):
                    vkcm.logger.warning("Group index `%s` not in KV cache metadata", idx)
                out.append(ev)
                continue
            cls = getattr(vev, type(ev).__name__, None)
            if cls is None:
                raise StandInGap(f"KV event {type(ev).__name__}")
            out.append(cls(**{f.name: getattr(ev, f.name) for f in dataclasses.fields(ev)}))
        return out

    def get_blocks(self, request_id: str) -> Any:
        return self._vllm_blocks(self._ref.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self._ref.get_block_ids(request_id)

    def get_block_ids_for_computed_tokens(self, request_id: str, *args: Any, **kwargs: Any) -> Any:
        return self._ref.get_block_ids_for_computed_tokens(request_id, *args, **kwargs)

    def estimate_cached_tokens(self, request: Any) -> int:
        return self._ref.estimate_cached_tokens(self._mirror(request))

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        kreq = self._mirror(request)
        if self._ref.hasher is not None:
            self._ref.coordinator.cache_blocks(kreq, self._ref.hasher.block_hashes(kreq), num_computed_tokens)

    def create_kv_cache_blocks(self, blocks: Any) -> Any:
        return self._vllm_blocks(self._ref.create_kv_cache_blocks(tuple(list(g) for g in blocks)))

    def truncate_computed_blocks(self, blocks: Any, num_computed_tokens: int) -> Any:
        return self._vllm_blocks(self._ref.truncate_computed_blocks(self._ref_blocks(blocks), num_computed_tokens))

    def take_new_block_ids(self) -> list[int]:
        return self._ref.take_new_block_ids()

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        self._ref.record_blocks_for_zeroing(request_id, start_token)

    def take_kv_cache_block_copies(self) -> Any:
        """vLLM's form: the copies, and their endpoints (held until the worker copied them); the
        reference drains the same pairs as block ids."""
        from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy

        pairs = self._ref.take_kv_cache_block_copies()
        blocks = self.block_pool.blocks
        return ([KVCacheBlockCopy(src_block_id=s, dst_block_id=d) for s, d in pairs],
                [blocks[i] for pair in pairs for i in pair])

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        return self._ref.take_boundary_state_offloads()

    def finalize_partial_tail_offloads(self, request: Any) -> list[tuple[int, int, int]]:
        return self._ref.finalize_partial_tail_offloads(self._mirror(request))

    def new_step_starts(self) -> None:
        self._ref.new_step_starts()

    def __getattr__(self, name: str) -> Any:
        # an AttributeError, so vLLM's hasattr() probes see what they would see on a class without it
        raise AttributeError(f"kvref stand-in: KVCacheManager.{name}")


# ---------------------------------------------------------------------------------------- views


class _View:
    """Reads and writes go to the reference object, except the names this view answers itself."""

    def __init__(self, target: Any, **own: Any) -> None:
        object.__setattr__(self, "_target", target)
        for name, value in own.items():
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_target"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(object.__getattribute__(self, "_target"), name, value)


class _ManagerView(_View):
    """A reference single-type manager with vLLM's ``cache_blocks`` signature: vLLM passes no
    hashes (the request carries them), the reference takes the ones its coordinator publishes."""

    #: manager id -> the hashes its coordinator is publishing right now (set around a replaced
    #: ``cache_blocks``, so the original reached through the replacement gets them)
    _publishing: dict[int, Any] = {}

    def cache_blocks(self, request: Any, num_tokens: int, retention_interval: int | None = None, *,
                     replay_boundaries: Any = ()) -> None:
        target = object.__getattribute__(self, "_target")
        hashes = _ManagerView._publishing.get(id(target), getattr(request, "block_hashes", None))
        if hashes is None:
            raise StandInGap("SingleTypeKVCacheManager.cache_blocks outside the coordinator's publication")
        return type(target).cache_blocks(target, request, hashes, num_tokens, retention_interval,
                                         tuple(replay_boundaries))

    def _cache_partial_tail_block(self, request: Any, num_tokens: int, retention_interval: int | None) -> Any:
        # vLLM's signature (Mamba "align" managers): the hashes are the request's own
        target = object.__getattribute__(self, "_target")
        return type(target)._cache_partial_tail_block(target, request, request.block_hashes, num_tokens,
                                                      retention_interval)

    def __setattr__(self, name: str, value: Any) -> None:
        target = object.__getattribute__(self, "_target")
        if name != "cache_blocks" or not callable(value):
            return super().__setattr__(name, value)

        def called_by_the_reference(request: Any, block_hashes: Any, num_tokens: int,
                                    retention_interval: int | None = None, replay_boundaries: Any = ()) -> None:
            # a replacement with vLLM's signature (a test's spy): hand it vLLM's arguments
            _ManagerView._publishing[id(target)] = block_hashes
            try:
                return value(request, num_tokens, retention_interval, replay_boundaries=replay_boundaries)
            finally:
                _ManagerView._publishing.pop(id(target), None)

        setattr(target, "cache_blocks", called_by_the_reference)


_VIEW_CLASSES: dict[type, type] = {}


def _view(target: Any, base: type = _View, **own: Any) -> _View:
    """A view of ``target`` whose class carries the target's class name (vLLM's tests compare
    ``type(manager.coordinator).__name__``; the reference classes bear vLLM's names)."""
    cls = type(target)
    if (cls, base) not in _VIEW_CLASSES:
        _VIEW_CLASSES[cls, base] = type(cls.__name__, (base,), {"__qualname__": cls.__qualname__})
    return _VIEW_CLASSES[cls, base](target, **own)


def _coordinator_view(coordinator: Any, kv_cache_config: Any) -> _View:
    """The reference coordinator whose managers show vLLM's spec objects as ``kv_cache_spec``:
    vLLM's engine and scheduler test them with ``isinstance`` against vLLM's classes
    (``is_full_attention_spec``, the spec-decode step blocks)."""
    managers = tuple(_view(m, _ManagerView, kv_cache_spec=g.kv_cache_spec)
                     for m, g in zip(coordinator.single_type_managers, kv_cache_config.kv_cache_groups))
    return _view(coordinator, _CoordinatorView, single_type_managers=managers)


class _CoordinatorView(_View):
    """vLLM's connectors assert ``isinstance(coordinator, HybridKVCacheCoordinator)`` before asking a
    hybrid pool's per-group hits: the view answers ``__class__`` (what ``isinstance`` also reads)
    with vLLM's class of the reference coordinator's name; ``type()`` still names the view."""

    @property
    def __class__(self) -> type:  # noqa: D401 - isinstance() reads it
        import vllm.v1.core.kv_cache_coordinator as vllm_coordinator

        name = type(object.__getattribute__(self, "_target")).__name__
        return getattr(vllm_coordinator, name, type(self))


# ---------------------------------------------------------------------------------------- pool


_POOL_CLASSES: dict[type, type] = {}

#: the pool methods vLLM's tests call with vLLM's signature: the request first (a vLLM request, whose
#: ``block_hashes`` the reference takes explicitly), then these arguments
_VLLM_SIGNATURES = {
    "cache_full_blocks": ("blocks", "num_cached_blocks", "num_full_blocks", "block_size", "kv_cache_group_id",
                          "block_mask"),
    "cache_partial_block": ("block", "num_tokens", "kv_cache_group_id", "block_size", "replace_existing_hashes"),
}


def _vllm_signature(name: str, base: type) -> Any:
    names = _VLLM_SIGNATURES[name]
    ref_method = getattr(base, name)

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        request = kwargs.get("request", args[0] if args else None)
        if not hasattr(request, "block_hashes") or "block_hashes" in kwargs:
            return ref_method(self, *args, **kwargs)  # the reference's own call
        rest = {k: v for k, v in kwargs.items() if k != "request"}
        rest.update(zip(names, args[1:] if args and args[0] is request else args))
        return ref_method(self, request.block_hashes, request=self._standin._mirror(request), **rest)

    method.__name__ = name
    return method


def _standin_pool_class(base: type) -> type:
    """The reference pool's class whose ``cache_full_blocks`` / ``cache_partial_block`` also answer
    vLLM's signatures (the translation only; the reference decides)."""
    if getattr(base, "_standin_pool", False):
        return base
    if base not in _POOL_CLASSES:
        methods = {name: _vllm_signature(name, base) for name in _VLLM_SIGNATURES}
        _POOL_CLASSES[base] = type(f"StandIn{base.__name__}", (base,), {**methods, "_standin_pool": True})
    return _POOL_CLASSES[base]


# ---------------------------------------------------------------------------------------- hooks


def install() -> None:
    """Bind vLLM's ``KVCacheManager`` names to the stand-in (before the test modules import them)."""
    import vllm.v1.core.kv_cache_manager as kv_cache_manager
    import vllm.v1.core.sched.scheduler as scheduler

    kv_cache_manager.KVCacheManager = StandInKVCacheManager
    scheduler.KVCacheManager = StandInKVCacheManager
    import vllm.v1.hisparse.coordinator as hisparse

    vllm_get_hisparse_coordinator = hisparse.get_hisparse_coordinator

    def get_hisparse_coordinator(kv_cache_manager: Any) -> Any:
        """The reference's HiSparse coordinator of a stand-in (bound when its pool was built)."""
        if not isinstance(kv_cache_manager, StandInKVCacheManager):
            return vllm_get_hisparse_coordinator(kv_cache_manager)
        coordinator = kv_cache_manager._ref.coordinator.hisparse_coordinator
        if coordinator is None:
            raise ValueError("No HiSparse cache group is configured.")
        return coordinator

    hisparse.get_hisparse_coordinator = get_hisparse_coordinator


def pytest_configure(config: pytest.Config) -> None:
    install()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any):
    before = _BUILT[0]
    yield
    _USAGE[item.nodeid] = _BUILT[0] - before


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = os.environ.get("KVREF_STANDIN_USAGE")
    if path:
        with open(path, "w") as fh:
            json.dump(_USAGE, fh, indent=0, sort_keys=True)
