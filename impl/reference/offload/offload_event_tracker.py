"""The OffloadingConnector's KV cache events with self-describing payloads (vLLM 0.33.0
``offloading/events.py``, ``OffloadingEventsTracker``).

Routers that keep a copy of where each prefix is cached need more than the CPU tier's placeholder
``BlockStored`` (one offload hash, no tokens, :mod:`.offload_events`): with
``enable_kv_cache_events`` and the connector's ``self_describing_kv_events`` both on, the scheduler
snapshots a payload per offload key while it still holds the request, and the events carry it:

* :meth:`record_store` (a chunk the manager accepted for a store) and :meth:`record_lookup` (a
  full-attention chunk a lookup saw as HIT or HIT_PENDING, even if the request is never
  allocated) keep, per key, the chunk's per-block hashes, the hash before it (``parent``), the
  chunk's tokens, the GPU block size, the group and its static spec classification. Windowed
  groups (sliding window, chunked local) are never snapshotted: their events stay placeholders.
* A stored event for a key with a snapshot carries it; for a key without one, a placeholder — with
  the group's spec kind and window when self-describing is on, without them when off.
* A removed event fans out to the snapshot's block hashes (the placeholder's single offload hash
  without one) and drops the key's primary residency; a failed store's cleanup (``metadata_only``)
  only drops the residency. Snapshots left with no residency are forgotten at the end of the
  batch, so a key evicted and re-offered in one step loses its snapshot and its next stored event
  is a placeholder (what vLLM 0.33.0 does: the re-offer merges the old residency into the new
  snapshot, and the removal then empties it).
* A cache reset forgets every snapshot.

The CPU tier is the primary tier (medium CPU, no ownership) and its stores do not announce an
expected removal, so the only residency a snapshot has is the primary one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from kvref.impl.reference.kv_events import (
    MEDIUM_CPU,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    kv_cache_spec_kind,
    kv_cache_spec_sliding_window,
    to_external_block_hash,
)
from kvref.spec.errors import InvalidFieldError, check_int, check_sequence
from kvref.spec.kv_cache_interface import KVCacheSpec

from .cpu_offloading_manager import OffloadingEvent
from .keys import OffloadKey, get_offload_block_hash, get_offload_group_idx

PRIMARY = "CPU"  # the primary tier's residency (medium CPU, no ownership)


@dataclass(frozen=True)
class EventGroupSpec:
    """A group's static classification on self-describing events (vLLM ``OffloadingEventGroupSpec``)."""

    kind: str | None
    sliding_window: int | None


def event_group_specs(specs: Sequence[KVCacheSpec]) -> dict[int, EventGroupSpec]:
    """Each group's classification (vLLM ``get_offloading_event_group_spec``), by group index."""
    check_sequence("specs", specs, "a sequence of KV cache specs")
    for i, s in enumerate(specs):
        if not isinstance(s, KVCacheSpec):
            raise InvalidFieldError(f"specs[{i}]", s, "a KV cache spec")
    return {i: EventGroupSpec(kv_cache_spec_kind(s), kv_cache_spec_sliding_window(s)) for i, s in enumerate(specs)}


@dataclass
class ChunkEventMetadata:
    """The payload snapshot of one offloaded chunk (vLLM ``_OffloadEventMetadata``)."""

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    group_idx: int
    spec: EventGroupSpec
    residencies: set[str] = field(default_factory=lambda: {PRIMARY})


def _check_key_meta(key: object, meta: object) -> None:
    if not isinstance(key, bytes) or len(key) < 4:
        raise InvalidFieldError("key", key, "an offload key (bytes: block hash + 4-byte group index)")
    if meta is not None and not isinstance(meta, ChunkEventMetadata):
        raise InvalidFieldError("meta", meta, "a ChunkEventMetadata (OffloadingEventsTracker.snapshot) or None")
    if meta is not None and (meta.group_idx != get_offload_group_idx(key) or not meta.block_hashes
                             or meta.block_hashes[-1] != get_offload_block_hash(key)):
        raise InvalidFieldError("meta", meta, "the snapshot of the key's chunk (its group, ending at the key's hash)")


class OffloadingEventsTracker:
    """Args:
        enable_kv_cache_events: vLLM's global KV event switch.
        self_describing: the connector's ``self_describing_kv_events`` opt-in (inert without the
            global switch).
        group_specs: group index -> its :class:`EventGroupSpec`.
        use_int: hashes as 64-bit ints on the events (vLLM's default) or bytes.
    """

    def __init__(self, enable_kv_cache_events: bool, self_describing: bool,
                 group_specs: dict[int, EventGroupSpec], use_int: bool = True) -> None:
        for name, v in (("enable_kv_cache_events", enable_kv_cache_events), ("self_describing", self_describing),
                        ("use_int", use_int)):
            if not isinstance(v, bool):
                raise InvalidFieldError(name, v, "a bool")
        if not isinstance(group_specs, dict) or not all(
                type(k) is int and isinstance(v, EventGroupSpec) for k, v in group_specs.items()):
            raise InvalidFieldError("group_specs", group_specs, "a dict group index -> EventGroupSpec")
        self.enabled = enable_kv_cache_events and self_describing
        self.group_specs = dict(group_specs)
        self.use_int = use_int
        self.pending: dict[OffloadKey, ChunkEventMetadata] = {}

    # ------------------------------------------------------------------ recording

    def snapshot(self, block_hashes: Sequence[bytes], token_ids: Sequence[int], group_idx: int, windowed: bool,
                 tokens_per_block: int, blocks_per_chunk: int, chunk_idx: int,
                 tokens_per_hash: int | None = None) -> ChunkEventMetadata | None:
        """The payload of chunk ``chunk_idx`` of a request (its hashes and tokens), or None when no
        snapshot is kept (self-describing off, or a windowed group). ``block_hashes`` are the
        request's hashes every ``tokens_per_hash`` tokens (None: every block); a block's hash on the
        event is the one ending it (vLLM ``resolve_block_hashes``), the parent the fine hash before
        the chunk."""
        check_sequence("block_hashes", block_hashes, "the request's block hashes (a list of bytes)")
        check_sequence("token_ids", token_ids, "the request's token ids (a list of ints)")
        check_int("group_idx", group_idx, minimum=0)
        if not isinstance(windowed, bool):
            raise InvalidFieldError("windowed", windowed, "a bool (the group is sliding-window or chunked-local)")
        check_int("tokens_per_block", tokens_per_block, minimum=1)
        check_int("blocks_per_chunk", blocks_per_chunk, minimum=1)
        check_int("chunk_idx", chunk_idx, minimum=0)
        check_int("tokens_per_hash", tokens_per_hash, minimum=1, allow_none=True)
        tph = tokens_per_block if tokens_per_hash is None else tokens_per_hash
        if tokens_per_block % tph:
            raise InvalidFieldError("tokens_per_hash", tokens_per_hash, f"a divisor of tokens_per_block={tokens_per_block}")
        if not self.enabled or windowed:
            return None
        scale = tokens_per_block // tph
        first, last = chunk_idx * blocks_per_chunk * scale, (chunk_idx + 1) * blocks_per_chunk * scale
        if last > len(block_hashes):
            raise InvalidFieldError("chunk_idx", chunk_idx, f"a chunk with all {blocks_per_chunk * scale} hashes "
                                                            f"({len(block_hashes)} known)")
        start, end = first * tph, last * tph
        return ChunkEventMetadata(tuple(block_hashes[first + scale - 1:last:scale]),
                                  block_hashes[first - 1] if first else None,
                                  tuple(token_ids[start:end]), tokens_per_block, group_idx,
                                  self.group_specs.get(group_idx, EventGroupSpec(None, None)))

    def snapshot_partial_tail(self, block_hashes: Sequence[bytes], token_ids: Sequence[int], group_idx: int,
                              windowed: bool, tokens_per_chunk: int, tokens_per_hash: int,
                              boundary_tokens: int) -> ChunkEventMetadata | None:
        """The payload of a partial tail ending at ``boundary_tokens`` (vLLM
        ``OffloadingEventsTracker._record_partial_tail``): only the valid part of its physical block
        - the hashes and tokens from the block's start to the boundary, at hash granularity
        (``block_size`` = ``tokens_per_hash``); None when no snapshot is kept (self-describing off,
        or a windowed / Mamba group)."""
        check_sequence("block_hashes", block_hashes, "the request's block hashes (a list of bytes)")
        check_sequence("token_ids", token_ids, "the request's token ids (a list of ints)")
        check_int("group_idx", group_idx, minimum=0)
        if not isinstance(windowed, bool):
            raise InvalidFieldError("windowed", windowed, "a bool (the group is windowed or Mamba)")
        check_int("tokens_per_chunk", tokens_per_chunk, minimum=1)
        check_int("tokens_per_hash", tokens_per_hash, minimum=1)
        check_int("boundary_tokens", boundary_tokens, minimum=tokens_per_hash)
        if boundary_tokens % tokens_per_hash or tokens_per_chunk % tokens_per_hash:
            raise InvalidFieldError("boundary_tokens", boundary_tokens,
                                    f"a multiple of tokens_per_hash={tokens_per_hash} (itself dividing the chunk)")
        if boundary_tokens // tokens_per_hash > len(block_hashes) or boundary_tokens > len(token_ids):
            raise InvalidFieldError("boundary_tokens", boundary_tokens, "within the request's hashed tokens")
        if not self.enabled or windowed:
            return None
        # the boundary token itself must not select the next block when it ends one exactly
        chunk_start = (boundary_tokens - 1) // tokens_per_chunk * tokens_per_chunk
        first, last = chunk_start // tokens_per_hash, boundary_tokens // tokens_per_hash
        return ChunkEventMetadata(tuple(block_hashes[first:last]), block_hashes[first - 1] if first else None,
                                  tuple(token_ids[chunk_start:boundary_tokens]), tokens_per_hash, group_idx,
                                  self.group_specs.get(group_idx, EventGroupSpec(None, None)))

    def record_store(self, key: OffloadKey, meta: ChunkEventMetadata | None) -> None:
        """A chunk accepted for a store: its snapshot replaces any older one, keeping its residencies."""
        _check_key_meta(key, meta)
        if meta is None:
            return
        old = self.pending.get(key)
        if old is not None:
            meta.residencies |= old.residencies
        self.pending[key] = meta

    def record_lookup(self, key: OffloadKey, meta: ChunkEventMetadata | None) -> None:
        """A chunk a lookup saw in the primary tier: snapshot it unless one exists; it is resident."""
        _check_key_meta(key, meta)
        if meta is None:
            return
        self.pending.setdefault(key, meta).residencies.add(PRIMARY)

    def record_partial_lookup(self, key: OffloadKey, meta: ChunkEventMetadata | None) -> None:
        """A partial tail a lookup hit: snapshot it unless one exists (an existing snapshot keeps its
        residencies as they are, unlike :meth:`record_lookup`; vLLM ``record_partial_lookup``)."""
        _check_key_meta(key, meta)
        if meta is not None:
            self.pending.setdefault(key, meta)

    def reset(self) -> None:
        self.pending.clear()

    # ------------------------------------------------------------------ events

    def _hash(self, h: bytes):
        return to_external_block_hash(h, self.use_int)

    def take_events(self, events: list[OffloadingEvent]) -> list[KVCacheEvent]:
        """The KV cache events for the manager's ``events`` (:meth:`CPUOffloadingManager.take_events`)."""
        if not isinstance(events, (list, tuple)) or not all(isinstance(e, OffloadingEvent) for e in events):
            raise InvalidFieldError("events", events, "a list of OffloadingEvent (CPUOffloadingManager.take_events)")
        out: list[KVCacheEvent] = []
        removed: set[OffloadKey] = set()
        for event in events:
            if not event.removed:
                out.extend(self._stored(k) for k in event.keys)
                continue
            if self.enabled:
                removed.update(event.keys)
            by_group: dict[int, list] = {}
            for k in event.keys:
                meta = self.pending.get(k)
                if meta is not None:
                    meta.residencies.discard(PRIMARY)
                if event.metadata_only:
                    continue
                if meta is not None:
                    by_group.setdefault(meta.group_idx, []).extend(self._hash(h) for h in meta.block_hashes)
                else:
                    by_group.setdefault(get_offload_group_idx(k), []).append(self._hash(get_offload_block_hash(k)))
            out.extend(BlockRemoved(block_hashes=h, medium=MEDIUM_CPU, group_idx=g) for g, h in by_group.items())
        for k in removed:
            meta = self.pending.get(k)
            if meta is not None and not meta.residencies:
                del self.pending[k]
        return out

    def _stored(self, key: OffloadKey) -> BlockStored:
        meta = self.pending.get(key)
        if meta is None:
            g = get_offload_group_idx(key)
            spec = self.group_specs.get(g, EventGroupSpec(None, None)) if self.enabled else EventGroupSpec(None, None)
            return BlockStored(block_hashes=[self._hash(get_offload_block_hash(key))], parent_block_hash=None,
                               token_ids=[], block_size=0, lora_id=None, medium=MEDIUM_CPU, lora_name=None,
                               group_idx=g, kv_cache_spec_kind=spec.kind,
                               kv_cache_spec_sliding_window=spec.sliding_window)
        return BlockStored(block_hashes=[self._hash(h) for h in meta.block_hashes],
                           parent_block_hash=None if meta.parent_block_hash is None else self._hash(
                               meta.parent_block_hash),
                           token_ids=list(meta.token_ids), block_size=meta.block_size, lora_id=None,
                           medium=MEDIUM_CPU, lora_name=None, extra_keys=None, group_idx=meta.group_idx,
                           kv_cache_spec_kind=meta.spec.kind, kv_cache_spec_sliding_window=meta.spec.sliding_window)

    def check_invariants(self) -> None:
        """Snapshots exist only when self-describing is on, each of a whole chunk of its own group."""
        assert self.enabled or not self.pending, "O8: a snapshot kept with self-describing events off"
        for k, meta in self.pending.items():
            assert meta.group_idx == get_offload_group_idx(k), f"O8: snapshot of {k!r} names group {meta.group_idx}"
            assert meta.block_hashes and meta.block_hashes[-1] == get_offload_block_hash(k), \
                f"O8: snapshot of {k!r} does not end at the key's hash"
            assert len(meta.token_ids) == len(meta.block_hashes) * meta.block_size, f"O8: snapshot of {k!r} tokens"
