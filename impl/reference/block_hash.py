"""Prefix-cache block hashes, byte-identical to vLLM 0.33.0 for each of its hash functions.

Facts this module reproduces (``vllm/v1/core/kv_cache_utils.py``, ``vllm/utils/hashing.py``):

* Hash functions (``--prefix-caching-hash-algo``): ``sha256`` (the default) = SHA-256 of the
  object's pickle (highest protocol); ``sha256_cbor`` = SHA-256 of its canonical CBOR;
  ``xxhash`` / ``xxhash_cbor`` = XXH3-128 of the pickle / CBOR (the optional ``xxhash`` package).
* Hashes are *chained*: the hash of block ``i`` is ``hash_fn((parent, tuple(tokens), extra_keys))``
  where ``parent`` is the hash of block ``i - 1`` or, for the first block, ``NONE_HASH``. Only
  full ``hash_block_size`` chunks are hashed, so a hash fingerprints the whole prefix up to its end.
* ``NONE_HASH = hash_fn(seed)`` (``init_none_hash``): the seed is ``$PYTHONHASHSEED`` if set, else
  the fixed ``"vllm-none-hash"`` for the cryptographic functions (so processes agree), else 32
  random bytes as hex for xxhash (not collision resistant: a predictable seed would let an
  attacker precompute colliding blocks, vLLM #12621). vLLM reads the environment once per engine;
  kvref when a :class:`RequestBlockHasher` is created, unless a seed is given.
* Extra keys of the block ``[start, end)`` (``generate_block_hash_extra_keys``), in this order:
  LoRA ``("lora", name, path)`` on every block; ``("mm", identifier, offset - start)`` for every
  multimodal item overlapping the block (an item spanning blocks appears in each, with its offset
  relative to that block, negative once it started earlier); the cache salt
  ``("cache_salt", salt)`` on the first block only; ``("prompt_embeds", sha256(bytes of the
  block's embedding rows))`` on every block of a request with prompt embeds (past the prompt the
  rows are empty: ``sha256(b"")``). No key at all hashes ``None``.
* Hash lookahead (``num_hash_lookahead_tokens`` = L > 0, EAGLE block drop): a block's hash also
  covers the L tokens after it, which the drafter's KV at the block's last position depends on,
  so it exists only once those tokens do. The hashed tokens stay the block's; the extra keys
  become ``(E, t)`` for L = 1 and ``(E, t1, ..., tL)`` otherwise, where ``E`` are the extra keys of
  ``[start, end + L)``.
* A prefix-cache key is ``BlockHashWithGroupId = hash bytes + group id (4 bytes, big endian)``.
* A group whose block size is ``k × hash_block_size`` uses the coarse hash ``i = fine[(i+1)k - 1]``
  (the last fine hash inside the coarse block; PR-era #29143 concatenated them instead).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvref.impl.request import Request
from kvref.spec.errors import InvalidFieldError, check_int

BlockHash = bytes
BlockHashWithGroupId = bytes

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL


def sha256(obj: Any) -> bytes:
    """vLLM's default block hash function: SHA-256 over the object's pickle."""
    return hashlib.sha256(pickle.dumps(obj, protocol=_PICKLE_PROTOCOL)).digest()


def _cbor(obj: Any) -> bytes:
    try:
        import cbor2
    except ImportError as exc:  # pragma: no cover - cbor2 comes with vLLM's closure
        raise ModuleNotFoundError("the *_cbor prefix-caching hash functions need the cbor2 package") from exc
    return cbor2.dumps(obj, canonical=True)


def _xxh3_128(data: bytes) -> bytes:
    try:
        import xxhash as _xxhash
    except ImportError as exc:
        raise ModuleNotFoundError("the 'xxhash' prefix-caching hash functions need the xxhash package "
                                  "(pip install xxhash)") from exc
    return _xxhash.xxh3_128_digest(data)


def sha256_cbor(obj: Any) -> bytes:
    """SHA-256 over the object's canonical CBOR (a language-neutral serialization)."""
    return hashlib.sha256(_cbor(obj)).digest()


def xxhash(obj: Any) -> bytes:
    """XXH3-128 over the object's pickle."""
    return _xxh3_128(pickle.dumps(obj, protocol=_PICKLE_PROTOCOL))


def xxhash_cbor(obj: Any) -> bytes:
    """XXH3-128 over the object's canonical CBOR."""
    return _xxh3_128(_cbor(obj))


#: vLLM's ``get_hash_fn_by_name`` table (``--prefix-caching-hash-algo``)
HASH_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {
    "sha256": sha256, "sha256_cbor": sha256_cbor, "xxhash": xxhash, "xxhash_cbor": xxhash_cbor}
#: the functions whose NONE_HASH seed must stay secret (random per process unless PYTHONHASHSEED)
NON_CRYPTO_HASH_FUNCTIONS = frozenset({xxhash, xxhash_cbor})


def get_hash_fn_by_name(hash_fn_name: str) -> Callable[[Any], bytes]:
    """The hash function vLLM's ``prefix_caching_hash_algo`` names."""
    fn = HASH_FUNCTIONS.get(hash_fn_name) if isinstance(hash_fn_name, str) else None
    if fn is None:
        raise InvalidFieldError("prefix_caching_hash_algo", hash_fn_name, "one of " + ", ".join(HASH_FUNCTIONS))
    return fn


def resolve_none_hash_seed(hash_fn: Callable[[Any], bytes] = sha256) -> str:
    """The seed ``NONE_HASH`` derives from: ``$PYTHONHASHSEED`` if set, else the fixed default for
    cryptographic functions, else fresh random bytes (hex) for xxhash (vLLM #12621)."""
    seed = os.getenv("PYTHONHASHSEED")
    if seed is not None:
        return seed
    if hash_fn in NON_CRYPTO_HASH_FUNCTIONS:
        return os.urandom(32).hex()
    return DEFAULT_NONE_HASH_SEED


def compute_none_hash(hash_fn: Callable[[Any], bytes] = sha256, seed: str | None = None) -> BlockHash:
    """The parent hash of every first block (vLLM ``init_none_hash``); ``seed`` None resolves it."""
    if seed is not None and not isinstance(seed, str):
        raise InvalidFieldError("none_hash_seed", seed, "None or a str")
    return hash_fn(resolve_none_hash_seed(hash_fn) if seed is None else seed)


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


def _check_range(request: Request, start_token_idx: int, end_token_idx: int) -> None:
    if not isinstance(request, Request):
        raise InvalidFieldError("request", request, "a kvref.impl.request.Request")
    check_int("start_token_idx", start_token_idx, minimum=0)
    check_int("end_token_idx", end_token_idx, minimum=start_token_idx)


def has_extra_hash_inputs(request: Request) -> bool:
    """Whether anything but the cache salt enters the request's extra keys."""
    return bool(request.mm_features) or request.lora_request is not None or request.prompt_embeds is not None


def generate_block_hash_extra_keys(request: Request, start_token_idx: int,
                                   end_token_idx: int) -> tuple[Any, ...] | None:
    """The extra keys of the block ``[start_token_idx, end_token_idx)`` (LoRA, multimodal items,
    cache salt, prompt embeds, in that order; see the module docstring), or None if it has none.

    Written from the definition (every item overlapping the range), not from vLLM's walk with a
    running multimodal index, so a slip in that index shows as a divergence."""
    _check_range(request, start_token_idx, end_token_idx)
    keys: list[Any] = []
    lora = request.lora_request
    if lora is not None:
        keys.append(("lora", lora.lora_name, lora.lora_path))
    for f in request.mm_features:
        pos = f.mm_position
        if pos.offset < end_token_idx and start_token_idx < pos.offset + pos.length:
            keys.append(("mm", f.identifier, pos.offset - start_token_idx))
    if start_token_idx == 0 and request.cache_salt:
        keys.append(("cache_salt", request.cache_salt))
    if request.prompt_embeds is not None:
        rows = request.prompt_embeds[start_token_idx:end_token_idx]
        keys.append(("prompt_embeds", hashlib.sha256(b"".join(rows)).digest()))
    return tuple(keys) if keys else None


def block_hash_extra_keys(request: Request, start_token_idx: int, end_token_idx: int,
                          num_hash_lookahead_tokens: int = 0) -> tuple[Any, ...] | None:
    """The extra keys a block's *hash* takes: :func:`generate_block_hash_extra_keys`, or with
    hash lookahead L > 0 ``(E, *next L tokens)`` where ``E`` covers the block and those tokens
    (a single token is not unpacked into a 1-tuple: ``(E, t)``)."""
    _check_range(request, start_token_idx, end_token_idx)
    check_int("num_hash_lookahead_tokens", num_hash_lookahead_tokens, minimum=0)
    if not num_hash_lookahead_tokens:
        return generate_block_hash_extra_keys(request, start_token_idx, end_token_idx)
    hash_end = end_token_idx + num_hash_lookahead_tokens
    extra = generate_block_hash_extra_keys(request, start_token_idx, hash_end)
    lookahead = request.all_token_ids[end_token_idx:hash_end]
    if len(lookahead) != num_hash_lookahead_tokens:
        raise InvalidFieldError("end_token_idx", end_token_idx,
                                f"a block followed by its {num_hash_lookahead_tokens} lookahead tokens "
                                f"(the request has {request.num_tokens} tokens)")
    return (extra, *lookahead)


def block_extra_keys(request: Request, start_token_idx: int, end_token_idx: int | None = None,
                     num_hash_lookahead_tokens: int = 0) -> tuple | None:
    """Extra keys of the block starting at ``start_token_idx`` (``end_token_idx`` None: the
    cache salt alone, which needs no end). Kept for callers of the salt-only version."""
    if end_token_idx is None:
        _check_range(request, start_token_idx, start_token_idx)
        return (("cache_salt", request.cache_salt),) if start_token_idx == 0 and request.cache_salt else None
    return block_hash_extra_keys(request, start_token_idx, end_token_idx, num_hash_lookahead_tokens)


def to_event_extra_keys(extra_keys: Sequence[tuple[Any, ...] | None] | None) -> list | None:
    """vLLM's ``to_event_extra_keys``: the untagged per-block form published in ``BlockStored``
    (a multimodal key as ``(identifier, offset)``, every other key as its bare value: the LoRA
    name, the salt, the embeds digest); None for no entries."""
    if not extra_keys:
        return None
    return [None if keys is None else tuple(k[1:] if k[0] == "mm" else k[1] for k in keys)
            for keys in extra_keys] or None


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
    """The hashes of a group with ``block_size``: the fine list itself or its coarse view.

    A list that already is a view at ``block_size`` is returned unchanged, as vLLM does (wrapping
    it again would scale it twice: coarse hash ``i`` would become view hash ``(i+1)k - 1``, issue
    #23's second difference); a view at another block size is refused."""
    if block_size == hash_block_size:
        return block_hashes
    if isinstance(block_hashes, BlockHashListWithBlockSize):
        if block_hashes.scale_factor * hash_block_size != block_size:
            raise InvalidFieldError("block_hashes", f"a view at {block_hashes.scale_factor * hash_block_size} tokens",
                                    f"the fine hashes or a view at block_size={block_size}")
        return block_hashes
    return BlockHashListWithBlockSize(block_hashes, hash_block_size, block_size)


class RequestBlockHasher:
    """Computes and keeps each request's chained block hashes (vLLM's ``Request.block_hashes``).

    kvref's :class:`~kvref.impl.request.Request` is shared by all implementations and carries no
    hashes, so the reference keeps them here, keyed by request id. They are extended lazily — on
    every lookup the hasher hashes the full ``hash_block_size`` chunks that appeared since the last
    call (with hash lookahead: whose lookahead tokens appeared too) — which gives exactly vLLM's
    list as long as tokens are only appended (vLLM hashes at request creation and on every
    ``append_output_token_ids``; it never drops hashes).

    Args:
        hash_block_size: the token granularity of the hashes.
        hash_fn: one of :data:`HASH_FUNCTIONS` (vLLM's ``prefix_caching_hash_algo``).
        num_hash_lookahead_tokens: tokens after each block its hash covers (0: none).
        none_hash_seed: the NONE_HASH seed; None resolves it as vLLM does (random for xxhash
            unless ``PYTHONHASHSEED``): give vLLM's ``get_none_hash_seed()`` to agree with it.

    An entry is recomputed from scratch if a *different* Request object shows up under the same id,
    and dropped by :meth:`forget` when the request's blocks are freed (recomputing later gives the
    same bytes).
    """

    def __init__(self, hash_block_size: int, hash_fn: Callable[[Any], bytes] = sha256,
                 num_hash_lookahead_tokens: int = 0, none_hash_seed: str | None = None) -> None:
        check_int("hash_block_size", hash_block_size, minimum=1)
        if hash_fn not in HASH_FUNCTIONS.values():
            raise InvalidFieldError("hash_fn", hash_fn, "one of kvref's " + ", ".join(HASH_FUNCTIONS))
        check_int("num_hash_lookahead_tokens", num_hash_lookahead_tokens, minimum=0)
        self.hash_block_size = hash_block_size
        self.hash_fn = hash_fn
        self.num_hash_lookahead_tokens = num_hash_lookahead_tokens
        self.none_hash_seed = resolve_none_hash_seed(hash_fn) if none_hash_seed is None else none_hash_seed
        self.none_hash = compute_none_hash(hash_fn, self.none_hash_seed)
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
        num_tokens = len(request.prompt_token_ids) + len(request.output_token_ids) - self.num_hash_lookahead_tokens
        start = len(hashes) * bs
        if start + bs <= num_tokens:
            self._extend(request, hashes, start, num_tokens)
        return hashes

    def _extend(self, request: Request, hashes: list[BlockHash], start: int, num_tokens: int) -> None:
        bs = self.hash_block_size
        tokens = request.prompt_token_ids
        if num_tokens + self.num_hash_lookahead_tokens > len(tokens):
            tokens = tokens + request.output_token_ids
        parent = hashes[-1] if hashes else self.none_hash
        salt = request.cache_salt
        if self.num_hash_lookahead_tokens or has_extra_hash_inputs(request):
            hash_fn, lookahead = self.hash_fn, self.num_hash_lookahead_tokens
            while start + bs <= num_tokens:
                extra = block_hash_extra_keys(request, start, start + bs, lookahead)
                parent = hash_fn((parent, tuple(tokens[start:start + bs]), extra))
                hashes.append(parent)
                start += bs
            return
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
            assert request.request_id == rid, f"M13: hashes of {rid} filed under request {request.request_id}"
            assert len(hashes) * self.hash_block_size + self.num_hash_lookahead_tokens <= request.num_tokens \
                or not hashes, \
                f"M13: request {rid}: hashes cover more tokens than it has"
