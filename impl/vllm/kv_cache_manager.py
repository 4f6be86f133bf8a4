"""Drive the installed vLLM's own ``KVCacheManager`` through kvref's common interface, for conformance.

The adapter is deliberately thin: it builds ``KVCacheConfig`` + ``KVCacheManager`` exactly as
``PoolConfig`` says (with the one converter, :mod:`kvref.impl.vllm.specs`), mirrors each
kvref :class:`~kvref.impl.request.Request` into a vLLM ``Request`` (same tokens, cache salt,
``num_computed_tokens``, ``num_in_flight_tokens``, status) and turns vLLM's ``KVCacheBlocks`` into
plain block ids. It adds no behaviour of its own, so whatever it returns is what vLLM does.

vLLM is imported lazily (inside functions, by :func:`kvref.impl.vllm.loader.load_vllm`, which also
sets ``VLLM_TARGET_DEVICE=cpu`` unless set) so that ``import kvref.impl`` never needs vLLM.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from kvref.spec.errors import InvalidFieldError

from kvref.impl.interface import BlockIds, PoolConfig
from kvref.impl.request import Request, RequestStatus
from kvref.impl.vllm.allocation_watch import AllocationWatch
from kvref.impl.vllm.loader import load_vllm
from kvref.impl.vllm.specs import build_kv_cache_manager, kv_cache_manager_kwargs, to_vllm_kv_cache_config
from kvref.impl.vllm.specs import to_vllm_spec  # noqa: F401 - re-exported for older callers
from kvref.impl.vllm.vrequest import KV_MANAGER_CARRY, vllm_request_from

_STATUS = {
    RequestStatus.WAITING: "WAITING",
    RequestStatus.RUNNING: "RUNNING",
    RequestStatus.PREEMPTED: "PREEMPTED",
    RequestStatus.FINISHED: "FINISHED_STOPPED",
}


class VllmKVCacheManager:
    """vLLM's ``KVCacheManager`` behind :class:`~kvref.impl.interface.KVCacheManagerLike`.

    Args:
        pool_config: the pool to build. ``num_blocks`` includes the null block 0, as in vLLM.
    """

    kind = "vllm"

    def __init__(self, pool_config: PoolConfig) -> None:
        if not isinstance(pool_config, PoolConfig):
            raise InvalidFieldError("pool_config", pool_config, "a kvref.impl.interface.PoolConfig")
        v = load_vllm()
        self.pool_config = pool_config
        self.num_groups = len(pool_config.groups)
        self._mgr = build_kv_cache_manager(pool_config)
        self._pool = self._mgr.block_pool
        self._allocation_watch = AllocationWatch(self._mgr)
        hash_fn = v["get_hash_fn_by_name"](pool_config.prefix_caching_hash_algo)
        self._hash_fn = hash_fn
        self._none_hash_seed = self._init_none_hash(pool_config.none_hash_seed)
        self._hasher: Callable | None = (
            v["utils"].get_request_block_hasher(pool_config.hash_block_size, hash_fn,
                                                pool_config.num_hash_lookahead_tokens)
            if pool_config.enable_caching else None)
        self._mirrors: dict[str, Any] = {}
        self._mirror_keys: dict[str, tuple] = {}
        self._requests: dict[str, Request] = {}  # the caller's requests, for check_invariants

    def rejects_prefix_cache_retention_interval(self, retention_interval: object) -> bool:
        """Whether vLLM's coordinator refuses ``retention_interval`` on this pool's groups: a fresh
        ``KVCacheManager`` is built with ``KVCacheConfig.prefix_cache_retention_interval`` set to it
        (a value ``PoolConfig`` would refuse reaches vLLM this way); its constructor validates it
        (``_validate_prefix_cache_retention_interval``) and raises ``ValueError``."""
        kv_cache_config = to_vllm_kv_cache_config(self.pool_config)
        kv_cache_config.prefix_cache_retention_interval = retention_interval
        try:
            load_vllm()["KVCacheManager"](kv_cache_config, **kv_cache_manager_kwargs(self.pool_config))
        except ValueError:
            return True
        return False

    @property
    def mamba_shared_prefix_checkpoint(self) -> bool:
        """vLLM's ``KVCacheManager.mamba_shared_prefix_checkpoint``: its narrowing of
        ``enable_mamba_shared_prefix_checkpoint`` (EAGLE groups, partial hash hits, no MTP tail)."""
        return bool(self._mgr.mamba_shared_prefix_checkpoint)

    def enable_kv_cache_metrics(self, sample_rate: float):
        """Attach vLLM's own ``KVCacheMetricsCollector`` (``--kv-cache-metrics``) to this manager's
        block pool and return it; vLLM then reports the sampled blocks' allocations, hits and
        evictions to it (the pool reads ``metrics_collector`` at each call, so attaching after
        construction is what passing it to ``KVCacheManager`` does)."""
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float)) or not 0 < sample_rate <= 1:
            raise InvalidFieldError("sample_rate", sample_rate, "a number in (0, 1]")
        from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector

        collector = KVCacheMetricsCollector(sample_rate)
        self._mgr.metrics_collector = collector
        self._pool.metrics_collector = collector
        return collector

    # -- NONE_HASH: process-global in vLLM ---------------------------------------------------

    def _init_none_hash(self, seed: str | None) -> str:
        """Run vLLM's ``init_none_hash`` for this pool's hash function; with ``seed``, under
        ``PYTHONHASHSEED=seed`` (vLLM's own override), so vLLM derives NONE_HASH itself. Returns the
        seed vLLM resolved (``get_none_hash_seed``): random for xxhash without a seed."""
        utils = load_vllm()["utils"]
        saved = os.environ.get("PYTHONHASHSEED")
        try:
            if seed is not None:
                os.environ["PYTHONHASHSEED"] = seed
            utils.init_none_hash(self._hash_fn)
        finally:
            if seed is not None:
                if saved is None:
                    os.environ.pop("PYTHONHASHSEED", None)
                else:
                    os.environ["PYTHONHASHSEED"] = saved
        self._none_hash = utils.NONE_HASH
        return utils.get_none_hash_seed()

    def _ensure_none_hash(self) -> None:
        """vLLM's NONE_HASH is one per process: another adapter (another hash function or seed)
        may have re-initialized it since; re-run ``init_none_hash`` with this pool's seed."""
        if load_vllm()["utils"].NONE_HASH != self._none_hash:
            self._init_none_hash(self._none_hash_seed)

    @property
    def none_hash_seed(self) -> str:
        """The seed vLLM derived this pool's NONE_HASH from (``get_none_hash_seed``)."""
        return self._none_hash_seed

    # -- request mirroring -------------------------------------------------------------------

    def _mirror(self, request: Request) -> Any:
        """The vLLM ``Request`` for ``request``, brought up to date with its tokens and progress
        (built by :func:`.vrequest.vllm_request_from` with :data:`.vrequest.KV_MANAGER_CARRY`, again
        whenever a field it hashes or reports changes)."""
        if not isinstance(request, Request):
            raise InvalidFieldError("request", request, "a kvref.impl.request.Request")
        v = load_vllm()
        self._requests[request.request_id] = request
        self._ensure_none_hash()
        key = (tuple(request.prompt_token_ids), request.cache_salt, request.mm_features, request.lora_request,
               request.prompt_embeds, request.session_id, request.skip_reading_prefix_cache,
               request.kv_cache_report_mode)
        vreq = self._mirrors.get(request.request_id)
        if vreq is None or self._mirror_keys.get(request.request_id) != key:
            vreq = vllm_request_from(request, carry=KV_MANAGER_CARRY, block_hasher=self._hasher)
            self._mirrors[request.request_id] = vreq
            self._mirror_keys[request.request_id] = key
        have = len(vreq.output_token_ids)
        want = request.output_token_ids
        if have > len(want) or list(vreq.output_token_ids) != want[:have]:
            raise InvalidFieldError(f"request {request.request_id!r}.output_token_ids", want,
                                    "an extension of the output tokens seen before (outputs only grow)")
        if have < len(want):
            vreq.append_output_token_ids(list(want[have:]))
        vreq.num_computed_tokens = request.num_computed_tokens
        vreq.num_in_flight_tokens = request.num_in_flight_tokens
        vreq.num_preemptions = request.num_preemptions
        # the scheduler sets it at each lookup (get_computed_blocks' third result); sparse
        # retention keeps the junction's tail
        vreq.shared_prefix_boundary = getattr(request, "shared_prefix_boundary", 0)
        vreq.status = getattr(v["VStatus"], _STATUS[request.status])
        return vreq

    def vllm_request(self, request: Request) -> Any:
        """vLLM's ``Request`` mirroring ``request``, brought up to date (the one mirror of kvref
        requests in vLLM's: tests that call vLLM's manager directly, e.g. to hold its
        ``KVCacheBlocks`` or read ``block_hashes``, take it here rather than building their own)."""
        return self._mirror(request)

    @property
    def vllm_manager(self) -> Any:
        """vLLM's own ``KVCacheManager`` behind this adapter (built by :func:`.specs.build_kv_cache_manager`)."""
        return self._mgr

    def _blocks_from_ids(self, block_ids: BlockIds | None) -> Any:
        if block_ids is None or not any(block_ids):
            return None  # vLLM maps None to its shared empty KVCacheBlocks, like a miss would
        if len(block_ids) != self.num_groups:
            raise InvalidFieldError("new_computed_block_ids", block_ids, f"one tuple per group ({self.num_groups})")
        blocks = self._pool.blocks
        for ids in block_ids:
            for b in ids:
                if not isinstance(b, int) or not 0 <= b < len(blocks):
                    raise InvalidFieldError("new_computed_block_ids", block_ids,
                                            f"block ids in [0, {len(blocks)})")
        return load_vllm()["KVCacheBlocks"](tuple([blocks[b] for b in ids] for ids in block_ids))

    @staticmethod
    def _ids(kv_blocks: Any) -> BlockIds:
        return tuple(tuple(b.block_id for b in group) for group in kv_blocks.blocks)

    # -- KVCacheManagerLike ------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[BlockIds, int]:
        blocks, num_hit, _boundary = self._mgr.get_computed_blocks(self._mirror(request))
        return self._ids(blocks), num_hit

    def get_computed_blocks_and_boundary(self, request: Request) -> tuple[BlockIds, int, int]:
        """vLLM's whole ``get_computed_blocks`` answer: hit ids, hit tokens and the shared-prefix
        boundary the scheduler stores on the request (``shared_prefix_boundary``)."""
        blocks, num_hit, boundary = self._mgr.get_computed_blocks(self._mirror(request))
        return self._ids(blocks), num_hit, boundary

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_block_ids: BlockIds | None = None, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                       full_sequence_must_fit: bool = False, reserved_blocks: int = 0,
                       has_scheduled_reqs: bool = True,
                       skip_zeroing_group_ids: tuple[int, ...] = (), num_encoder_tokens: int = 0) -> BlockIds | None:
        vreq = self._mirror(request)
        out = self._mgr.allocate_slots(
            vreq, num_new_tokens, num_new_computed_tokens=num_new_computed_tokens,
            new_computed_blocks=self._blocks_from_ids(new_computed_block_ids),
            num_lookahead_tokens=num_lookahead_tokens, num_external_computed_tokens=num_external_computed_tokens,
            delay_cache_blocks=delay_cache_blocks, full_sequence_must_fit=full_sequence_must_fit,
            reserved_blocks=reserved_blocks, has_scheduled_reqs=has_scheduled_reqs,
            skip_zeroing_group_ids=tuple(skip_zeroing_group_ids), num_encoder_tokens=num_encoder_tokens)
        return None if out is None else self._ids(out)

    def free(self, request: Request) -> None:
        self._mgr.free(self._mirror(request))

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """vLLM's ``cache_blocks``: what the scheduler calls when an async KV load completes."""
        self._mgr.cache_blocks(self._mirror(request), num_computed_tokens)

    def forget(self, request_id: str) -> None:
        """Drop the vLLM mirror of a finished request (the scheduler drops its ``Request`` too)."""
        self._mirrors.pop(request_id, None)
        self._mirror_keys.pop(request_id, None)
        self._requests.pop(request_id, None)

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """vLLM's ``take_boundary_state_offloads`` (Mamba "align" hand-offs; the scheduler drains it
        every step)."""
        return {rid: [tuple(e) for e in entries] for rid, entries in self._mgr.take_boundary_state_offloads().items()}

    def finalize_partial_tail_offloads(self, request: Request) -> list[tuple[int, int, int]]:
        """vLLM's ``finalize_partial_tail_offloads`` (a finishing KV producer's partial tails)."""
        return [tuple(e) for e in self._mgr.finalize_partial_tail_offloads(self._mirror(request))]

    def release_kv_cache_block_copies(self) -> list[tuple[int, int]]:
        """vLLM's scheduler at the end of ``schedule()``: ``take_kv_cache_block_copies`` and free the
        retained endpoints (the non-deferred path). Returns the (source, destination) ids."""
        copies, retained = self._mgr.take_kv_cache_block_copies()
        if retained:
            self._pool.free_blocks(retained)
        return [(c.src_block_id, c.dst_block_id) for c in copies]

    def new_step_starts(self) -> None:
        self._mgr.new_step_starts()

    def take_new_block_ids(self) -> list[int]:
        """vLLM's ``take_new_block_ids``: block ids recorded for worker-side zeroing."""
        return list(self._mgr.take_new_block_ids())

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        self._mgr.record_blocks_for_zeroing(request_id, start_token)

    def get_block_ids(self, request_id: str) -> BlockIds:
        return tuple(tuple(ids) for ids in self._mgr.get_block_ids(request_id))

    def get_num_free_blocks(self) -> int:
        return self._pool.get_num_free_blocks()

    def free_block_queue(self) -> tuple[int, ...]:
        return tuple(b.block_id for b in self._pool.free_block_queue.get_all_free_blocks())

    def cached_blocks(self) -> dict[tuple[int, int], bytes]:
        utils = load_vllm()["utils"]
        out: dict[tuple[int, int], bytes] = {}
        for b in self._pool.blocks:
            key = b.block_hash
            if key is not None:
                out[(utils.get_group_id(key), b.block_id)] = bytes(utils.get_block_hash(key))
        return out

    def cached_block_num_tokens(self) -> dict[tuple[int, int], int | None]:
        """``{(group_id, block_id): prefix tokens the primary hash covers}`` (partial entries end mid-block)."""
        utils = load_vllm()["utils"]
        return {(utils.get_group_id(b.block_hash), b.block_id): b.block_hash_num_tokens
                for b in self._pool.blocks if b.block_hash is not None}

    def hash_index(self) -> dict[bytes, tuple[int, ...]]:
        """vLLM's prefix-cache index: ``{hash key bytes: the block ids cached under it}``."""
        return {bytes(key): (v.block_id,) if hasattr(v, "block_id") else tuple(v)
                for key, v in self._pool.cached_block_hash_to_block._cache.items()}

    def ref_counts(self) -> list[int]:
        """Every block's ``ref_cnt``, by block id (the null block 0 included)."""
        return [b.ref_cnt for b in self._pool.blocks]

    @property
    def usage(self) -> float:
        return self._mgr.usage

    # -- block hashes, prefix-cache stats, KV-connector views (issue #23) --------------------

    def request_block_hashes(self, request: Request) -> tuple[bytes, ...]:
        """vLLM's ``Request.block_hashes`` of the request (its mirror brought up to date)."""
        return tuple(bytes(h) for h in self._mirror(request).block_hashes)

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        self._mgr.record_prefix_cache_stats(self._mirror(request), num_hits)

    def prefix_cache_stats(self) -> dict[str, Any] | None:
        """The stats gathered since the last ``make_prefix_cache_stats`` (not reset here)."""
        return _stats_plain(self._mgr.prefix_cache_stats)

    def make_prefix_cache_stats(self) -> dict[str, Any] | None:
        return _stats_plain(self._mgr.make_prefix_cache_stats())

    def get_block_ids_for_computed_tokens(self, request_id: str, num_computed_tokens: int) -> BlockIds:
        return tuple(tuple(ids) for ids in self._mgr.get_block_ids_for_computed_tokens(request_id,
                                                                                       num_computed_tokens))

    def estimate_cached_tokens(self, request: Request) -> int:
        return self._mgr.estimate_cached_tokens(self._mirror(request))

    def truncate_computed_blocks(self, block_ids: BlockIds, num_computed_tokens: int) -> BlockIds:
        blocks = self._blocks_from_ids(block_ids)
        if blocks is None:
            blocks = self._mgr.empty_kv_cache_blocks
        return self._ids(self._mgr.truncate_computed_blocks(blocks, num_computed_tokens))

    def get_computed_blocks_for_connector(self, request: Request) -> tuple[BlockIds, int, int, bool]:
        blocks, num_hit, boundary, diverged = self._mgr.get_computed_blocks_for_connector(self._mirror(request))
        return self._ids(blocks), num_hit, boundary, diverged

    def free_holding_view(self, request: Request) -> BlockIds:
        """``free`` while holding the ``get_blocks`` result taken just before it (a connector's
        view): returns the ids that view shows after the free."""
        vreq = self._mirror(request)
        view = self._mgr.get_blocks(request.request_id)
        self._mgr.free(vreq)
        return self._ids(view)

    # -- KV cache events and cache resets ----------------------------------------------------

    def take_kv_events(self) -> list[dict[str, Any]]:
        """vLLM's ``KVCacheManager.take_events()`` as plain dicts (:mod:`kvref.impl.vllm.kv_events`);
        [] unless the pool config enables events."""
        from .kv_events import vllm_event_to_plain

        return [vllm_event_to_plain(e) for e in self._mgr.take_events()]

    def reset_prefix_cache(self) -> bool:
        return self._mgr.reset_prefix_cache()

    def evict_blocks(self, block_ids: set[int]) -> None:
        self._mgr.evict_blocks(set(block_ids))

    # -- invariants of vLLM's own state (docs/invariants.md), read through its internals -------

    def check_invariants(self, held_tables: bool = True) -> None:
        """kvref's invariants on vLLM's pool, free-queue links and managers
        (:mod:`kvref.impl.vllm.invariants`): I1-I6, I9, M1-M3, and, with ``held_tables``, every held
        request's tables spanning its computed tokens (read from the caller's requests, which are
        current; the vLLM mirrors are refreshed only at the next call). The reference scheduler's
        shim (:class:`~kvref.impl.vllm.scheduler.VllmKVCacheManagerShim`) leaves the tables to the
        scheduler's own check."""
        from kvref.impl.vllm.invariants import check_kv_cache_manager

        check_kv_cache_manager(self._mgr, num_blocks=self.pool_config.num_blocks,
                               requests=self._requests if held_tables else None)
        self._allocation_watch.check()


def vllm_resolve_block_hashes(block_hashes: list[bytes], hash_block_size: int, block_size: int,
                              view_block_size: int | None = None) -> list[bytes]:
    """vLLM's ``resolve_block_hashes`` on ``block_hashes`` (first wrapped in vLLM's own
    ``BlockHashListWithBlockSize`` at ``view_block_size`` when given), read out as a list: what a
    group of ``block_size`` sees. For conformance of the reference's function (issue #23)."""
    utils = load_vllm()["utils"]
    hashes: Any = list(block_hashes)
    if view_block_size is not None and view_block_size != hash_block_size:
        hashes = utils.BlockHashListWithBlockSize(hashes, hash_block_size, view_block_size)
    return [bytes(h) for h in utils.resolve_block_hashes(hashes, hash_block_size, block_size)]


def _stats_plain(stats: Any) -> dict[str, Any] | None:
    """A vLLM ``PrefixCacheStats`` as the plain dict the reference's ``to_plain`` gives."""
    if stats is None:
        return None
    return {"reset": stats.reset, "requests": stats.requests, "queries": stats.queries, "hits": stats.hits,
            "preempted_requests": stats.preempted_requests, "preempted_queries": stats.preempted_queries,
            "preempted_hits": stats.preempted_hits,
            "hits_by_source": {getattr(k, "value", k): n for k, n in stats.hits_by_source.items()}}


def make_vllm_manager(pool_config: PoolConfig) -> VllmKVCacheManager:
    return VllmKVCacheManager(pool_config)


def _register() -> None:
    from kvref.impl.interface import register_manager

    register_manager("vllm", VllmKVCacheManager)


_register()
