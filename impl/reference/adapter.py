"""The reference behind the shared protocol: :class:`ReferenceKVCacheManager` speaks plain ids.

It wraps :class:`~kvref.impl.reference.kv_cache_manager.KVCacheManager` and converts at the
boundary (block objects <-> ints, ``KVCacheBlocks`` <-> tuples per group), so the conformance
state machine can compare it with the vLLM adapter and the torch implementation without object
identity.
"""

from __future__ import annotations

from kvref.impl.interface import BlockIds, KVCacheManagerLike, PoolConfig
from kvref.impl.request import Request
from kvref.spec.errors import InvalidFieldError, check_int
from kvref.spec.kv_cache_interface import MambaSpec
from kvref.spec.prefix_cache_retention import validate_prefix_cache_retention_interval

from .block_hash import get_block_hash
from .kv_cache_manager import KVCacheBlocks, KVCacheManager
from .kv_cache_manager_checks import check_request, check_request_id
from .kv_events import event_to_plain


class ReferenceKVCacheManager(KVCacheManagerLike):
    """``KVCacheManagerLike`` for the reference runtime. ``.manager`` is the rich object."""

    def __init__(self, config: PoolConfig) -> None:
        self.manager = KVCacheManager(config)
        self.num_groups = self.manager.num_kv_cache_groups

    def _ids(self, blocks: KVCacheBlocks) -> BlockIds:
        return tuple(tuple(b.block_id for b in group) for group in blocks.blocks)

    def get_computed_blocks(self, request: Request, max_cache_hit_length: int | None = None) -> tuple[BlockIds, int]:
        """The local hit; ``max_cache_hit_length`` caps it (vLLM's scheduler passes the aux-output
        connector's ``max_cache_hit``; None: ``num_tokens - 1``)."""
        blocks, num_hit, _ = self.manager.get_computed_blocks(request, max_cache_hit_length)
        return self._ids(blocks), num_hit

    def rejects_prefix_cache_retention_interval(self, retention_interval: object) -> bool:
        """Whether this pool's groups refuse ``retention_interval`` (what building a ``PoolConfig``
        with it would raise, spec/prefix_cache_retention.py); nothing is built."""
        try:
            validate_prefix_cache_retention_interval(retention_interval, self.manager.config.scheduler_block_size,
                                                     self.manager.config.groups)
        except InvalidFieldError:
            return True
        return False

    @property
    def mamba_shared_prefix_checkpoint(self) -> bool:
        """Whether the pool's Mamba groups key the shared-prefix junction (the manager's narrowing
        of ``enable_mamba_shared_prefix_checkpoint``; the scheduler splits chunks by it)."""
        return self.manager.mamba_shared_prefix_checkpoint

    def get_computed_blocks_and_boundary(self, request: Request) -> tuple[BlockIds, int, int]:
        """The whole ``get_computed_blocks`` answer: hit ids, hit tokens and the shared-prefix
        boundary (where a sparse-retention group lags a longer hit; the scheduler stores it on the
        request as ``shared_prefix_boundary``)."""
        blocks, num_hit, boundary = self.manager.get_computed_blocks(request)
        return self._ids(blocks), num_hit, boundary

    def _blocks_from_ids(self, ids: BlockIds | None) -> KVCacheBlocks | None:
        if ids is None:
            return None
        pool = self.manager.block_pool
        if not isinstance(ids, (tuple, list)) or len(ids) != self.num_groups:
            raise InvalidFieldError("new_computed_block_ids", ids, f"None or {self.num_groups} tuples of ids")
        groups = []
        for group in ids:
            if not isinstance(group, (tuple, list)):
                raise InvalidFieldError("new_computed_block_ids", ids, f"None or {self.num_groups} tuples of ids")
            blocks = []
            for bid in group:
                if type(bid) is not int or not 0 <= bid < pool.num_gpu_blocks:
                    raise InvalidFieldError("new_computed_block_ids", bid,
                                            f"block ids in [0, {pool.num_gpu_blocks})")
                blocks.append(pool.blocks[bid])
            groups.append(blocks)
        return KVCacheBlocks(tuple(groups))

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_block_ids: BlockIds | None = None, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                       full_sequence_must_fit: bool = False, reserved_blocks: int = 0,
                       has_scheduled_reqs: bool = True,
                       skip_zeroing_group_ids: tuple[int, ...] = (), num_encoder_tokens: int = 0) -> BlockIds | None:
        out = self.manager.allocate_slots(
            request, num_new_tokens, num_new_computed_tokens, self._blocks_from_ids(new_computed_block_ids),
            num_lookahead_tokens=num_lookahead_tokens,
            num_external_computed_tokens=num_external_computed_tokens,
            delay_cache_blocks=delay_cache_blocks, full_sequence_must_fit=full_sequence_must_fit,
            reserved_blocks=reserved_blocks, has_scheduled_reqs=has_scheduled_reqs,
            skip_zeroing_group_ids=skip_zeroing_group_ids, num_encoder_tokens=num_encoder_tokens)
        if out is None:
            return None
        if not out.blocks:  # no groups
            return ()
        return self._ids(out)

    def free(self, request: Request) -> None:
        self.manager.free(request)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """vLLM's ``KVCacheManager.cache_blocks`` (publish full blocks up to a token count): what
        the scheduler calls when an async KV load completes (``_update_waiting_for_remote_kv``)."""
        m = self.manager
        check_request(request)
        check_int("num_computed_tokens", num_computed_tokens, minimum=0)
        for gid, stm in enumerate(m.coordinator.single_type_managers):
            allocated = len(stm.req_to_blocks.get(request.request_id, ())) * stm.block_size
            # Mamba states and non-cacheable groups (a circular buffer's one ring block) are not
            # token-indexed: their tables never span the tokens
            if num_computed_tokens > allocated and not isinstance(stm.kv_cache_spec, MambaSpec) \
                    and stm.kv_cache_spec.prefix_cacheable:
                raise InvalidFieldError("num_computed_tokens", num_computed_tokens,
                                        f"at most the {allocated} tokens group {gid} has blocks for")
        if m.enable_caching:
            m.coordinator.cache_blocks(request, m.block_hashes(request), num_computed_tokens)

    def get_block_ids(self, request_id: str) -> BlockIds:
        return tuple(tuple(ids) for ids in self.manager.get_block_ids(request_id))

    def get_num_free_blocks(self) -> int:
        return self.manager.get_num_free_blocks()

    def free_block_queue(self) -> tuple[int, ...]:
        return self.manager.block_pool.free_block_ids()

    def cached_blocks(self) -> dict[tuple[int, int], bytes]:
        """Every block with a primary key: ``{(group, block id): hash bytes without the group id}``."""
        out = {}
        for block in self.manager.block_pool.blocks:
            key = block.block_hash
            if key is not None:
                out[(int.from_bytes(key[-4:], "big"), block.block_id)] = get_block_hash(key)
        return out

    def check_invariants(self) -> None:
        self.manager.check_invariants()

    # optional protocol methods

    def new_step_starts(self) -> None:
        self.manager.new_step_starts()

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """vLLM ``take_boundary_state_offloads`` (Mamba "align" hand-offs, drained every step)."""
        return self.manager.take_boundary_state_offloads()

    def finalize_partial_tail_offloads(self, request: Request) -> list[tuple[int, int, int]]:
        """vLLM ``finalize_partial_tail_offloads`` (a finishing producer's partial tails)."""
        return self.manager.finalize_partial_tail_offloads(request)

    def release_kv_cache_block_copies(self) -> list[tuple[int, int]]:
        """The scheduler's end of ``schedule()``: drain the pending copy-on-write pairs and free
        their retained endpoints (vLLM ``take_kv_cache_block_copies`` + ``block_pool.free_blocks``
        when the copy's step cannot still be in flight). Returns the (source, destination) ids."""
        pairs: list[tuple[int, int]] = []
        retained = []
        for manager in self.manager.coordinator.single_type_managers:
            for src, dst in manager.take_pending_cow_copies():
                pairs.append((src.block_id, dst.block_id))
                retained += (src, dst)
        if retained:
            self.manager.block_pool.free_blocks(retained)
        return pairs

    def forget(self, request_id: str) -> None:
        """The reference drops a request's hashes when its blocks are freed; nothing else to drop."""
        check_request_id(request_id)
        if self.manager.hasher is not None:
            self.manager.hasher.forget(request_id)

    def cached_block_num_tokens(self) -> dict[tuple[int, int], int | None]:
        """``{(group_id, block_id): prefix tokens the primary hash covers}``."""
        return {(int.from_bytes(b.block_hash[-4:], "big"), b.block_id): b.block_hash_num_tokens
                for b in self.manager.block_pool.blocks if b.block_hash is not None}

    def take_kv_events(self) -> list[dict]:
        """The queued KV cache events as plain dicts (``kv_events.event_to_plain``); [] with
        events off."""
        return [event_to_plain(e) for e in self.manager.take_events()]

    def reset_prefix_cache(self) -> bool:
        return self.manager.reset_prefix_cache()

    # block hashes, prefix-cache stats, KV-connector views (issue #23)

    def request_block_hashes(self, request: Request) -> tuple[bytes, ...]:
        """The request's chained block hashes (vLLM's ``Request.block_hashes``)."""
        return tuple(self.manager.block_hashes(request))

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        self.manager.record_prefix_cache_stats(request, num_hits)

    def prefix_cache_stats(self) -> dict | None:
        """The stats gathered since the last ``make_prefix_cache_stats`` (not reset here)."""
        stats = self.manager.prefix_cache_stats
        return None if stats is None else stats.to_plain()

    def make_prefix_cache_stats(self) -> dict | None:
        stats = self.manager.make_prefix_cache_stats()
        return None if stats is None else stats.to_plain()

    @property
    def usage(self) -> float:
        return self.manager.usage

    def get_block_ids_for_computed_tokens(self, request_id: str, num_computed_tokens: int) -> BlockIds:
        return tuple(tuple(ids) for ids in self.manager.get_block_ids_for_computed_tokens(
            request_id, num_computed_tokens))

    def estimate_cached_tokens(self, request: Request) -> int:
        return self.manager.estimate_cached_tokens(request)

    def truncate_computed_blocks(self, block_ids: BlockIds, num_computed_tokens: int) -> BlockIds:
        blocks = self._blocks_from_ids(block_ids)
        if blocks is None:
            blocks = self.manager.empty_kv_cache_blocks
        return self._ids(self.manager.truncate_computed_blocks(blocks, num_computed_tokens))

    def get_computed_blocks_for_connector(self, request: Request, max_cache_hit_length: int | None = None
                                          ) -> tuple[BlockIds, int, int, bool]:
        blocks, num_hit, boundary, diverged = self.manager.get_computed_blocks_for_connector(
            request, max_cache_hit_length)
        return self._ids(blocks), num_hit, boundary, diverged

    def free_holding_view(self, request: Request) -> BlockIds:
        """``free`` while holding the ``get_blocks`` result taken just before it (a connector's
        view): returns the ids that view shows after the free (vLLM: still the table order)."""
        check_request(request)
        view = self.manager.get_blocks(request.request_id)
        self.manager.free(request)
        return self._ids(view)

    def evict_blocks(self, block_ids: set[int]) -> None:
        self.manager.evict_blocks(block_ids)

    # KV zeroing records (issue #23)

    def take_new_block_ids(self) -> list[int]:
        """The block ids recorded for worker-side zeroing since the last call."""
        return self.manager.take_new_block_ids()

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        self.manager.record_blocks_for_zeroing(request_id, start_token)


def _register() -> None:
    try:
        from kvref.impl.interface import register_manager
    except ImportError:  # an interface without the registry
        return
    register_manager("reference", ReferenceKVCacheManager)


_register()
