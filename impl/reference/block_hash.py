"""Prefix-cache block hashes, byte-identical to vLLM 0.33.0 with its default ``sha256``.

Facts this module reproduces (``vllm/v1/core/kv_cache_utils.py``, ``vllm/utils/hashing.py``):

* ``sha256(obj) = hashlib.sha256(pickle.dumps(obj, protocol=HIGHEST_PROTOCOL)).digest()``.
* Hashes are *chained*: the hash of block ``i`` is ``sha256((parent, tuple(tokens), extra_keys))``
  where ``parent`` is the hash of block ``i - 1`` or, for the first block, ``NONE_HASH``. Only
  full ``hash_block_size`` chunks are hashed, so a hash fingerprints the whole prefix up to its end.
* ``NONE_HASH = sha256(seed)``: the seed is ``$PYTHONHASHSEED`` if set, else the fixed
  ``"vllm-none-hash"`` for cryptographic hash functions (so processes agree). vLLM reads the
  environment once, when the engine starts (``init_none_hash``); kvref reads it when a
  :class:`RequestBlockHasher` is created.
* Extra keys: the request's ``cache_salt`` goes into the *first* block only, as
  ``(("cache_salt", salt),)``; blocks without extra keys hash ``None``.
* A prefix-cache key is ``BlockHashWithGroupId = hash bytes + group id (4 bytes, big endian)``.
* A group whose block size is ``k × hash_block_size`` uses the coarse hash ``i = fine[(i+1)k - 1]``
  (the last fine hash inside the coarse block; PR-era #29143 concatenated them instead).

Not modelled (kvref's ``Request`` has no such inputs): multimodal extra keys ``("mm", hash,
offset)``, LoRA ``("lora", name, path)``, prompt-embeds hashes, hash lookahead tokens
(``num_hash_lookahead_tokens``), and the non-cryptographic ``xxhash`` functions (random seed).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvref.impl.request import Request

BlockHash = bytes
BlockHashWithGroupId = bytes

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL


def sha256(obj: Any) -> bytes:
    """vLLM's default block hash function: SHA-256 over the object's pickle."""
    return hashlib.sha256(pickle.dumps(obj, protocol=_PICKLE_PROTOCOL)).digest()


def resolve_none_hash_seed() -> str:
    """The seed ``NONE_HASH`` derives from: ``$PYTHONHASHSEED`` if set, else the fixed default.

    vLLM uses a random seed only for non-cryptographic hash functions (xxhash), which kvref does
    not model.
    """
    seed = os.getenv("PYTHONHASHSEED")
    return DEFAULT_NONE_HASH_SEED if seed is None else seed


def compute_none_hash(hash_fn: Callable[[Any], bytes] = sha256) -> BlockHash:
    """The parent hash of every first block (vLLM ``init_none_hash``)."""
    return hash_fn(resolve_none_hash_seed())


def hash_block_tokens(hash_fn: Callable[[Any], bytes], parent_block_hash: BlockHash,
                      block_token_ids: Sequence[int], extra_keys: tuple | None = None) -> BlockHash:
    """Hash of one full block chained to ``parent_block_hash`` (NONE_HASH for the first block)."""
    return hash_fn((parent_block_hash, tuple(block_token_ids), extra_keys))


def make_block_hash_with_group_id(block_hash: BlockHash, group_id: int) -> BlockHashWithGroupId:
    """The prefix-cache key: the hash followed by the group id as 4 big-endian bytes."""
    return block_hash + group_id.to_bytes(4, "big", signed=False)


def get_block_hash(key: BlockHashWithGroupId) -> BlockHash:
    return key[:-4]


def get_group_id(key: BlockHashWithGroupId) -> int:
    return int.from_bytes(key[-4:], "big", signed=False)


def block_extra_keys(request: Request, start_token_idx: int) -> tuple | None:
    """Extra keys of the block starting at ``start_token_idx``: only the cache salt is modelled."""
    if start_token_idx == 0 and request.cache_salt:
        return (("cache_salt", request.cache_salt),)
    return None


class BlockHashListWithBlockSize(Sequence):
    """A coarse view of fine hashes: the hash of coarse block ``i`` is ``fine[(i+1)*k - 1]``.

    Used by groups whose block size is ``k`` times ``hash_block_size``. Lazy: indexes into the
    (growing) fine list, so it stays valid as the request's hashes are extended.
    """

    __slots__ = ("block_hashes", "scale_factor")

    def __init__(self, block_hashes: Sequence[BlockHash], hash_block_size: int, target_block_size: int):
        assert target_block_size % hash_block_size == 0, (target_block_size, hash_block_size)
        self.block_hashes = block_hashes
        self.scale_factor = target_block_size // hash_block_size

    def __len__(self) -> int:
        return len(self.block_hashes) // self.scale_factor

    def __getitem__(self, idx):  # type: ignore[override]
        if isinstance(idx, slice):
            return [self[i] for i in range(*idx.indices(len(self)))]
        if idx < 0:
            idx += len(self)
        if not 0 <= idx < len(self):
            raise IndexError(idx)
        return self.block_hashes[(idx + 1) * self.scale_factor - 1]

    def __iter__(self) -> Iterator[BlockHash]:
        k = self.scale_factor
        fine = self.block_hashes
        for i in range(len(self)):
            yield fine[(i + 1) * k - 1]


def resolve_block_hashes(block_hashes: Sequence[BlockHash], hash_block_size: int,
                         block_size: int) -> Sequence[BlockHash]:
    """The hashes of a group with ``block_size``: the fine list itself or its coarse view."""
    if block_size == hash_block_size:
        return block_hashes
    return BlockHashListWithBlockSize(block_hashes, hash_block_size, block_size)


class RequestBlockHasher:
    """Computes and keeps each request's chained block hashes (vLLM's ``Request.block_hashes``).

    kvref's :class:`~kvref.impl.request.Request` is shared by all implementations and carries no
    hashes, so the reference keeps them here, keyed by request id. They are extended lazily — on
    every lookup the hasher hashes the full ``hash_block_size`` chunks that appeared since the last
    call — which gives exactly vLLM's list as long as tokens are only appended (vLLM hashes at
    request creation and on every ``append_output_token_ids``; it never drops hashes).

    An entry is recomputed from scratch if a *different* Request object shows up under the same id,
    and dropped by :meth:`forget` when the request's blocks are freed (recomputing later gives the
    same bytes).
    """

    def __init__(self, hash_block_size: int, hash_fn: Callable[[Any], bytes] = sha256) -> None:
        self.hash_block_size = hash_block_size
        self.hash_fn = hash_fn
        self.none_hash = compute_none_hash(hash_fn)
        # request_id -> (request object, its hashes)
        self._entries: dict[str, tuple[Request, list[BlockHash]]] = {}

    def block_hashes(self, request: Request) -> list[BlockHash]:
        """The request's hashes, extended to cover every full hash block of its current tokens."""
        entry = self._entries.get(request.request_id)
        if entry is None or entry[0] is not request:
            hashes: list[BlockHash] = []
            self._entries[request.request_id] = (request, hashes)
        else:
            hashes = entry[1]
        bs = self.hash_block_size
        num_tokens = len(request.prompt_token_ids) + len(request.output_token_ids)
        start = len(hashes) * bs
        if start + bs <= num_tokens:
            self._extend(request, hashes, start, num_tokens)
        return hashes

    def _extend(self, request: Request, hashes: list[BlockHash], start: int, num_tokens: int) -> None:
        bs = self.hash_block_size
        tokens = request.prompt_token_ids
        if num_tokens > len(tokens):
            tokens = tokens + request.output_token_ids
        parent = hashes[-1] if hashes else self.none_hash
        salt = request.cache_salt
        if self.hash_fn is sha256:
            # the default, inlined (this loop is the hot path of request admission)
            dumps, digest, proto = pickle.dumps, hashlib.sha256, _PICKLE_PROTOCOL
            while start + bs <= num_tokens:
                extra = (("cache_salt", salt),) if (start == 0 and salt) else None
                parent = digest(dumps((parent, tuple(tokens[start:start + bs]), extra), proto)).digest()
                hashes.append(parent)
                start += bs
            return
        hash_fn = self.hash_fn
        while start + bs <= num_tokens:
            extra = (("cache_salt", salt),) if (start == 0 and salt) else None
            parent = hash_fn((parent, tuple(tokens[start:start + bs]), extra))
            hashes.append(parent)
            start += bs

    def peek(self, request_id: str) -> list[BlockHash] | None:
        """The hashes computed so far for ``request_id`` (None if none), without extending them."""
        entry = self._entries.get(request_id)
        return None if entry is None else entry[1]

    def forget(self, request_id: str) -> None:
        self._entries.pop(request_id, None)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def check_invariants(self) -> None:
        """Each entry is the chained hash of its request's full blocks, nothing more."""
        for rid, (request, hashes) in self._entries.items():
            assert request.request_id == rid
            assert len(hashes) * self.hash_block_size <= request.num_tokens, \
                f"request {rid}: hashes cover more tokens than it has"
