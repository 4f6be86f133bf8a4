"""Argument checks of the KV cache manager's public entries (kvref issue #26, "a thin core").

:class:`~kvref.impl.reference.kv_cache_manager.KVCacheManager` and the reference adapter call these
at the top of a public method; what follows is the plain manager, as vLLM's. Every check runs
before the first state change and raises :class:`~kvref.spec.errors.InvalidFieldError` (or
:class:`~kvref.impl.reference.errors.UnknownRequestError`) naming the field, so a rejected call
changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvref.impl.request import Request
from kvref.spec.errors import InvalidFieldError, check_int
from kvref.spec.kv_cache_interface import FullAttentionSpec

from .block_pool_checks import check_own
from .errors import UnknownRequestError

if TYPE_CHECKING:
    from .kv_cache_block import KVCacheBlock
    from .kv_cache_manager import KVCacheBlocks, KVCacheManager


_COUNT_FIELDS = ("num_new_tokens", "num_new_computed_tokens", "num_lookahead_tokens",
                 "num_external_computed_tokens", "num_encoder_tokens", "reserved_blocks",
                 "request.num_computed_tokens", "request.num_in_flight_tokens")


def check_request(request: object) -> None:
    if not isinstance(request, Request):
        raise InvalidFieldError("request", request, "a kvref.impl.request.Request")


def check_request_id(request_id: object) -> None:
    if not isinstance(request_id, str):
        raise InvalidFieldError("request_id", request_id, "a request id (str)")


def check_group_ids(field: str, group_ids: object, num_groups: int) -> None:
    if not isinstance(group_ids, (tuple, list)) or any(
            type(g) is not int or not 0 <= g < num_groups for g in group_ids):
        raise InvalidFieldError(field, group_ids, f"a tuple of group ids in [0, {num_groups})")


def check_kv_cache_blocks(manager: KVCacheManager, blocks: object) -> None:
    """One sequence of the manager's pool's blocks per KV cache group."""
    n = manager.num_kv_cache_groups
    if not isinstance(blocks, (tuple, list)) or len(blocks) != n \
            or not all(isinstance(g, (tuple, list)) for g in blocks):
        raise InvalidFieldError("blocks", blocks, f"{n} lists of blocks, one per KV cache group")
    for group in blocks:
        check_own(manager.block_pool, group, "blocks")


def check_allocate_slots(manager: KVCacheManager, request: Request, num_new_tokens: int,
                         num_new_computed_tokens: int, new_computed_blocks: KVCacheBlocks | None,
                         num_lookahead_tokens: int, num_external_computed_tokens: int, num_encoder_tokens: int,
                         reserved_blocks: int) -> tuple[Sequence[KVCacheBlock], ...]:
    """Check every argument of ``allocate_slots`` before anything changes; return the hits per
    group (a retained longer hit cut to the part reused, as vLLM cuts it)."""
    check_request(request)
    kv_cache_blocks = type(manager.empty_kv_cache_blocks)  # KVCacheBlocks, without an import cycle
    values = (num_new_tokens, num_new_computed_tokens, num_lookahead_tokens,
              num_external_computed_tokens, num_encoder_tokens, reserved_blocks,
              request.num_computed_tokens, request.num_in_flight_tokens)
    if set(map(type, values)) != {int} or min(values) < 0:  # C-level fast path; then name it
        for name, value in zip(_COUNT_FIELDS, values):
            check_int(name, value, minimum=0)
    if num_new_tokens == 0 and num_external_computed_tokens == 0 and num_new_computed_tokens == 0:
        raise InvalidFieldError("num_new_tokens", 0, "> 0 when there are no computed tokens to adopt")
    if request.num_tokens > manager.max_model_len:
        raise InvalidFieldError("request.num_tokens", request.num_tokens,
                                f"at most max_model_len={manager.max_model_len}")
    total = request.num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens \
        + num_new_tokens
    if total > manager.max_model_len:
        raise InvalidFieldError("num_new_tokens", num_new_tokens,
                                f"at most max_model_len={manager.max_model_len} tokens in all "
                                f"(computed + new computed + external + new = {total})")
    rid = request.request_id
    if request.num_computed_tokens > 0 and manager.num_kv_cache_groups and not any(
            rid in m.req_to_blocks for m in manager.coordinator.single_type_managers):
        raise UnknownRequestError(rid, f"claims num_computed_tokens={request.num_computed_tokens} "
                                       "but holds no blocks (freed, or never allocated)")
    if new_computed_blocks is None or (isinstance(new_computed_blocks, kv_cache_blocks)
                                       and not any(new_computed_blocks.blocks)):
        if num_new_computed_tokens:  # a prefix hit brings its blocks: tokens without blocks are fake
            raise InvalidFieldError("num_new_computed_tokens", num_new_computed_tokens,
                                    "0 when new_computed_blocks is None or empty")
        return manager.empty_kv_cache_blocks.blocks
    if not isinstance(new_computed_blocks, kv_cache_blocks) or \
            len(new_computed_blocks.blocks) != manager.num_kv_cache_groups:
        raise InvalidFieldError("new_computed_blocks", new_computed_blocks,
                                f"None or KVCacheBlocks with {manager.num_kv_cache_groups} groups")
    if not any(new_computed_blocks.blocks):
        return manager.empty_kv_cache_blocks.blocks
    if manager.coordinator.is_running(rid):
        raise InvalidFieldError("new_computed_blocks", new_computed_blocks,
                                f"empty: request {rid!r} is already running (no new hits)")
    if not manager.enable_caching:
        raise InvalidFieldError("new_computed_blocks", new_computed_blocks,
                                "None or empty when prefix caching is disabled")
    if request.num_computed_tokens:
        raise InvalidFieldError("new_computed_blocks", new_computed_blocks,
                                "empty for a request with computed tokens (hits start at token 0)")
    # A hit of n tokens holds cdiv(n, block_size) entries in every cacheable group; it ends on a
    # block boundary unless fine-grained hits let it end on a hash boundary inside the block.
    unit = manager.block_pool.hash_block_size if manager.coordinator.enable_partial_hash_hits else None
    hits = list(new_computed_blocks.blocks)
    for g, (group, spec, manager) in enumerate(zip(new_computed_blocks.blocks, manager.coordinator.specs,
                                                    manager.coordinator.single_type_managers)):
        block_size = manager.block_size  # block_size × DCP for a DCP-sharded group
        expected = -(-num_new_computed_tokens // block_size) if spec.prefix_cacheable else 0
        retained = getattr(manager, "retains_longer_hit", False)
        if retained and len(group) > expected:
            # the HiSparse host source keeps a longer hit: vLLM keeps the part the local and
            # external hits reuse (KVCacheManager.allocate_slots, retained_hit_group_ids)
            group = hits[g] = group[:-(-(num_new_computed_tokens + num_external_computed_tokens) // block_size)]
        # a divergent hybrid hit (get_computed_blocks_for_connector) may leave a group lagging
        # behind the full-attention hit; vLLM takes it only with external tokens behind it
        lagging = num_external_computed_tokens > 0 and len(group) < expected
        wrong_length = len(group) < expected or (len(group) > expected and not retained)
        if (wrong_length and not lagging) or (expected and num_new_computed_tokens % (unit or block_size)):
            raise InvalidFieldError(
                "num_new_computed_tokens", num_new_computed_tokens,
                f"a hit length matching new_computed_blocks (group {g} has {len(group)} blocks "
                f"of {block_size} tokens)")
        check_own(manager.block_pool, group, "new_computed_blocks")
        # What find_longest_cache_hit returns: cached blocks; null only as the placeholder of a
        # skipped position, which full attention never has (an unpublished or null "hit" shares
        # nothing real; chunked-local hits may be all null, vLLM counts them as computed).
        for b in group:
            if b._block_hash is None and (not b.is_null or isinstance(spec, FullAttentionSpec)):
                break
        else:
            continue
        raise InvalidFieldError(f"new_computed_blocks[{g}]", [b.block_id for b in group],
                                "cached blocks of this pool (a prefix-cache hit; null only where a "
                                "windowed group skips a block)")
    return tuple(hits)
