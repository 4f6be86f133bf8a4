"""The scheduler's entry point to the KV cache (vLLM ``KVCacheManager``, ``vllm/v1/core/kv_cache_manager.py``).

``get_computed_blocks`` finds the prefix-cache hit of a new request; ``allocate_slots`` admits
and grows requests with every gate vLLM 0.33.0 has, in vLLM's order:

1. reject a call that neither computes nor adopts tokens;
2. the *full-sequence gate* (``full_sequence_must_fit``): the whole request, capped at
   ``max_model_len``, with the windowed groups' admission cap (``apply_admission_cap=True``) plus
   the watermark must fit the free blocks — else None (vLLM #40946 / #39734);
3. free out-of-window blocks on the *processed* basis (computed minus in-flight tokens) — even if
   the allocation then fails;
4. the per-step check: blocks for this step's slots (incl. lookahead) plus the watermark must
   fit ``free - reserved_blocks`` — else None, with nothing touched or allocated;
5. add the hits (two phases) and allocate new blocks;
6. unless ``delay_cache_blocks`` (async KV loads), publish full blocks up to
   ``min(computed + new, request.num_tokens)`` (never draft tokens).

Running out of blocks is an answer (``None``), not an exception; bad arguments raise
:class:`~kvref.spec.errors.InvalidFieldError` / :class:`~kvref.spec.errors.KVRefError` before
anything changes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from kvref.impl.interface import PoolConfig
from kvref.impl.request import Request, RequestStatus
from kvref.spec.errors import InvalidFieldError, check_int
from kvref.spec.kv_cache_interface import (
    AttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    UniformTypeKVCacheSpecs,
)

from .block_hash import BlockHash, RequestBlockHasher, get_hash_fn_by_name
from .hisparse_invariants import check_hisparse_ref_counts
from .kv_cache_block import KVCacheBlock
from .kv_cache_coordinator import KVCacheCoordinator, get_kv_cache_coordinator
from .kv_cache_manager_checks import (
    check_allocate_slots,
    check_group_ids,
    check_kv_cache_blocks,
    check_request,
    check_request_id,
)
from .kv_events import BlockStored, KVCacheEvent, kv_cache_spec_kind, kv_cache_spec_sliding_window
from .mamba_manager import MambaManager
from .prefix_cache_stats import PrefixCacheStats


def _is_mamba(spec: object) -> bool:
    """Whether a group spec holds Mamba layers (a UniformType group may)."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return any(isinstance(s, MambaSpec) for s in spec.kv_cache_specs.values())
    return isinstance(spec, MambaSpec)


class KVCacheBlocks:
    """Blocks per KV-cache group: ``blocks[group][j]`` (vLLM's allocation result)."""

    __slots__ = ("blocks",)

    def __init__(self, blocks: tuple[Sequence[KVCacheBlock], ...]) -> None:
        self.blocks = blocks

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in group] for group in self.blocks)

    def get_unhashed_block_ids(self) -> list[list[int]]:
        return [[b.block_id for b in group if b.block_hash is None and not b.is_null] for group in self.blocks]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KVCacheBlocks) and self.get_block_ids() == other.get_block_ids()

    def __repr__(self) -> str:
        return f"KVCacheBlocks({self.get_block_ids()})"


class KVCacheManager:
    """vLLM-shaped KV cache manager, built from a :class:`~kvref.impl.interface.PoolConfig`.

    ``max_in_flight_tokens=None`` in the config means ``max_model_len`` (the cap is then
    effectively off), as in vLLM.
    """

    def __init__(self, config: PoolConfig) -> None:
        if not isinstance(config, PoolConfig):
            raise InvalidFieldError("config", config, "a kvref.impl.interface.PoolConfig")
        self.config = config
        self.max_model_len = config.max_model_len
        self.enable_caching = config.enable_caching
        self.coordinator: KVCacheCoordinator = get_kv_cache_coordinator(config)
        self.block_pool = self.coordinator.block_pool
        #: the shared-prefix checkpoint (issue #23, vLLM's ``enable_mamba_shared_prefix_checkpoint``),
        #: narrowed as vLLM narrows it: only with EAGLE groups (a sibling resumes at the junction),
        #: partial hash hits (a sub-block junction can be keyed) and no multi-module MTP tail (then
        #: ``cache_blocks`` is handed the computed count less the re-prefillable tail, not the chunk
        #: end). The scheduler reads the same predicate, so it never ends a chunk at a junction the
        #: Mamba managers would refuse to key.
        self.mamba_shared_prefix_checkpoint = (
            config.enable_mamba_shared_prefix_checkpoint
            and bool(self.coordinator.eagle_group_ids)
            and self.coordinator.enable_partial_hash_hits
            and self.coordinator.num_reprefillable_tokens == 0)
        if self.mamba_shared_prefix_checkpoint:
            for manager in self.coordinator.single_type_managers:
                if isinstance(manager, MambaManager):
                    manager.shared_prefix_checkpoint = True
        self.enable_kv_cache_events = config.enable_kv_cache_events
        #: per group: (kv_cache_spec_kind, sliding window) that ``take_events`` stamps on stores
        self.kv_cache_event_metadata = tuple(
            (kv_cache_spec_kind(g.kv_cache_spec), kv_cache_spec_sliding_window(g.kv_cache_spec))
            for g in config.groups)
        self.num_kv_cache_groups = len(config.groups)
        self.watermark_blocks = int(config.watermark * config.num_blocks)
        # the pool publishes lookahead tokens in its events (vLLM hands it the count at construction)
        self.block_pool.num_hash_lookahead_tokens = config.num_hash_lookahead_tokens
        self.hasher = RequestBlockHasher(
            config.hash_block_size, get_hash_fn_by_name(config.prefix_caching_hash_algo),
            config.num_hash_lookahead_tokens, config.none_hash_seed) if config.enable_caching else None
        self.log_stats = config.log_stats
        self.prefix_cache_stats: PrefixCacheStats | None = PrefixCacheStats() if config.log_stats else None
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in range(self.num_kv_cache_groups)))

    # ------------------------------------------------------------------ queries

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The stats since the last call, and a fresh object for the next (None without
        ``log_stats``)."""
        if not self.log_stats:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def prefix_cache_lookup_enabled(self, request: Request) -> bool:
        """Whether a local prefix-cache lookup may run for ``request``."""
        check_request(request)
        return self.enable_caching and not request.skip_reading_prefix_cache

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        """Count an admitted request's lookup (not one that skipped it); a request preempted
        before counts under the ``preempted_*`` fields."""
        check_request(request)
        check_int("num_hits", num_hits, minimum=0)
        if not self.log_stats or not self.prefix_cache_lookup_enabled(request):
            return
        assert self.prefix_cache_stats is not None
        self.prefix_cache_stats.record(request.num_tokens, num_hits, request.num_preemptions > 0)

    def block_hashes(self, request: Request) -> list[BlockHash]:
        """The request's chained block hashes (vLLM ``request.block_hashes``); [] without caching."""
        check_request(request)
        return [] if self.hasher is None else self.hasher.block_hashes(request)

    def create_kv_cache_blocks(self, blocks: tuple[Sequence[KVCacheBlock], ...]) -> KVCacheBlocks:
        """Wrap blocks per group (what ``get_computed_blocks`` returns): one sequence of this
        pool's blocks per KV cache group; ``allocate_slots`` checks that they are a real hit."""
        check_kv_cache_blocks(self, blocks)
        return self._wrap(blocks)

    def _wrap(self, blocks: tuple[Sequence[KVCacheBlock], ...]) -> KVCacheBlocks:
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    def get_computed_blocks(self, request: Request,
                            max_cache_hit_length: int | None = None) -> tuple[KVCacheBlocks, int, int]:
        """Prefix-cache hit of ``request``: (blocks per group, hit tokens, shared-prefix boundary).

        The hit never covers the last token (its logits must be computed): the cap defaults to
        ``num_tokens - 1``. Nothing is touched: hits stay evictable until ``allocate_slots``.
        """
        check_request(request)
        check_int("max_cache_hit_length", max_cache_hit_length, minimum=0, allow_none=True)
        if self.hasher is None or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0, 0
        if max_cache_hit_length is None:
            max_cache_hit_length = request.num_tokens - 1
        # a hit never exceeds the hashed tokens: a larger cap means the same (and would overflow islice)
        max_cache_hit_length = min(max_cache_hit_length, request.num_tokens)
        block_hashes = self.hasher.block_hashes(request)
        computed_blocks, num_new_computed_tokens, num_uncached_common_prefix_tokens = \
            self.coordinator.find_longest_cache_hit(block_hashes, max_cache_hit_length)
        # vLLM reads the report mode from SamplingParams.extra_args; kvref's Request carries it
        if num_new_computed_tokens > 0 and self.enable_kv_cache_events and request.kv_cache_report_mode == "full":
            self.coordinator.emit_cached_block_events(request, block_hashes, computed_blocks)
        # the junction to pin: where the lagging sparse-retention group stops plus the shared prefix
        # it has not cached (vLLM's shared_prefix_boundary, Marconi-style)
        shared_prefix_boundary = (num_new_computed_tokens + num_uncached_common_prefix_tokens
                                  if num_uncached_common_prefix_tokens else 0)
        return self._wrap(computed_blocks), num_new_computed_tokens, shared_prefix_boundary

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        check_request_id(request_id)
        return KVCacheBlocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.get_blocks(request_id).get_block_ids()

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    # ------------------------------------------------------------------ KV-connector views

    def get_block_ids_for_computed_tokens(self, request_id: str,
                                          num_computed_tokens: int) -> tuple[list[int], ...]:
        """The request's block ids that cover its first ``num_computed_tokens`` tokens: what a
        KV connector saves or sends. Token-indexed attention groups are cut to
        ``cdiv(n, block_size)`` blocks (the spec's own block size); Mamba, cross-attention and
        encoder-only groups are not token-indexed and keep their whole table."""
        check_request_id(request_id)
        check_int("num_computed_tokens", num_computed_tokens, minimum=0)
        out: list[list[int]] = []
        for group, ids in zip(self.config.groups, self.get_block_ids(request_id)):
            spec = group.kv_cache_spec
            if not isinstance(spec, AttentionSpec) or isinstance(spec, (CrossAttentionSpec,
                                                                        EncoderOnlyAttentionSpec)):
                out.append(ids)
                continue
            out.append(ids[:-(-num_computed_tokens // spec.block_size)])
        return tuple(out)

    def estimate_cached_tokens(self, request: Request) -> int:
        """The prefix every cacheable group of the request has published: per group the longest
        prefix one of its blocks is cached for, the minimum over groups (0 if none)."""
        check_request(request)
        cached: int | None = None
        for group, blocks in zip(self.config.groups, self.coordinator.get_blocks(request.request_id)):
            spec = group.kv_cache_spec
            if not spec.prefix_cacheable or isinstance(spec, (CrossAttentionSpec, EncoderOnlyAttentionSpec)):
                continue
            group_cached = max((b.block_hash_num_tokens or 0 for b in blocks), default=0)
            cached = group_cached if cached is None else min(cached, group_cached)
        return cached or 0

    def truncate_computed_blocks(self, blocks: KVCacheBlocks, num_computed_tokens: int) -> KVCacheBlocks:
        """A lookup result cut at an aligned token endpoint (a connector's external hit ends
        there). Pure slicing: reference counts untouched, ``blocks`` unchanged. A Mamba group may
        end before the endpoint (the connector supplies the final state); every other cacheable
        group must cover it; non-cacheable groups carry no hit blocks."""
        if not isinstance(blocks, KVCacheBlocks) or len(blocks.blocks) != self.num_kv_cache_groups:
            raise InvalidFieldError("blocks", blocks, f"KVCacheBlocks with {self.num_kv_cache_groups} groups")
        check_int("num_computed_tokens", num_computed_tokens, minimum=0)
        truncated: list[list[KVCacheBlock]] = []
        for g, (group_blocks, manager, group) in enumerate(zip(
                blocks.blocks, self.coordinator.single_type_managers, self.config.groups)):
            if not group.kv_cache_spec.prefix_cacheable:
                if group_blocks:
                    raise InvalidFieldError(f"blocks[{g}]", len(group_blocks),
                                            "no blocks for a group that is not prefix-cacheable")
                truncated.append([])
                continue
            if num_computed_tokens % manager.block_size:
                raise InvalidFieldError("num_computed_tokens", num_computed_tokens,
                                        f"a multiple of group {g}'s block size {manager.block_size}")
            num_blocks = num_computed_tokens // manager.block_size
            if isinstance(group.kv_cache_spec, MambaSpec):  # as vLLM: a UniformType group is not
                num_blocks = min(num_blocks, len(group_blocks))
            elif num_blocks > len(group_blocks):
                raise InvalidFieldError("num_computed_tokens", num_computed_tokens,
                                        f"at most the {len(group_blocks) * manager.block_size} tokens "
                                        f"group {g}'s blocks cover")
            truncated.append(list(group_blocks[:num_blocks]))
        return self._wrap(tuple(truncated))

    def get_computed_blocks_for_connector(self, request: Request, max_cache_hit_length: int | None = None
                                          ) -> tuple[KVCacheBlocks, int, int, bool]:
        """The local prefix for a request scheduled with a KV connector: ``get_computed_blocks``'s
        triple plus ``hit_diverged``.

        Hybrid Mamba + full-attention pools look up every group on its own and report the
        full-attention hit as the local prefix (the connector brings the rest and the Mamba state),
        flagging when a lagging group hit less; if some group hit *deeper* than full attention
        (its full-attention tail was evicted), the reconciled ``get_computed_blocks`` answer is
        used. Any other pool: ``get_computed_blocks`` and False."""
        check_request(request)
        check_int("max_cache_hit_length", max_cache_hit_length, minimum=0, allow_none=True)
        fa_group_id = self._full_attention_group_id()
        if fa_group_id is None or not any(_is_mamba(g.kv_cache_spec) for g in self.config.groups):
            return (*self.get_computed_blocks(request, max_cache_hit_length), False)
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0, False
        if max_cache_hit_length is None:
            max_cache_hit_length = request.num_tokens - 1
        assert self.hasher is not None
        computed, per_group_hits = self.coordinator.find_longest_cache_hit_per_group(  # type: ignore[attr-defined]
            self.hasher.block_hashes(request), max_cache_hit_length)
        if any(hit > per_group_hits[fa_group_id] for hit in per_group_hits):
            return (*self.get_computed_blocks(request, max_cache_hit_length), False)
        num_local = per_group_hits[fa_group_id]
        return self._wrap(computed), num_local, 0, min(per_group_hits) < num_local

    def _full_attention_group_id(self) -> int | None:
        """vLLM's ``HybridKVCacheCoordinator.full_attention_group_id``: the first group of the
        first spec group when that one is full attention (they sort first); None otherwise and for
        the other coordinators."""
        groups = getattr(self.coordinator, "attention_groups", None)
        if not groups or not getattr(self.coordinator, "find_longest_cache_hit_per_group", None):
            return None
        first = groups[0]
        return first.group_ids[0] if isinstance(first.spec, FullAttentionSpec) else None

    # ------------------------------------------------------------------ allocation

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                       num_encoder_tokens: int = 0, full_sequence_must_fit: bool = False,
                       reserved_blocks: int = 0, has_scheduled_reqs: bool = True,
                       skip_zeroing_group_ids: tuple[int, ...] = ()) -> KVCacheBlocks | None:
        """Allocate slots for ``num_new_tokens`` (+ lookahead) tokens; None if they do not fit.

        Args follow vLLM: ``num_new_computed_tokens``/``new_computed_blocks`` are the prefix-cache
        hit from ``get_computed_blocks``; ``num_external_computed_tokens`` are loaded by a KV
        connector; ``full_sequence_must_fit`` is the admission gate for waiting requests;
        ``reserved_blocks`` stay free for in-flight sequences; ``has_scheduled_reqs`` turns the
        watermark on for waiting/preempted requests; ``skip_zeroing_group_ids`` are the groups an
        asynchronous KV load writes (their external blocks are not recorded for zeroing). Returns
        the newly allocated blocks.
        """
        check_group_ids("skip_zeroing_group_ids", skip_zeroing_group_ids, self.num_kv_cache_groups)
        new_computed_block_list = check_allocate_slots(
            self, request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, num_lookahead_tokens,
            num_external_computed_tokens, num_encoder_tokens, reserved_blocks)
        coordinator = self.coordinator
        rid = request.request_id
        num_local_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        total_computed_tokens = min(num_local_computed_tokens + num_external_computed_tokens, self.max_model_len)
        # vLLM: the watermark holds back only requests that are not running yet, and only when
        # others are scheduled (a lone request may use every block)
        watermark_blocks = 0
        if has_scheduled_reqs and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            watermark_blocks = self.watermark_blocks
        num_tokens = request.num_tokens
        prefill_end = max(request.num_prompt_tokens, num_tokens - 1)

        if full_sequence_must_fit:  # admission: the whole request must fit (vLLM #40946 / #39734)
            full_num_tokens = min(num_tokens, self.max_model_len)
            num_blocks_to_allocate = coordinator.get_num_blocks_to_allocate(
                rid, full_num_tokens, new_computed_block_list, num_encoder_tokens, total_computed_tokens,
                num_local_computed_tokens, full_num_tokens, apply_admission_cap=True, prefill_end=prefill_end)
            if num_blocks_to_allocate + watermark_blocks > self.block_pool.get_num_free_blocks():
                return None

        num_tokens_main_model = total_computed_tokens + num_new_tokens
        num_tokens_need_slot = min(num_tokens_main_model + num_lookahead_tokens, self.max_model_len)
        # Free out-of-window blocks first (fewer evictions), on the processed basis: steps in
        # flight still read below the optimistic boundary.
        coordinator.remove_skipped_blocks(rid, max(0, total_computed_tokens - request.num_in_flight_tokens),
                                          request.num_prompt_tokens)
        num_blocks_to_allocate = coordinator.get_num_blocks_to_allocate(
            rid, num_tokens_need_slot, new_computed_block_list, num_encoder_tokens,
            num_local_computed_tokens + num_external_computed_tokens, num_local_computed_tokens,
            num_tokens_main_model, prefill_end=prefill_end)
        available_blocks = self.block_pool.get_num_free_blocks() - reserved_blocks
        if num_blocks_to_allocate + watermark_blocks > available_blocks:
            return None  # nothing touched or allocated: running out is an answer, not an error

        if new_computed_block_list is not self.empty_kv_cache_blocks.blocks or num_external_computed_tokens > 0:
            coordinator.allocate_new_computed_blocks(rid, new_computed_block_list, num_local_computed_tokens,
                                                     num_external_computed_tokens,
                                                     skip_zeroing_group_ids=tuple(skip_zeroing_group_ids))
        new_blocks = coordinator.allocate_new_blocks(rid, num_tokens_need_slot, num_tokens_main_model,
                                                     num_encoder_tokens)
        if delay_cache_blocks or self.hasher is None:  # an async KV load publishes once it lands
            return self._wrap(new_blocks)
        # vLLM: never publish draft tokens (capped at the request's verified tokens)
        num_tokens_to_cache = min(total_computed_tokens + num_new_tokens, num_tokens)
        coordinator.cache_blocks(request, self.hasher.block_hashes(request), num_tokens_to_cache)
        return self._wrap(new_blocks)

    # ------------------------------------------------------------------ freeing and the rest

    def free(self, request: Request) -> None:
        """Free the request's blocks (tail first, so tails are evicted first). Freeing a request
        that holds nothing is a no-op, as in vLLM (a request may be aborted before allocation)."""
        check_request(request)
        self.coordinator.free(request.request_id)
        if self.hasher is not None:
            self.hasher.forget(request.request_id)

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        check_request_id(request_id)
        check_int("processed_computed_tokens", processed_computed_tokens, minimum=0)
        check_int("num_prompt_tokens", num_prompt_tokens, minimum=0, allow_none=True)
        self.coordinator.remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)

    def evict_blocks(self, block_ids: set[int]) -> None:
        self.block_pool.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash when no block is in use; the stats then say ``reset``."""
        if not self.coordinator.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        """Forget the request's tables and return its blocks in allocation order, not yet freed:
        the caller frees them later, in reverse (a KV connector still reading them)."""
        check_request(request)
        blocks = self.coordinator.pop_blocks_for_free(request.request_id)
        if self.hasher is not None:
            self.hasher.forget(request.request_id)
        return blocks

    def take_events(self) -> list[KVCacheEvent]:
        """Take the pool's queued KV cache events; ``BlockStored`` events get their group's spec
        kind and sliding window stamped here, as vLLM's ``KVCacheManager.take_events`` does (the
        pool stays ignorant of specs)."""
        events = self.block_pool.take_events()
        meta = self.kv_cache_event_metadata
        for event in events:
            if isinstance(event, BlockStored) and event.group_idx is not None \
                    and 0 <= event.group_idx < len(meta):
                event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window = meta[event.group_idx]
        return events

    def new_step_starts(self) -> None:
        self.coordinator.new_step_starts()

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """Drain the Mamba "align" boundary-state hand-offs for a KV connector, as vLLM's scheduler
        does every step: ``{request id: [(group id, block id, boundary tokens), ...]}`` (committed
        boundary snapshots and the copy-on-write target of a sub-block partial hit)."""
        offloads: dict[str, list[tuple[int, int, int]]] = {}
        for manager in self.coordinator.single_type_managers:
            for request_id, group_id, block, boundary in manager.take_pending_boundary_state_offloads():
                offloads.setdefault(request_id, []).append((group_id, block.block_id, boundary))
        return offloads

    def finalize_partial_tail_offloads(self, request: Request) -> list[tuple[int, int, int]]:
        """A finishing KV producer's partial tails to offload: ``(group id, block id, boundary)``
        per Mamba "align" group whose request stopped exactly at its boundary with nothing in
        flight (vLLM calls it before freeing a producer's request)."""
        check_request(request)
        offloads = []
        for manager in self.coordinator.single_type_managers:
            finalized = manager.finalize_partial_tail_offload(
                request.request_id, request.num_computed_tokens, request.num_in_flight_tokens)
            if finalized is not None:
                group_id, block, boundary = finalized
                offloads.append((group_id, block.block_id, boundary))
        return offloads

    def take_kv_cache_block_copies(self) -> list[tuple[int, int]]:
        """Drain pending copy-on-write (source, destination) block-id pairs."""
        pairs = []
        for manager in self.coordinator.single_type_managers:
            pairs.extend((s.block_id, d.block_id) for s, d in manager.take_pending_cow_copies())
        return pairs

    # ------------------------------------------------------------------ KV zeroing (spec/kv_zeroing.py)

    @property
    def needs_kv_cache_zeroing(self) -> bool:
        """Whether the worker zeroes new blocks (Mamba layers or mixed cache precisions)."""
        return self.coordinator.needs_kv_cache_zeroing

    def take_new_block_ids(self) -> list[int]:
        """Drain the block ids recorded for zeroing since the last call, group by group (what the
        scheduler sends as ``new_block_ids_to_zero`` when ``needs_kv_cache_zeroing``)."""
        ids: list[int] = []
        for manager in self.coordinator.single_type_managers:
            ids.extend(manager.take_new_block_ids())
        return ids

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """Record the request's blocks from ``start_token`` on for zeroing again: the blocks a
        failed asynchronous KV load left unwritten (their zeroing was skipped at allocation).

        Raises:
            InvalidFieldError: ``start_token`` is not a non-negative multiple of every recording
                group's block size (zeroing a partly valid block would wipe its valid prefix; vLLM
                asserts it), or the request holds no blocks. Nothing is recorded then.
        """
        check_request_id(request_id)
        check_int("start_token", start_token, minimum=0)
        recording = [m for m in self.coordinator.single_type_managers if m.records_new_block_ids]
        for m in recording:
            if start_token % m.block_size:
                raise InvalidFieldError("start_token", start_token,
                                        f"a multiple of group {m.kv_cache_group_id}'s block size "
                                        f"{m.block_size} (a block-aligned valid prefix)")
            if request_id not in m.req_to_blocks:
                raise InvalidFieldError("request_id", request_id, "a request that holds blocks")
        for m in recording:
            m.new_block_ids.extend(b.block_id for b in m.req_to_blocks[request_id][start_token // m.block_size:])

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Deprecated in vLLM 0.33.0 (cascade attention removed): always zeros."""
        return [0] * self.num_kv_cache_groups

    def check_invariants(self, strict_ref_counts: bool = True) -> None:
        """Pool and manager invariants plus I9: every non-null block's reference count equals the
        number of table slots holding it (``>=`` when others may pin blocks, e.g. offloading).
        Rule names: docs/invariants.md."""
        self.coordinator.check_invariants()
        hisparse = getattr(self.coordinator, "hisparse_coordinator", None)
        if hisparse is not None:  # M16 replaces I9: pages released while read, transfers' pins, a host pool
            check_hisparse_ref_counts(self.coordinator.single_type_managers, hisparse)
            if self.hasher is not None:
                self.hasher.check_invariants()
            return
        slots: Counter[int] = Counter()
        for manager in self.coordinator.single_type_managers:
            for table in manager.req_to_blocks.values():
                slots.update(b.block_id for b in table if not b.is_null)
            for src, dst in manager._pending_cow_copies:  # both endpoints retained until copied
                slots[src.block_id] += 1
                slots[dst.block_id] += 1
        for block in self.block_pool.blocks[1:]:
            if strict_ref_counts:
                assert block.ref_cnt == slots[block.block_id], \
                    f"I9: block {block.block_id}: ref_cnt {block.ref_cnt} != {slots[block.block_id]} table slots"
            else:
                assert block.ref_cnt >= slots[block.block_id], \
                    f"I9: block {block.block_id}: ref_cnt {block.ref_cnt} < {slots[block.block_id]} table slots"
        if self.hasher is not None:
            self.hasher.check_invariants()
