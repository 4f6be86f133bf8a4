"""KV cache events of vLLM's SimpleCPU offload scheduler (``simple_kv_offload/manager.py``).

With ``--kv-events-config`` on, vLLM's SimpleCPU connector tells routers what its CPU prefix cache
holds, so a router can send a request where its prefix is offloaded:

* a ``BlockStored`` per key a completed store publishes (the GPU block's primary key, then its
  secondary keys), emitted when the store *completes* on every worker, not when it is scheduled:
  a key is findable on the CPU only from then on. The payload (token ids, parent hash, LoRA, extra
  keys) is captured when the block is *selected*, since the request may be gone at completion
  (vLLM's ``BlockStoreMeta``). Lazy stores walk the GPU free queue, where no request is at hand:
  their events carry no payload (empty token ids, no parent). A payload whose token count is not
  the event's block size is dropped too (vLLM's #49962 fallback). With fine-grained hashes (a
  block wider than ``hash_block_size``, the Mamba "align" pools) a selected block also captures a
  payload per hash unit inside it (its ``hash_block_size`` tokens, the previous unit's hash as the
  parent): the GPU block's secondary keys are published with it and ``block_size=hash_block_size``;
  a secondary key nothing captured (a boundary-state hand-off, a finish-time partial tail, whose
  keys are only known at completion) goes out with no payload and ``block_size=0``;
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
    make_block_hash_with_group_id,
    to_event_extra_keys,
)
from ..block_pool import BlockPool
from ..kv_events import BlockRemoved, BlockStored, KVCacheEvent, kv_cache_spec_kind, kv_cache_spec_sliding_window

MEDIUM_CPU = "CPU"
LOCALITY = "LOCAL"


@dataclass(frozen=True)
class _BlockStoreMeta:
    """What a ``BlockStored`` says about a key beyond the key itself, captured at selection.

    ``block_size`` is None for the block's primary key (the event takes its group's block size)
    and ``hash_block_size`` for a hash unit inside a wider block (vLLM's ``BlockStoreMeta``)."""

    key: BlockHashWithGroupId
    token_ids: tuple[int, ...]
    parent_block_hash: int | bytes | None
    lora_id: int | None
    lora_name: str | None
    extra_keys: tuple[Any, ...] | None
    block_size: int | None = None


def _capture_store_meta(request: Request, key: BlockHashWithGroupId, slot: int, block_size: int,
                       hashes: list[BlockHash], cpu_pool: BlockPool, fine_hashes: list[BlockHash] | None = None,
                       hash_block_size: int | None = None) -> tuple[_BlockStoreMeta, ...]:
    """The payloads of the block at ``slot`` of a ``block_size`` group, as vLLM's
    ``_select_eager_blocks_to_store`` captures them: the block's own (its tokens, the hash of the
    slot before it as the parent), then, when the block is wider than ``hash_block_size``, one per
    hash unit inside it whose key is not the primary (``fine_hashes``: the request's unit hashes)."""
    start, end = slot * block_size, (slot + 1) * block_size
    lora = getattr(request, "lora_request", None)
    lora_id, lora_name = (lora.lora_int_id, lora.lora_name) if lora else (None, None)
    parent = None if slot == 0 else cpu_pool._external_hash(hashes[slot - 1])
    out = [_BlockStoreMeta(key, tuple(request.all_token_ids[start:end]), parent, lora_id, lora_name,
                           generate_block_hash_extra_keys(request, start, end))]
    if fine_hashes is None or hash_block_size is None or hash_block_size == block_size:
        return tuple(out)
    group = get_group_id(key)
    for unit in range(start // hash_block_size, end // hash_block_size):
        unit_key = make_block_hash_with_group_id(fine_hashes[unit], group)
        if unit_key == key:
            continue
        u0, u1 = unit * hash_block_size, (unit + 1) * hash_block_size
        out.append(_BlockStoreMeta(unit_key, tuple(request.all_token_ids[u0:u1]),
                                   None if unit == 0 else cpu_pool._external_hash(fine_hashes[unit - 1]),
                                   lora_id, lora_name, generate_block_hash_extra_keys(request, u0, u1),
                                   hash_block_size))
    return tuple(out)


def _block_stored_events(primary: BlockHashWithGroupId, secondary: list[BlockHashWithGroupId],
                        metas: tuple[_BlockStoreMeta, ...] | None, specs: list[kci.KVCacheSpec],
                        group_block_sizes: list[int], cpu_pool: BlockPool) -> list[BlockStored]:
    """The events of one completed GPU->CPU block copy: the primary key (its group's block size),
    then each secondary key the GPU block carries now (``block_size`` of the payload captured for
    it, 0 when none was); each with the payload captured under that key at selection, if any."""
    by_key = {m.key: m for m in metas or ()}
    out = []
    entries = [(primary, by_key.get(primary), group_block_sizes[get_group_id(primary)])]
    for k in secondary:
        m = by_key.get(k)
        entries.append((k, m, m.block_size if m is not None and m.block_size is not None else 0))
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
