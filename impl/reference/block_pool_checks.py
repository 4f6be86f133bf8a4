"""Argument checks of the block pool's public entries (kvref issue #26, "a thin core").

:class:`~kvref.impl.reference.block_pool.BlockPool` calls one of these at the top of each public
method and then the plain :class:`~kvref.impl.reference.block_pool.BlockPoolCore`, which trusts its
arguments as vLLM's ``BlockPool`` does. The KV cache managers call the core directly: every block
they pass is one of their own table's, and every count one they computed.

Each check raises :class:`~kvref.spec.errors.InvalidFieldError` naming the field, the value and
what is allowed, and changes nothing: every check runs before the first state change, so a
rejected call leaves the pool as it was (a call with too few blocks or hashes used to publish the
first ones and then raise).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvref.impl.interface import MAX_NUM_BLOCKS
from kvref.impl.request import Request
from kvref.spec.errors import InvalidFieldError, check_int

if TYPE_CHECKING:
    from .block_pool import BlockPoolCore
    from .kv_cache_block import KVCacheBlock


#: KV cache group ids are 4-byte big-endian suffixes of every prefix-cache key
MAX_GROUP_ID = (1 << 32) - 1


def check_group_id(field: str, value: object) -> None:
    if type(value) is not int or not 0 <= value <= MAX_GROUP_ID:
        raise InvalidFieldError(field, value, f"a KV cache group id (an int in [0, {MAX_GROUP_ID}])")


def as_list(field: str, value: object, what: str) -> list:
    """``value`` as a list, or InvalidFieldError (``list(5)`` raised TypeError from inside the pool)."""
    if isinstance(value, list):
        return value
    if isinstance(value, (str, bytes, dict)) or value is None:
        raise InvalidFieldError(field, value, what)
    try:
        return list(value)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidFieldError(field, value, what) from None


def check_own(pool: BlockPoolCore, blocks: Sequence[object], field: str) -> None:
    """Every element must be one of this pool's block objects (O(1) each)."""
    pool_blocks = pool.blocks
    for block in blocks:
        try:
            ok = pool_blocks[block.block_id] is block  # type: ignore[attr-defined]
        except (AttributeError, IndexError, TypeError):
            ok = False
        if not ok:
            raise InvalidFieldError(field, block, "blocks of this pool")


def own_blocks(pool: BlockPoolCore, value: object, field: str) -> Sequence[KVCacheBlock]:
    """``value`` (any iterable; a generator is read once) as a sequence of this pool's blocks."""
    blocks = value if isinstance(value, (list, tuple)) else as_list(field, value, "blocks of this pool")
    check_own(pool, blocks, field)
    return blocks  # type: ignore[return-value]


def check_pool_args(num_gpu_blocks: object, enable_caching: object, hash_block_size: object,
                    enable_kv_cache_events: object, medium: object, int_block_hashes: object,
                    num_hash_lookahead_tokens: object) -> None:
    check_int("num_gpu_blocks", num_gpu_blocks, minimum=1)
    if num_gpu_blocks > MAX_NUM_BLOCKS:  # type: ignore[operator]
        raise InvalidFieldError("num_gpu_blocks", num_gpu_blocks,
                                f"an int in [1, {MAX_NUM_BLOCKS}] (one Python object per block)")
    check_int("hash_block_size", hash_block_size, minimum=1)
    if not isinstance(enable_caching, bool):
        raise InvalidFieldError("enable_caching", enable_caching, "True or False")
    if not isinstance(enable_kv_cache_events, bool):
        raise InvalidFieldError("enable_kv_cache_events", enable_kv_cache_events, "True or False")
    if not isinstance(medium, str):
        raise InvalidFieldError("medium", medium, "a str such as 'GPU'")
    if int_block_hashes is not None and not isinstance(int_block_hashes, bool):
        raise InvalidFieldError("int_block_hashes", int_block_hashes, "None, True or False")
    check_int("num_hash_lookahead_tokens", num_hash_lookahead_tokens, minimum=0)


def check_get_cached_block(block_hash: object, kv_cache_group_ids: object) -> None:
    if not isinstance(block_hash, bytes):
        raise InvalidFieldError("block_hash", block_hash, "a block hash (bytes)")
    if not isinstance(kv_cache_group_ids, (list, tuple)):
        raise InvalidFieldError("kv_cache_group_ids", kv_cache_group_ids, "a list of KV cache group ids")
    for gid in kv_cache_group_ids:
        check_group_id("kv_cache_group_ids[i]", gid)


def _check_block_size(pool: BlockPoolCore, block_size: int) -> None:
    check_int("block_size", block_size, minimum=1)
    if block_size % pool.hash_block_size:
        raise InvalidFieldError("block_size", block_size, f"a multiple of hash_block_size={pool.hash_block_size}")


def _check_events_request(pool: BlockPoolCore, request: object, what: str) -> None:
    if pool.enable_kv_cache_events and not isinstance(request, Request):
        raise InvalidFieldError("request", request, f"the Request whose {what} cached (BlockStored events "
                                                    "carry its tokens)")


def check_cache_full_blocks(pool: BlockPoolCore, block_hashes: Sequence[bytes], blocks: Sequence[KVCacheBlock],
                            num_cached_blocks: int, num_full_blocks: int, block_size: int, kv_cache_group_id: int,
                            block_mask: Sequence[bool] | None, request: Request | None) -> None:
    """Everything ``cache_full_blocks`` relies on; an empty range is accepted whatever the rest."""
    check_int("num_cached_blocks", num_cached_blocks, minimum=0)
    check_int("num_full_blocks", num_full_blocks, minimum=0)
    if num_cached_blocks >= num_full_blocks:
        return
    _check_events_request(pool, request, "blocks are")
    hbs = pool.hash_block_size
    _check_block_size(pool, block_size)
    check_group_id("kv_cache_group_id", kv_cache_group_id)
    n_cached, n_full, size = num_cached_blocks, num_full_blocks, block_size
    if not isinstance(blocks, (list, tuple)) or len(blocks) < n_full:
        raise InvalidFieldError("blocks", blocks, f"the request's block table, at least num_full_blocks="
                                                  f"{n_full} blocks of this pool")
    if not isinstance(block_hashes, (list, tuple)) or len(block_hashes) * hbs < n_full * size:
        raise InvalidFieldError("block_hashes", block_hashes, f"at least {n_full * size // hbs} "
                                                              "block hashes (bytes) covering the range")
    if block_mask is not None and (not isinstance(block_mask, (list, tuple))
                                   or len(block_mask) < n_full - n_cached):
        raise InvalidFieldError("block_mask", block_mask, f"None or {n_full - n_cached} bools")
    span = blocks[n_cached:n_full]
    check_own(pool, span, "blocks")
    for i, block in enumerate(span, n_cached):
        if block.is_null or (block_mask is not None and not block_mask[i - n_cached]):
            continue  # skipped by the caching loop too
        last_hash = (i + 1) * size // hbs - 1
        if not isinstance(block_hashes[last_hash], bytes):
            raise InvalidFieldError(f"block_hashes[{last_hash}]", block_hashes[last_hash], "bytes")
        if block._block_hash is not None and (
                block._block_hash_num_tokens is None or block._block_hash_num_tokens >= (i + 1) * size):
            raise InvalidFieldError(f"blocks[{i}]", block.block_id, f"a block not yet cached for "
                                    f"{(i + 1) * size} tokens (it is: already published)")


def check_emit_cached_block_events(pool: BlockPoolCore, request: Request, block_hashes: Sequence[bytes],
                                   num_cached_blocks: int, block_size: int, kv_cache_group_id: int) -> None:
    """Checked only when the call emits (events on, a non-empty hit), as the core only reads them then."""
    if not pool.enable_kv_cache_events or num_cached_blocks == 0:
        return
    if not isinstance(request, Request):
        raise InvalidFieldError("request", request, "a kvref.impl.request.Request")
    check_int("num_cached_blocks", num_cached_blocks, minimum=0)
    _check_block_size(pool, block_size)
    check_group_id("kv_cache_group_id", kv_cache_group_id)
    need = num_cached_blocks * block_size // pool.hash_block_size
    if (not isinstance(block_hashes, (list, tuple)) or len(block_hashes) < need
            or not all(isinstance(h, bytes) for h in block_hashes[:need])):
        raise InvalidFieldError("block_hashes", block_hashes, f"at least {need} block hashes (bytes) "
                                                              "covering the hit")


def check_cache_partial_block(pool: BlockPoolCore, block_hashes: Sequence[bytes], block: KVCacheBlock,
                              num_tokens: int, kv_cache_group_id: int, block_size: int,
                              request: Request | None) -> None:
    """The null block is accepted whatever the rest (the core publishes nothing for it)."""
    check_own(pool, [block], "block")
    if block.is_null:
        return
    _check_events_request(pool, request, "block is")
    hbs = pool.hash_block_size
    _check_block_size(pool, block_size)
    check_group_id("kv_cache_group_id", kv_cache_group_id)
    if not isinstance(block_hashes, (list, tuple)):
        raise InvalidFieldError("block_hashes", block_hashes, "the request's block hashes (a list of bytes)")
    check_int("num_tokens", num_tokens, minimum=hbs)
    num_hash_blocks = num_tokens // hbs
    if num_tokens % hbs or num_hash_blocks > len(block_hashes):
        raise InvalidFieldError("num_tokens", num_tokens, f"a multiple of hash_block_size={hbs} covered by "
                                                          f"the {len(block_hashes)} block hashes")
    if not isinstance(block_hashes[num_hash_blocks - 1], bytes):
        raise InvalidFieldError(f"block_hashes[{num_hash_blocks - 1}]", block_hashes[num_hash_blocks - 1], "bytes")


def check_move_block_hashes(pool: BlockPoolCore, src_block: KVCacheBlock, dst_block: KVCacheBlock) -> None:
    check_own(pool, (src_block, dst_block), "block")
    if dst_block.is_null or dst_block.block_hash is not None \
            or dst_block.block_id in pool.cached_block_hashes_by_block:
        raise InvalidFieldError("dst_block", dst_block.block_id, "a block of this pool that is not null "
                                                                 "and not cached")


def check_block_ids(pool: BlockPoolCore, block_ids: object) -> list[int]:
    ids = as_list("block_ids", block_ids, "block ids (ints)")
    for bid in ids:
        if type(bid) is not int or not 0 <= bid < pool.num_gpu_blocks:
            raise InvalidFieldError("block_ids", bid, f"block ids in [0, {pool.num_gpu_blocks})")
    return ids
