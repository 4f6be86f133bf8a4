"""vLLM's KV cache events as plain data: conversion of vLLM's event objects and the wire decoder.

vLLM 0.33.0 publishes events with ``--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": ""}'``
(``vllm/distributed/kv_events.py``):

* every scheduler step that produced events (``Scheduler.update_from_output`` ->
  ``KVCacheManager.take_events`` + the connector's events) becomes one ``KVEventBatch(ts, events,
  data_parallel_rank)``;
* ``ZmqEventPublisher`` sends it on a PUB socket as three frames: the topic (UTF-8), an 8-byte
  big-endian sequence number (``itertools.count()`` per publisher: 0, 1, 2, ... one per batch)
  and the msgpack payload (``msgspec.msgpack.Encoder().encode(batch)``: the batch is an array
  ``[ts, events, dp_rank]`` (``array_like``, ``omit_defaults``), each event a map tagged with its
  class name under ``"type"``, fields with default values left out);
* it keeps the last ``buffer_steps`` (seq, payload) pairs; a ROUTER socket on the replay endpoint
  answers a request frame holding an 8-byte start sequence with every kept batch from there as
  ``(b"", topic, seq, payload)`` and ends with ``(b"", b"", -1 as 8 signed bytes, b"")``.

Decoding comes in two kinds. ``"generic"`` uses msgspec alone and checks each event against
the field table of vLLM 0.33.0's classes (``kvref.impl.reference.kv_events.EVENT_FIELDS``):
no vLLM import, so ``kvref watch`` starts in a fraction of a second. ``"vllm"`` decodes with vLLM's
own ``KVEventBatch`` struct (typed: a wrong field type is rejected by msgspec) and needs vLLM.
``"auto"`` is ``"vllm"`` when vLLM's event module can be imported, else ``"generic"``.
Both produce the same plain dicts as :func:`kvref.impl.reference.kv_events.event_to_plain`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvref.impl.reference.kv_events import EVENT_FIELDS
from kvref.spec.errors import InvalidFieldError, KVRefError

#: the end-of-replay marker's sequence frame (``ZmqEventPublisher.END_SEQ``)
END_SEQ = (-1).to_bytes(8, "big", signed=True)

#: defaults of the optional fields (the wire omits them: ``omit_defaults=True``)
_REQUIRED = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "lora_name"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}

DECODERS = ("generic", "vllm", "auto")


class EventDecodeError(KVRefError):
    """A payload is not a KVEventBatch of vLLM 0.33.0's shape; the message says what is wrong."""


@dataclass(frozen=True)
class DecodedBatch:
    """One ``KVEventBatch``: wall-clock ``ts`` of the step, plain events, the DP rank (or None)."""

    ts: float
    events: list[dict[str, Any]]
    data_parallel_rank: int | None


def _plain(name: str, value: Any) -> Any:
    """Lists stay lists, hash bytes stay bytes; extra keys become tuples (msgpack turns vLLM's
    tuples into arrays, so a decoded event and a live one compare equal)."""
    if name == "extra_keys" and value is not None:
        return [None if k is None else tuple(k) for k in value]
    if name == "lookahead_token_ids" and value is not None:
        return [list(v) for v in value]
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, (list, tuple)) and name in ("block_hashes", "token_ids"):
        return [bytes(v) if isinstance(v, (bytearray, memoryview)) else v for v in value]
    return value


def vllm_event_to_plain(event: Any) -> dict[str, Any]:
    """A vLLM ``KVCacheEvent`` (msgspec struct) as ``{"type": name, field: value, ...}``.

    Every field vLLM's class declares is included, also ones vLLM 0.33.0 did not have (a newer
    vLLM's extra field then shows up as a difference, which is what conformance should report).
    """
    name = type(event).__name__
    fields = getattr(type(event), "__struct_fields__", None)
    if fields is None:
        raise InvalidFieldError("event", event, "a vLLM KVCacheEvent (msgspec Struct)")
    out: dict[str, Any] = {"type": name}
    for f in fields:
        out[f] = _plain(f, getattr(event, f))
    return out


def _generic_event(obj: Any, where: str) -> dict[str, Any]:
    if not isinstance(obj, dict) or obj.get("type") not in EVENT_FIELDS:
        raise EventDecodeError(f"{where}: not a KV cache event (a map tagged BlockStored, BlockRemoved or "
                               f"AllBlocksCleared): {obj!r:.200}")
    name = obj["type"]
    known = EVENT_FIELDS[name]
    unknown = sorted(set(obj) - set(known) - {"type"})
    if unknown:
        raise EventDecodeError(f"{where}: {name} has fields vLLM 0.33.0's {name} does not: {unknown}")
    missing = [f for f in _REQUIRED[name] if f not in obj]
    if missing:
        raise EventDecodeError(f"{where}: {name} lacks required fields {missing}")
    out: dict[str, Any] = {"type": name}
    for f in known:
        out[f] = _plain(f, obj.get(f))
    hashes = out.get("block_hashes")
    if hashes is not None and (not isinstance(hashes, list)
                               or not all(isinstance(h, (bytes, int)) and not isinstance(h, bool) for h in hashes)):
        raise EventDecodeError(f"{where}: {name}.block_hashes must be a list of bytes or ints, got {hashes!r:.200}")
    if name == "BlockStored" and (not isinstance(out["token_ids"], list) or not isinstance(out["block_size"], int)):
        raise EventDecodeError(f"{where}: BlockStored.token_ids must be a list and block_size an int")
    return out


def _decode_generic(payload: bytes) -> DecodedBatch:
    import msgspec

    try:
        obj = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise EventDecodeError(f"payload is not msgpack: {exc}") from None
    if not isinstance(obj, list) or not 2 <= len(obj) <= 3:
        raise EventDecodeError(f"payload is not a KVEventBatch array [ts, events, dp_rank]: {obj!r:.200}")
    ts, events = obj[0], obj[1]
    rank = obj[2] if len(obj) == 3 else None
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise EventDecodeError(f"batch ts must be a number, got {ts!r:.100}")
    if not isinstance(events, list):
        raise EventDecodeError(f"batch events must be a list, got {events!r:.100}")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)):
        raise EventDecodeError(f"batch data_parallel_rank must be an int or nil, got {rank!r:.100}")
    return DecodedBatch(float(ts), [_generic_event(e, f"events[{i}]") for i, e in enumerate(events)], rank)


def _vllm_decoder() -> Callable[[bytes], DecodedBatch]:
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    dec = msgspec.msgpack.Decoder(type=KVEventBatch)

    def decode(payload: bytes) -> DecodedBatch:
        try:
            batch = dec.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise EventDecodeError(f"payload is not a vLLM KVEventBatch: {exc}") from None
        return DecodedBatch(float(batch.ts), [vllm_event_to_plain(e) for e in batch.events],
                            batch.data_parallel_rank)

    return decode


def make_decoder(kind: str = "generic") -> Callable[[bytes], DecodedBatch]:
    """A payload -> :class:`DecodedBatch` function (see the module docstring for the kinds).

    Raises:
        InvalidFieldError: unknown kind, or ``"vllm"`` without vLLM installed.
    """
    if kind not in DECODERS:
        raise InvalidFieldError("decoder", kind, "one of " + ", ".join(DECODERS))
    if kind == "generic":
        return _decode_generic
    try:
        return _vllm_decoder()
    except ImportError as exc:
        if kind == "vllm":
            raise InvalidFieldError("decoder", kind, f"'generic' (vLLM's event classes cannot be imported: {exc})") \
                from None
        return _decode_generic


def decode_batch(payload: bytes, kind: str = "generic") -> DecodedBatch:
    """Decode one published payload (builds the decoder each call; keep :func:`make_decoder`'s
    result for a stream)."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise InvalidFieldError("payload", type(payload).__name__, "bytes (a msgpack KVEventBatch)")
    return make_decoder(kind)(bytes(payload))


def parse_seq(frame: bytes) -> int:
    """The publisher's 8-byte big-endian sequence number (``END_SEQ`` gives -1)."""
    if not isinstance(frame, (bytes, bytearray, memoryview)) or len(frame) != 8:
        raise EventDecodeError(f"sequence frame must be 8 bytes, got {repr(frame)[:40]}")
    return int.from_bytes(frame, "big", signed=True)
