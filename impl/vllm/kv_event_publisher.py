"""vLLM 0.33.0's ``ZmqEventPublisher`` (``distributed/kv_events.py``) with a subscriber on the
other end: batches of KV cache events go out as a server sends them, come back through a SUB
socket and the replay ROUTER, and are decoded with kvref's own msgpack decoder
(:func:`kvref.impl.vllm.kv_events.decode_batch`, ``"generic"``: no vLLM struct), so every field
of every event is compared with what was published.

The facts checked (:func:`publish_and_subscribe`), from the publisher's documented protocol:

* the live stream carries ``(topic, seq, payload)`` with ``seq`` an 8-byte big-endian count
  0, 1, 2, ... per publisher, one per batch, in publish order, and the payload decodes to the
  batch (its ``ts``, its events, and the publisher's data-parallel rank filled in where the batch
  had none);
* a replay request (an 8-byte start sequence on the ROUTER) answers with every *kept* batch from
  that sequence on — the last ``buffer_steps`` published — as ``(b"", topic, seq, payload)``, then
  the end marker ``(b"", b"", -1, b"")``;
* a data-parallel rank ``r > 0`` moves an ``inproc`` endpoint to ``<endpoint>_dp<r>``, and the
  publisher's config reports the endpoints it bound.

Endpoints are ``inproc://`` (bound, as vLLM binds ipc/inproc addresses): nothing leaves the
process. The subscriber connects before the first batch; a batch the SUB socket still misses
while its subscription propagates is fetched by the replay instead, and the live stream must then
be a gap-free run ending at the last batch.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

from kvref.impl.vllm.kv_events import END_SEQ, decode_batch, parse_seq, vllm_event_to_plain

_ids = itertools.count()
#: how long a receive may wait for the publisher thread before the round trip is reported broken
RECV_TIMEOUT_MS = 10_000


def publish_and_subscribe(batches: list[list[Any]], buffer_steps: int, dp_rank: int = 1,
                          replay_from: tuple[int, ...] = (0,)) -> list[str]:
    """Publish ``batches`` (lists of vLLM ``KVCacheEvent`` objects, one batch per scheduler step)
    through vLLM's ``ZmqEventPublisher`` and check what a subscriber gets; returns the problems
    (empty: the stream and every replay are exactly right)."""
    import zmq
    from vllm.config.kv_events import KVEventsConfig
    from vllm.distributed.kv_events import EventPublisherFactory, KVEventBatch

    base = f"inproc://kvref-events-{os.getpid()}-{next(_ids)}"
    topic = "kvref"
    cfg = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=base,
                         replay_endpoint=base + "-replay", buffer_steps=buffer_steps, topic=topic)
    pub = EventPublisherFactory.create(cfg, data_parallel_rank=dp_rank)
    problems: list[str] = []
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    req = ctx.socket(zmq.DEALER)
    try:
        got_cfg = pub.get_publisher_config()
        suffix = f"_dp{dp_rank}" if dp_rank else ""
        if (got_cfg.endpoint, got_cfg.replay_endpoint) != (base + suffix, base + "-replay" + suffix):
            problems.append(f"endpoints {got_cfg.endpoint}, {got_cfg.replay_endpoint} for data-parallel rank "
                            f"{dp_rank} of {base}")
        for s in (sub, req):
            s.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
            s.setsockopt(zmq.LINGER, 0)
        sub.connect(got_cfg.endpoint)
        sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        req.connect(got_cfg.replay_endpoint)
        want = []
        for i, events in enumerate(batches):
            want.append((float(i), [vllm_event_to_plain(e) for e in events], dp_rank))
            pub.publish(KVEventBatch(ts=float(i), events=list(events)))
        live = _receive_live(sub, len(batches), problems)
        for seq, (t, payload) in live.items():
            problems += compare_batch(f"live batch {seq}", t, topic, payload, want[seq] if seq < len(want) else None)
        for start in replay_from:
            problems += _replay(req, start, buffer_steps, topic, want)
    except zmq.Again:
        problems.append(f"no answer from the publisher within {RECV_TIMEOUT_MS} ms")
    finally:
        sub.close(linger=0)
        req.close(linger=0)
        pub.shutdown()
    return problems


def _receive_live(sub, n: int, problems: list[str]) -> dict[int, tuple[bytes, bytes]]:
    """The live stream up to batch ``n - 1``: a gap-free run of sequence numbers ending there."""
    out: dict[int, tuple[bytes, bytes]] = {}
    last = -1
    while last < n - 1:
        topic, seq_frame, payload = sub.recv_multipart()
        seq = parse_seq(seq_frame)
        if out and seq != last + 1:
            problems.append(f"live stream jumps from sequence {last} to {seq}")
        if seq in out:
            problems.append(f"live stream repeats sequence {seq}")
        out[seq] = (topic, payload)
        last = seq
    return out


def _replay(req, start: int, buffer_steps: int, topic: str, want: list) -> list[str]:
    kept = range(max(0, len(want) - buffer_steps), len(want))
    expect = [s for s in kept if s >= start]
    got, problems = replay_from(req, start, lambda seq, t, payload: compare_batch(
        f"replay from {start}, batch {seq}", t, topic, payload, want[seq] if 0 <= seq < len(want) else None))
    if got is not None and got != expect:
        problems.append(f"replay from {start} (buffer {buffer_steps}, {len(want)} published) returned sequences "
                        f"{got}, expected {expect}")
    return problems


def replay_from(req, start: int, check) -> tuple[list[int] | None, list[str]]:
    """One replay of vLLM's ``ZmqEventPublisher`` (``_service_replay``) on the REQ socket ``req``:
    ask for every kept batch from sequence ``start``, read the ``(b"", topic, seq, payload)``
    replies up to the end marker (``END_SEQ``, empty topic and payload) and pass each batch to
    ``check(seq, topic, payload)``, which returns its problems. Returns the sequences replayed, in
    order, and the problems; the sequences are None where a reply of the wrong shape cut the
    replay short (nothing more can be read from the socket). The one replay loop of the publisher
    checks here and in :mod:`.kv_event_publisher_edges` (#26)."""
    req.send_multipart((b"", start.to_bytes(8, "big")))
    got: list[int] = []
    problems: list[str] = []
    while True:
        frames = req.recv_multipart()
        if len(frames) != 4 or frames[0] != b"":
            return None, problems + [f"replay from {start}: a reply of {len(frames)} frames"]
        _, t, seq_frame, payload = frames
        if seq_frame == END_SEQ:
            if (t, payload) != (b"", b""):
                problems.append(f"replay from {start}: the end marker carries {t!r}, {payload[:20]!r}")
            return got, problems
        seq = parse_seq(seq_frame)
        got.append(seq)
        problems += check(seq, t, payload)


def compare_batch(where: str, t: bytes, topic: str, payload: bytes, want,
                  unpublished: str = "a sequence number that was never published") -> list[str]:
    """What differs between a batch read back (topic ``t``, msgpack ``payload``) and the batch
    published under that sequence (``want``: ``(ts, events, data_parallel_rank)``, None where none
    was): ``unpublished``, a wrong topic, or a decoded batch that differs."""
    if want is None:
        return [f"{where}: {unpublished}"]
    if t != topic.encode():
        return [f"{where}: topic {t!r}, expected {topic!r}"]
    batch = decode_batch(payload, "generic")
    if (batch.ts, batch.events, batch.data_parallel_rank) != want:
        return [f"{where}: decoded {batch!r:.300} differs from the published batch {want!r:.300}"]
    return []


def check_worker_aggregation(per_worker: list[list[Any]]) -> list[str]:
    """vLLM's ``KVEventAggregator`` over the KV events several workers reported (each worker's list
    without repeats): the common events are exactly those every worker reported (routers must only
    learn of blocks stored on all ranks), all events are every worker's, and the worker count
    follows ``increment_workers`` / ``reset_workers``."""
    from vllm.distributed.kv_events import KVEventAggregator

    problems: list[str] = []
    n = len(per_worker)
    agg = KVEventAggregator(n)
    for events in per_worker:
        agg.add_events(list(events))
    key = repr
    common = set(map(key, per_worker[0])).intersection(*(set(map(key, w)) for w in per_worker[1:]))
    if sorted(map(key, agg.get_common_events())) != sorted(common):
        problems.append(f"{n} workers: common events {len(agg.get_common_events())}, expected {len(common)}")
    if sorted(map(key, agg.get_all_events())) != sorted(key(e) for w in per_worker for e in w):
        problems.append(f"{n} workers: all events differ from the workers' reports")
    agg.increment_workers(2)
    if agg.get_number_of_workers() != n + 2:
        problems.append(f"increment_workers(2) on {n} workers gives {agg.get_number_of_workers()}")
    agg.reset_workers()
    agg.clear_events()
    if agg.get_number_of_workers() != 1 or agg.get_all_events():
        problems.append("reset_workers / clear_events leave workers or events behind")
    return problems


def check_endpoint_offsets() -> list[str]:
    """``ZmqEventPublisher.offset_endpoint_port``: data-parallel rank ``r`` publishes on the port
    ``r`` above the configured one (tcp), or on ``<endpoint>_dp<r>`` (inproc); rank 0, port 0 (the
    OS picks), a tcp endpoint without a port and no endpoint are left as they are; anything else is
    refused."""
    from vllm.distributed.kv_events import ZmqEventPublisher

    off = ZmqEventPublisher.offset_endpoint_port
    cases = {("tcp://*:5557", 0): "tcp://*:5557", ("tcp://*:5557", 3): "tcp://*:5560",
             ("tcp://10.0.0.1:7000", 1): "tcp://10.0.0.1:7001", ("tcp://*:0", 2): "tcp://*:0",
             ("inproc://events", 2): "inproc://events_dp2", (None, 4): None, ("tcp", 1): "tcp"}
    problems = [f"offset_endpoint_port({e!r}, {r}) = {off(e, r)!r}, expected {want!r}"
                for (e, r), want in cases.items() if off(e, r) != want]
    try:
        off("ipc:///tmp/events", 1)
        problems.append("offset_endpoint_port accepted an ipc endpoint for rank 1")
    except ValueError:
        pass
    return problems
