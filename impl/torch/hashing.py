"""Prefix-cache block hashes, computed exactly as vLLM 0.33.0 computes them.

A block's hash is ``sha256(pickle.dumps((parent or NONE_HASH, tuple(tokens), extra_keys),
HIGHEST_PROTOCOL))``, chained over the whole prefix, for every *full* ``hash_block_size`` chunk of
the request's tokens (``vllm.v1.core.kv_cache_utils.hash_block_tokens`` with
``vllm.utils.hashing.sha256``). ``NONE_HASH`` is the hash of a seed string: ``PYTHONHASHSEED`` when
set, else the fixed ``"vllm-none-hash"`` (sha256 is cryptographic, so processes agree; see
``init_none_hash`` / ``resolve_none_hash_seed``). The only extra key kvref requests carry is the
cache salt, hashed into the first block only as ``(("cache_salt", salt),)``.

The torch implementation keeps hashes as ``bytes`` (a dict from hash bytes to block ids is the
natural index); nothing here touches tensors.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from typing import Any

from kvref.impl.request import Request

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


def sha256_pickle(obj: Any) -> bytes:
    """vLLM's ``sha256``: SHA-256 of the highest-protocol pickle of ``obj``."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def none_hash_seed() -> str:
    """The seed ``NONE_HASH`` is derived from (``PYTHONHASHSEED`` wins, as in vLLM)."""
    seed = os.environ.get("PYTHONHASHSEED")
    return DEFAULT_NONE_HASH_SEED if seed is None else seed


def none_hash() -> bytes:
    """The parent hash of every first block. Re-read each call: the env var may change in tests."""
    return sha256_pickle(none_hash_seed())


def hash_block_tokens(parent: bytes | None, tokens: tuple[int, ...] | list[int],
                      extra_keys: tuple | None = None) -> bytes:
    """One chained block hash. An empty/None parent means "first block" (vLLM tests ``not parent``)."""
    return sha256_pickle((parent or none_hash(), tuple(tokens), extra_keys))


class RequestHashes:
    """Incremental block hashes of requests, keyed by request id.

    A request's tokens only grow (prompt, then outputs), so hashes computed once stay valid; each
    call extends the list to cover every full ``hash_block_size`` chunk of
    ``request.all_token_ids``. Another ``Request`` object under a known id starts over.
    """

    def __init__(self, hash_block_size: int) -> None:
        self.hash_block_size = hash_block_size
        self._hashes: dict[str, list[bytes]] = {}
        self._owner: dict[str, Request] = {}

    def get(self, request: Request) -> list[bytes]:
        rid = request.request_id
        hashes = self._hashes.get(rid)
        if hashes is None or self._owner.get(rid) is not request:
            hashes = []
        bs = self.hash_block_size
        num_tokens = request.num_tokens
        start = len(hashes) * bs
        if start + bs <= num_tokens:
            tokens = request.all_token_ids
            parent = hashes[-1] if hashes else None
            while start + bs <= num_tokens:
                extra = (("cache_salt", request.cache_salt),) if start == 0 and request.cache_salt else None
                parent = hash_block_tokens(parent, tokens[start:start + bs], extra)
                hashes.append(parent)
                start += bs
        self._hashes[rid] = hashes
        self._owner[rid] = request
        return hashes

    def forget(self, request_id: str) -> None:
        self._hashes.pop(request_id, None)
        self._owner.pop(request_id, None)


def coarse_hashes(fine: list[bytes], hash_block_size: int, block_size: int) -> list[bytes]:
    """Hashes viewed at ``block_size`` (a multiple of ``hash_block_size``): coarse hash ``i`` is
    fine hash ``(i+1)k - 1``, which already chains over the whole prefix (vLLM's
    ``BlockHashListWithBlockSize``; PR-era #29143 concatenated the k fine hashes instead)."""
    if block_size == hash_block_size:
        return fine
    k = block_size // hash_block_size
    return [fine[(i + 1) * k - 1] for i in range(len(fine) // k)]
