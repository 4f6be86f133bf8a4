"""Offload keys, lookup results and the per-request context the CPU offloading manager sees.

An offloaded chunk is named by the block hash of its *last* hash unit plus its KV cache group
(vLLM's ``OffloadKey = block_hash bytes + 4-byte big-endian group idx``, ``kv_offload/base.py``).
Block hashes are chained, so the last hash of a chunk identifies the whole prefix up to it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Sequence, TypeVar

from kvref.spec.errors import InvalidFieldError, KVRefError, check_int
from kvref.spec.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from kvref.spec.mathutil import cdiv

OffloadKey = bytes

_T = TypeVar("_T")


class OffloadStateError(KVRefError):
    """An offload call names a key, job or request the current state does not allow.

    vLLM asserts (or raises KeyError) in these places; kvref raises this ``ValueError`` subclass
    before mutating anything, so the caller's state is unchanged.
    """


def make_offload_key(block_hash: bytes, group_idx: int) -> OffloadKey:
    """Block hash followed by the group index as 4 big-endian bytes (vLLM ``make_offload_key``)."""
    if not isinstance(block_hash, (bytes, bytearray)):
        raise InvalidFieldError("block_hash", block_hash, "bytes")
    check_int("group_idx", group_idx, minimum=0)
    if group_idx >= 2**32:
        raise InvalidFieldError("group_idx", group_idx, "an int < 2**32")
    return bytes(block_hash) + group_idx.to_bytes(4, "big")


def get_offload_group_idx(key: OffloadKey) -> int:
    _check_key(key)
    return int.from_bytes(key[-4:], "big")


def get_offload_block_hash(key: OffloadKey) -> bytes:
    _check_key(key)
    return key[:-4]


def chunk_offload_keys(block_hashes: Sequence[bytes], group_idx: int, hashes_per_chunk: int) -> list[OffloadKey]:
    """Keys of every complete chunk: chunk ``j`` is keyed by hash ``(j+1)*hashes_per_chunk - 1``.

    Mirrors ``RequestOffloadState.update_offload_keys`` (the last hash inside the chunk).
    """
    check_int("hashes_per_chunk", hashes_per_chunk, minimum=1)
    if not isinstance(block_hashes, (list, tuple)):
        raise InvalidFieldError("block_hashes", block_hashes, "a list of block hashes (bytes)")
    return [make_offload_key(block_hashes[i], group_idx)
            for i in range(hashes_per_chunk - 1, len(block_hashes), hashes_per_chunk)]


def get_sliding_window_size_in_chunks(spec: KVCacheSpec, tokens_per_chunk: int) -> int | None:
    """How many trailing chunks a group needs for a usable hit; None for full attention.

    Sliding window: the window may straddle one more chunk than ``cdiv(sw, tpc)`` once the
    ``sw - 1 + extra_retained_tokens`` tokens a query position actually reads are counted
    (PR-era #41228 used ``cdiv(sw, block)`` only). Chunked local: one attention chunk. Mamba: the
    single last state.
    """
    check_int("tokens_per_chunk", tokens_per_chunk, minimum=1)
    if isinstance(spec, SlidingWindowSpec):
        extra = getattr(spec, "extra_retained_tokens", 0) or 0
        return max(cdiv(spec.sliding_window, tokens_per_chunk),
                   cdiv(spec.sliding_window - 1 + extra, tokens_per_chunk))
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return cdiv(spec.attention_chunk_size, tokens_per_chunk)
    if isinstance(spec, MambaSpec):
        return 1
    if isinstance(spec, FullAttentionSpec):
        return None
    raise InvalidFieldError("kv_cache_spec", type(spec).__name__,
                            "FullAttention/MLA, SlidingWindow, ChunkedLocalAttention or Mamba spec")


class LookupResult(enum.Enum):
    """Answer of ``OffloadingManager.lookup`` for one key."""

    MISS = "miss"
    HIT = "hit"
    HIT_PENDING = "hit_pending"  # present, write not finished: not readable yet
    RETRY = "retry"  # location unknown yet (async tiers); the CPU manager never answers it


def _check_key(key: object) -> None:
    if not isinstance(key, bytes) or len(key) < 4:
        raise InvalidFieldError("key", key, "an offload key (bytes: block hash + 4-byte group index)")


@dataclass
class RequestContext:
    """Per-request facts a manager may use (vLLM ``ReqContext``).

    ``key positions`` are the end-token position of each key in this request, recorded by the
    scheduler, so policies can order a request's keys head-to-tail even when stores arrive out of
    order (sliding-window back-fills). ``state`` is scratch space keyed by type, one value per
    type, for policies and managers.
    """

    req_id: str
    _positions: dict[OffloadKey, int] = field(default_factory=dict, repr=False)
    _state: dict[type, Any] = field(default_factory=dict, repr=False)

    def set_offload_key_position(self, key: OffloadKey, end_token: int) -> None:
        _check_key(key)
        check_int("end_token", end_token, minimum=0)
        self._positions[key] = end_token

    def get_offload_key_position(self, key: OffloadKey) -> int | None:
        _check_key(key)
        return self._positions.get(key)

    def set_state(self, value: Any) -> None:
        self._state[type(value)] = value

    def get_state(self, cls: type[_T]) -> _T | None:
        if not isinstance(cls, type):
            raise InvalidFieldError("cls", cls, "a type (the state's class)")
        return self._state.get(cls)


def order_request_keys(key_groups: Sequence[Sequence[OffloadKey]], ctx: RequestContext) -> list[OffloadKey]:
    """All groups' keys in one head-to-tail order, if every key has a position; else as given."""
    if not isinstance(key_groups, (list, tuple)) or not all(isinstance(g, (list, tuple)) for g in key_groups):
        raise InvalidFieldError("key_groups", key_groups, "a list of per-group lists of offload keys")
    if not isinstance(ctx, RequestContext):
        raise InvalidFieldError("ctx", ctx, "a RequestContext")
    keys = [k for group in key_groups for k in group]
    positions = {k: p for k in keys if (p := ctx.get_offload_key_position(k)) is not None}
    if len(positions) == len(keys):
        keys.sort(key=positions.__getitem__)
    return keys
