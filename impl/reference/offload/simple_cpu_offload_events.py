"""KV cache events of vLLM's SimpleCPU offload scheduler (``simple_kv_offload/manager.py``).

With ``--kv-events-config`` on, vLLM's SimpleCPU connector tells routers what its CPU prefix cache
holds, so a router can send a request where its prefix is offloaded:

* a ``BlockStored`` per key a completed store publishes (the GPU block's primary key, then its
  secondary keys), emitted when the store *completes* on every worker, not when it is scheduled:
  a key is findable on the CPU only from then on. The payload (token ids, parent hash, LoRA, extra
  keys) is captured when the block is *selected*, since the request may be gone at completion
  (vLLM's ``BlockStoreMeta``). Lazy stores walk the GPU free queue, where no request is at hand:
  their events carry no payload (empty token ids, no parent). A payload whose token count is not
  the event's block size is dropped too (vLLM's #49962 fallback);
* the CPU block pool's own ``BlockRemoved`` (a cached CPU block evicted to make room) and
  ``AllBlocksCleared`` (a successful reset), re-labelled ``medium="CPU"``, ``locality="LOCAL"``
  when taken.

Every event is compared with vLLM's (``conform-offload``); an abandoned store (after ``reset()``)
publishes nothing, so it emits nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvref.impl.request import Request
from kvref.spec import kv_cache_interface as kci

from ..block_hash import (
    BlockHash,
    BlockHashWithGroupId,
    generate_block_hash_extra_keys,
    get_block_hash,
    get_group_id,
    to_event_extra_keys,
)
from ..block_pool import BlockPool
from ..kv_events import BlockRemoved, BlockStored, KVCacheEvent, kv_cache_spec_kind, kv_cache_spec_sliding_window

MEDIUM_CPU = "CPU"
LOCALITY = "LOCAL"


@dataclass(frozen=True)
class _BlockStoreMeta:
    """What a ``BlockStored`` says about a block beyond its key, captured at selection."""

    key: BlockHashWithGroupId
    token_ids: tuple[int, ...]
    parent_block_hash: int | bytes | None
    lora_id: int | None
    lora_name: str | None
    extra_keys: tuple[Any, ...] | None


def _capture_store_meta(request: Request, key: BlockHashWithGroupId, slot: int, block_size: int,
                       hashes: list[BlockHash], cpu_pool: BlockPool) -> _BlockStoreMeta:
    """The payload of the block at ``slot`` of a ``block_size`` group (its tokens, the hash of
    the slot before it as the parent), as vLLM's ``_select_eager_blocks_to_store`` captures it."""
    start, end = slot * block_size, (slot + 1) * block_size
    lora = getattr(request, "lora_request", None)
    parent = None if slot == 0 else cpu_pool._external_hash(hashes[slot - 1])
    return _BlockStoreMeta(key, tuple(request.all_token_ids[start:end]), parent,
                          lora.lora_int_id if lora else None, lora.lora_name if lora else None,
                          generate_block_hash_extra_keys(request, start, end))


def _block_stored_events(primary: BlockHashWithGroupId, secondary: list[BlockHashWithGroupId],
                        meta: _BlockStoreMeta | None, specs: list[kci.KVCacheSpec],
                        group_block_sizes: list[int], cpu_pool: BlockPool) -> list[BlockStored]:
    """The events of one completed GPU->CPU block copy: the primary key with the payload captured
    for it (if the GPU block still carries the key it had at selection), then each secondary key
    without payload (block size 0: no capture covers it in the configurations kvref models)."""
    out = []
    entries = [(primary, meta if meta is not None and meta.key == primary else None,
                group_block_sizes[get_group_id(primary)])]
    entries += [(k, None, 0) for k in secondary]
    for key, m, size in entries:
        g = get_group_id(key)
        spec = specs[g]
        if m is not None and len(m.token_ids) != size:
            m = None
        out.append(BlockStored(
            block_hashes=[cpu_pool._external_hash(get_block_hash(key))],
            parent_block_hash=m.parent_block_hash if m else None,
            token_ids=list(m.token_ids) if m else [], block_size=size,
            lora_id=m.lora_id if m else None, medium=MEDIUM_CPU, lora_name=m.lora_name if m else None,
            extra_keys=to_event_extra_keys(m.extra_keys and [m.extra_keys]) if m else None,
            group_idx=g, kv_cache_spec_kind=kv_cache_spec_kind(spec),
            kv_cache_spec_sliding_window=kv_cache_spec_sliding_window(spec), locality=LOCALITY))
    return out


def _relabel_pool_events(events: list[KVCacheEvent]) -> list[KVCacheEvent]:
    """The CPU pool's own events as the connector publishes them: removals on the CPU medium."""
    for e in events:
        if isinstance(e, BlockRemoved):
            e.medium = MEDIUM_CPU
            e.locality = LOCALITY
    return events
