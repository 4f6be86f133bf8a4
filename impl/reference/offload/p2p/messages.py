"""The P2P control protocol's messages (vLLM ``tiering/p2p/session/protocol.py``), as plain dicts.

Both sessions of a peer pair speak these over one control connection. A message is a dict whose
``"type"`` names it; the reference builds them with the functions below and both worlds are
compared on :func:`summarize` of every message sent, in order, per direction.

* ``connect`` / ``connect_ack``: the handshake. Each side announces its memory layout, block
  length, config fingerprint and hash seed; the receiver checks them and acks once it has
  registered the peer on its data plane. Until the peer's ack arrives a session queues what it
  sends (vLLM: ``P2PSession._send``).
* ``fetch`` (client → server): the blocks (keys + the client's block indexes) one load round
  wants; the empty fetch is the terminal "request finished" signal.
* ``transfer_done`` (server → client): a round finished, with its success.
* ``abort_fetch`` / ``abort_ack``: the client gives up on a round (timeout, local finish) and the
  server acknowledges once none of the round's writes can still land.
* ``lookup`` / ``lookup_resp``: symmetric P2P probes (which keys the peer holds).
* ``disconnect``: either side leaves.
"""

from __future__ import annotations

from typing import Any

TYPE_KEY = "type"
CONNECT, CONNECT_ACK, DISCONNECT = "connect", "connect_ack", "disconnect"
FETCH, TRANSFER_DONE, ABORT_FETCH, ABORT_ACK = "fetch", "transfer_done", "abort_fetch", "abort_ack"
LOOKUP, LOOKUP_RESP = "lookup", "lookup_resp"


def connect(peer_id: str, num_blocks: int, block_len: int, fingerprint: str, hash_seed: str) -> dict:
    return {TYPE_KEY: CONNECT, "peer_id": peer_id, "num_blocks": num_blocks, "block_len": block_len,
            "config_fingerprint": fingerprint, "hash_seed": hash_seed}


def connect_ack(peer_id: str) -> dict:
    return {TYPE_KEY: CONNECT_ACK, "peer_id": peer_id}


def disconnect() -> dict:
    return {TYPE_KEY: DISCONNECT}


def fetch(kv_request_id: str, keys: list[bytes], block_indexes: list[int], round_seq: int) -> dict:
    return {TYPE_KEY: FETCH, "kv_request_id": kv_request_id, "keys": list(keys),
            "block_indexes": list(block_indexes), "round_seq": round_seq}


def transfer_done(kv_request_id: str, success: bool, round_seq: int) -> dict:
    return {TYPE_KEY: TRANSFER_DONE, "kv_request_id": kv_request_id, "success": success, "round_seq": round_seq}


def abort_fetch(kv_request_id: str, round_seq: int) -> dict:
    return {TYPE_KEY: ABORT_FETCH, "kv_request_id": kv_request_id, "round_seq": round_seq}


def abort_ack(kv_request_id: str, round_seq: int) -> dict:
    return {TYPE_KEY: ABORT_ACK, "kv_request_id": kv_request_id, "round_seq": round_seq}


def lookup(kv_request_id: str, keys: list[bytes], round_seq: int) -> dict:
    return {TYPE_KEY: LOOKUP, "kv_request_id": kv_request_id, "keys": list(keys), "round_seq": round_seq}


def lookup_resp(kv_request_id: str, keys: list[bytes], hits: list[bool]) -> dict:
    return {TYPE_KEY: LOOKUP_RESP, "kv_request_id": kv_request_id, "keys": list(keys), "hits": list(hits)}


def _require(msg: dict, key: str, typ: type, what: str) -> None:
    """``isinstance`` as vLLM's ``_require*`` check it: a bool is an int there (``round_seq``
    False is round 0, True round 1), so it is accepted here too."""
    val = msg.get(key)
    if not isinstance(val, typ) or (what == "non-negative" and val < 0) or (what == "positive" and val <= 0):
        raise ValueError(f"{key}: expected {what} {typ.__name__}, got {val!r}")


def validate(msg: dict) -> None:
    """Raise ValueError where vLLM's ``*Msg.validate`` rejects a message (a protocol violation:
    the receiving session disconnects). ``connect``, ``disconnect`` and unknown types are not
    validated here (the handshake checks ``connect`` itself; an unknown type is ignored)."""
    kind = msg.get(TYPE_KEY)
    if kind == CONNECT_ACK:
        _require(msg, "peer_id", str, "a")
    elif kind == FETCH:
        _require(msg, "kv_request_id", str, "a")
        _require(msg, "round_seq", int, "non-negative")
        _require(msg, "keys", list, "a")
        _require(msg, "block_indexes", list, "a")
        if len(msg["keys"]) != len(msg["block_indexes"]):
            raise ValueError("keys/block_indexes length mismatch")
        if any(not isinstance(i, int) or i < 0 for i in msg["block_indexes"]):
            raise ValueError(f"block_indexes: invalid index in {msg['block_indexes']!r}")
    elif kind == TRANSFER_DONE:
        _require(msg, "kv_request_id", str, "a")
        _require(msg, "success", bool, "a")
        _require(msg, "round_seq", int, "non-negative")
    elif kind in (ABORT_FETCH, ABORT_ACK):
        _require(msg, "kv_request_id", str, "a")
        _require(msg, "round_seq", int, "non-negative")
    elif kind == LOOKUP:
        _require(msg, "kv_request_id", str, "a")
        _require(msg, "keys", list, "a")
        _require(msg, "round_seq", int, "non-negative")
    elif kind == LOOKUP_RESP:
        _require(msg, "kv_request_id", str, "a")
        _require(msg, "keys", list, "a")
        _require(msg, "hits", list, "a")
        if len(msg["keys"]) != len(msg["hits"]):
            raise ValueError("keys/hits length mismatch")
        if any(not isinstance(h, bool) for h in msg["hits"]):
            raise ValueError(f"hits: invalid value in {msg['hits']!r}")


def summarize(msg: Any) -> tuple:
    """What both worlds must agree on for one message: its type and every field but the
    data-plane handles (agent metadata, base address), the sender's address (the engines' ports
    differ between worlds; the direction is recorded beside the summary) and the handshake's
    compatibility fields (both engines of a world share one config, so they always match)."""
    if not isinstance(msg, dict):
        return ("<not a dict>", repr(msg))
    kind = msg.get(TYPE_KEY)
    if kind == CONNECT:
        return (kind, msg.get("num_blocks"), msg.get("block_len"))
    if kind == CONNECT_ACK:
        return (kind,)
    keys = _seq(msg.get("keys", ()), lambda k: bytes(k) if isinstance(k, (bytes, bytearray)) else k)
    return (kind, msg.get("kv_request_id"), msg.get("round_seq"), keys, _seq(msg.get("block_indexes", ())),
            msg.get("success"), _seq(msg.get("hits", ())))


def _seq(value: Any, item=lambda v: v) -> tuple:
    """A list field as a tuple; a malformed one (not a list: a peer out of protocol) as its repr."""
    if isinstance(value, (list, tuple)):
        return tuple(item(v) for v in value)
    return ("<not a list>", repr(value))
