"""KV cache events: what a block pool tells the outside world about its prefix-cache index.

vLLM 0.33.0 publishes three events (``vllm/distributed/kv_events.py``) so that routers can keep a
copy of every engine's prefix-cache index and send a request where its prefix is cached (the
KV-aware routing of llm-d / Dynamo / the production stack):

* :class:`BlockStored` — one or more blocks became reachable under ``block_hashes`` (chained:
  ``parent_block_hash`` is the hash just before the first one). Emitted once per
  ``cache_full_blocks`` call that had anything to cache (even when every block in the range was a
  null or masked block: then ``block_hashes`` is empty), once per new partial entry
  (``cache_partial_block``), and, for requests with ``kv_cache_report_mode == "full"``, once per
  group for a prefix-cache hit (``emit_cached_block_events``, no state change).
* :class:`BlockRemoved` — one key left the index: eviction of a free cached block that is
  reused (``get_new_blocks`` -> ``_maybe_evict_cached_block``), a connector's ``evict_blocks``, a
  partial entry promoted or replaced. One event per removed key, in removal order.
* :class:`AllBlocksCleared` — ``reset_prefix_cache`` succeeded (never when it returns False).

These dataclasses have exactly vLLM's fields, names and defaults, so :func:`event_to_plain` of a
reference event and of a vLLM event (``kvref.impl.vllm.kv_events.vllm_event_to_plain``) are equal
when the two pools did the same thing. Block hashes are "external" hashes
(``maybe_convert_block_hash``): with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`` (vLLM's default)
the low 64 bits of the hash bytes as an int (big endian), else the hash bytes themselves.

``BlockStored`` carries the request's LoRA id and name, session id, the untagged extra keys of each
stored block (multimodal ``(identifier, offset)``, LoRA name, cache salt, prompt-embeds digest;
:func:`kvref.impl.reference.block_hash.to_event_extra_keys`) and, with hash lookahead, each block's
lookahead tokens (issue #23). ``locality`` / ``ownership`` are only set by offloading connectors,
whose events kvref does not model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

from kvref.spec import kv_cache_interface as kci
from kvref.spec.errors import InvalidFieldError

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"

#: vLLM's environment switch between int (default) and bytes block hashes in events
INT_HASHES_ENV = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"

ExternalBlockHash = bytes | int


def use_int_block_hashes() -> bool:
    """Read the switch the way vLLM's ``envs`` does: ``bool(int(os.getenv(NAME, "1")))``.

    Raises:
        InvalidFieldError: the variable is set to something that is not an int.
    """
    raw = os.getenv(INT_HASHES_ENV, "1")
    try:
        return bool(int(raw))
    except ValueError:
        raise InvalidFieldError(INT_HASHES_ENV, raw, "an int: 1 (hashes as 64-bit ints, vLLM's default) or 0 "
                                                     "(hash bytes)") from None


def to_external_block_hash(hash_bytes: bytes, use_int: bool) -> ExternalBlockHash:
    """vLLM's ``maybe_convert_block_hash``: the bytes, or their low 64 bits as an int."""
    if not use_int:
        return hash_bytes
    return int.from_bytes(hash_bytes, byteorder="big") & ((1 << 64) - 1)


@dataclass
class BlockStored:
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


@dataclass
class BlockRemoved:
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared

#: field names per event type, in vLLM 0.33.0's declaration order (the wire order is by name)
EVENT_FIELDS: dict[str, tuple[str, ...]] = {
    cls.__name__: tuple(f.name for f in fields(cls)) for cls in (BlockStored, BlockRemoved, AllBlocksCleared)
}


def event_to_plain(event: KVCacheEvent) -> dict[str, Any]:
    """``{"type": name, field: value, ...}`` with every field (defaults included), lists as lists
    and extra keys as tuples: the form conformance compares."""
    out: dict[str, Any] = {"type": type(event).__name__}
    for name in EVENT_FIELDS[type(event).__name__]:
        out[name] = _plain_value(name, getattr(event, name))
    return out


def _plain_value(name: str, value: Any) -> Any:
    if name == "extra_keys" and value is not None:
        return [None if k is None else tuple(k) for k in value]
    if name in ("block_hashes", "token_ids") and value is not None:
        return [bytes(v) if isinstance(v, (bytes, bytearray, memoryview)) else v for v in value]
    if name == "lookahead_token_ids" and value is not None:
        return [list(v) for v in value]
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    return value


def event_extra_keys(salt: str | None, block_start: int) -> tuple[Any, ...] | None:
    """A salt-only block's published extra keys: the cache salt is hashed into the first block
    only as ``("cache_salt", salt)`` and published untagged, as ``(salt,)``. (The pool publishes
    every extra key through ``block_hash.to_event_extra_keys``; this is the salt-only case, kept
    for its callers.)
    """
    return (salt,) if block_start == 0 and salt else None



def kv_cache_spec_kind(spec: kci.KVCacheSpec) -> str:
    """vLLM's ``get_kv_cache_spec_kind(spec).value`` for the specs kvref models (subclasses before
    their bases: MLA before full attention). A uniform-type group of one kind has that kind; one
    mixing full-attention subclasses is ``full_attention``; anything else ``unknown``."""
    if isinstance(spec, kci.UniformTypeKVCacheSpecs):
        kinds = {kv_cache_spec_kind(s) for s in spec.kv_cache_specs.values()}
        if len(kinds) == 1:
            return next(iter(kinds))
        if all(isinstance(s, kci.FullAttentionSpec) for s in spec.kv_cache_specs.values()):
            return "full_attention"
        return "unknown"
    for cls, kind in ((kci.MLAAttentionSpec, "mla_attention"), (kci.FullAttentionSpec, "full_attention"),
                      (kci.ChunkedLocalAttentionSpec, "chunked_local_attention"),
                      (kci.SlidingWindowSpec, "sliding_window"), (kci.MambaSpec, "mamba"),
                      (kci.EncoderOnlyAttentionSpec, "encoder_only_attention"),
                      (kci.CrossAttentionSpec, "cross_attention")):
        if isinstance(spec, cls):
            return kind
    return "unknown"


def kv_cache_spec_sliding_window(spec: kci.KVCacheSpec) -> int | None:
    """vLLM's ``get_kv_cache_spec_sliding_window``: the window of a sliding-window spec (a
    uniform group's only window), else None (a full-attention spec's own ``sliding_window`` is
    not reported)."""
    if isinstance(spec, kci.UniformTypeKVCacheSpecs):
        windows = {kv_cache_spec_sliding_window(s) for s in spec.kv_cache_specs.values()}
        return next(iter(windows)) if len(windows) == 1 else None
    if isinstance(spec, kci.SlidingWindowSpec):
        return spec.sliding_window
    return None
