"""The KV cache events the OffloadingConnector publishes for its CPU tier (vLLM 0.33.0
``offloading/events.py``, ``OffloadingEventsTracker.take_events``, with
``enable_kv_cache_events`` on and self-describing events off, vLLM's default).

Routers keep a copy of where each block is cached; the CPU tier reports its chunks under
``medium="CPU"``. From the manager's events (:meth:`CPUOffloadingManager.take_events`), in order:

* a store: one ``BlockStored`` per key, in key order — the chunk's offload hash as the only block
  hash, no parent, no tokens, ``block_size`` 0, the key's group (the "placeholder" payload: without
  self-describing events the tracker records no token metadata);
* an eviction: one ``BlockRemoved`` per group, groups in the order their first key appears, the
  group's hashes in key order;
* the cleanup of a failed store (``metadata_only``): nothing — its keys were never announced.
"""

from __future__ import annotations

from kvref.impl.reference.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent, to_external_block_hash
from kvref.impl.reference.offload.cpu_offloading_manager import OffloadingEvent
from kvref.impl.reference.offload.keys import get_offload_block_hash, get_offload_group_idx
from kvref.spec.errors import InvalidFieldError


def offloading_kv_events(events: list[OffloadingEvent], use_int: bool = True) -> list[KVCacheEvent]:
    """The connector's KV cache events for the manager's ``events`` (hashes external: low 64 bits
    as an int when ``use_int``, vLLM's default)."""
    if not isinstance(events, (list, tuple)):
        raise InvalidFieldError("events", events, "a list of OffloadingEvent (CPUOffloadingManager.take_events)")
    if not isinstance(use_int, bool):
        raise InvalidFieldError("use_int", use_int, "a bool")
    out: list[KVCacheEvent] = []
    for event in events:
        if not isinstance(event, OffloadingEvent):
            raise InvalidFieldError("events", event, "OffloadingEvent items (CPUOffloadingManager.take_events)")
        if not event.removed:
            out.extend(BlockStored(block_hashes=[to_external_block_hash(get_offload_block_hash(k), use_int)],
                                   parent_block_hash=None, token_ids=[], block_size=0, lora_id=None,
                                   medium=MEDIUM_CPU, lora_name=None, group_idx=get_offload_group_idx(k))
                       for k in event.keys)
        elif not event.metadata_only:
            by_group: dict[int, list] = {}
            for k in event.keys:
                by_group.setdefault(get_offload_group_idx(k), []).append(
                    to_external_block_hash(get_offload_block_hash(k), use_int))
            out.extend(BlockRemoved(block_hashes=h, medium=MEDIUM_CPU, group_idx=g) for g, h in by_group.items())
    return out
