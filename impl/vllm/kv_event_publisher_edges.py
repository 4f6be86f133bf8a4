"""vLLM 0.33.0's KV-event publishing beyond the plain ``inproc`` round trip
(:mod:`kvref.impl.vllm.kv_event_publisher`): the endpoints a KV-aware router really uses, the
batches and requests the publisher must survive, and the factory and aggregator around it
(``distributed/kv_events.py``, issue #22).

Each function drives vLLM's own classes on the batches the reference's traces produced and
returns the problems found (empty: everything as documented):

* :func:`check_tcp_streams` — ``tcp://*:0`` binds the node's IP (``VLLM_HOST_IP``, IPv4 and IPv6)
  on a port the OS picks and reports the bound endpoints; an address without ``*`` makes the
  publisher *connect* to a subscriber that binds. Over both, a subscriber gets every batch once,
  in order, with sequence numbers 0, 1, 2, ...; a batch carrying its own data-parallel rank keeps
  it; a batch that cannot be encoded is dropped but still uses up its sequence number (a router
  sees the gap and asks for a replay, which does not have it either); a malformed replay request
  gets no answer and the next request is answered as usual; a node IP of ``0.0.0.0`` is refused;
  a closed publisher refuses batches.
* :func:`check_publisher_factory` — ``EventPublisherFactory``: a registered publisher kind is
  built with the config's fields and the rank, a name registers once, an unknown kind is refused,
  and a disabled / ``null`` config gives the no-op publisher.
* :func:`check_aggregator_refusals` — ``KVEventAggregator`` refuses no workers, a non-list and a
  non-positive increment, and two connectors' event containers merge into one whose common
  events are those both reported.

The endpoints are on the loopback interface; nothing leaves the machine.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import random
from typing import Any

from kvref.impl.vllm.kv_event_publisher import compare_batch, replay_from
from kvref.impl.vllm.kv_events import parse_seq, vllm_event_to_plain

_ids = itertools.count()
#: how long a receive waits for the publisher thread before the round trip is reported broken
RECV_TIMEOUT_MS = 10_000
#: how long one probe waits for the subscription to reach the publisher
PROBE_MS = 50
_LOGGER = "vllm.distributed.kv_events"


@contextlib.contextmanager
def _host_ip(ip: str):
    """``VLLM_HOST_IP`` set to ``ip`` for the duration (vLLM reads it on each ``get_ip``; a cached
    environment is reset around the change)."""
    import vllm.envs as envs

    before = os.environ.get("VLLM_HOST_IP")
    os.environ["VLLM_HOST_IP"] = ip
    cached = envs._is_envs_cache_enabled()
    if cached:
        envs.disable_envs_cache()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("VLLM_HOST_IP", None)
        else:
            os.environ["VLLM_HOST_IP"] = before
        if cached:
            envs.enable_envs_cache()


@contextlib.contextmanager
def _quiet():
    """The publisher's logged tracebacks held back: the check provokes them on purpose."""
    lg = logging.getLogger(_LOGGER)
    was = lg.disabled
    lg.disabled = True
    try:
        yield
    finally:
        lg.disabled = was


def _uri(ip: str, port: int) -> str:
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"


class _Stream:
    """What a subscriber must see: the plain form of every batch that was encoded, by sequence."""

    def __init__(self, dp_rank: int, buffer_steps: int) -> None:
        self.dp_rank = dp_rank
        self.buffer_steps = buffer_steps
        self.sent: dict[int, tuple] = {}  # seq -> (ts, events, rank) of the batches encoded
        self.next_seq = 0

    def publish(self, pub, batch, ts: float, events, rank: int | None, bad: bool = False) -> None:
        if not bad:
            self.sent[self.next_seq] = (ts, [vllm_event_to_plain(e) for e in events],
                                        self.dp_rank if rank is None else rank)
        self.next_seq += 1  # vLLM takes the sequence number before it encodes
        pub.publish(batch)

    def kept(self) -> list[int]:
        return sorted(self.sent)[-self.buffer_steps:]


def _compare(where: str, topic: str, t: bytes, payload: bytes, want) -> list[str]:
    return compare_batch(where, t, topic, payload, want,
                         unpublished="a sequence number that was never published with an encodable batch")


def _probe_until_subscribed(pub, sub, stream: _Stream, batch_cls, topic: str) -> list[str]:
    """Empty batches until one reaches ``sub``: a tcp subscription takes a moment to reach the
    publisher, and the PUB socket drops what it sends before. Each probe is a batch of the stream."""
    import zmq

    for _ in range(RECV_TIMEOUT_MS // PROBE_MS):
        ts = -1.0 - stream.next_seq
        stream.publish(pub, batch_cls(ts=ts, events=[]), ts, [], None)
        if sub.poll(PROBE_MS, zmq.POLLIN):
            t, seq_frame, payload = sub.recv_multipart()
            seq = parse_seq(seq_frame)
            problems = _compare(f"probe batch {seq}", topic, t, payload, stream.sent.get(seq))
            # the rest of the probes that were already on the way
            while sub.poll(PROBE_MS, zmq.POLLIN):
                t, seq_frame, payload = sub.recv_multipart()
                seq2 = parse_seq(seq_frame)
                if seq2 != seq + 1:
                    problems.append(f"probe stream jumps from sequence {seq} to {seq2}")
                problems += _compare(f"probe batch {seq2}", topic, t, payload, stream.sent.get(seq2))
                seq = seq2
            if seq != stream.next_seq - 1:
                problems.append(f"probe stream ends at sequence {seq}, {stream.next_seq - 1} was published last")
            return problems
    return [f"no probe batch reached the subscriber within {RECV_TIMEOUT_MS} ms"]


def _publish_trace(pub, stream: _Stream, batches, rng: random.Random, batch_cls) -> None:
    """The trace's batches, some with their own data-parallel rank, one unencodable one."""
    bad_at = rng.randrange(len(batches) + 1)
    for i, events in enumerate(batches):
        if i == bad_at:
            stream.publish(pub, batch_cls(ts=-0.5, events=[object()]), -0.5, [], None, bad=True)
        rank = rng.choice((None, None, rng.randrange(8)))
        stream.publish(pub, batch_cls(ts=float(i), events=list(events), data_parallel_rank=rank),
                       float(i), events, rank)
    if bad_at == len(batches):
        stream.publish(pub, batch_cls(ts=-0.5, events=[object()]), -0.5, [], None, bad=True)


def _receive_rest(sub, stream: _Stream, first: int, topic: str) -> list[str]:
    """The live stream after the probes: every encoded batch from ``first`` on, in order."""
    want = [s for s in sorted(stream.sent) if s >= first]
    got, problems = [], []
    while len(got) < len(want):
        t, seq_frame, payload = sub.recv_multipart()
        seq = parse_seq(seq_frame)
        got.append(seq)
        problems += _compare(f"live batch {seq}", topic, t, payload, stream.sent.get(seq))
    if got != want:
        problems.append(f"live stream sequences {got}, expected {want} (an unencodable batch leaves a gap)")
    return problems


def _replay(req, start: int, stream: _Stream, topic: str, junk_first: bool) -> list[str]:
    if junk_first:  # a request of the wrong shape (from sequence 0): ignored, no answer
        req.send_multipart((b"", b"kvref", (0).to_bytes(8, "big")))
    expect = [s for s in stream.kept() if s >= start]
    got, problems = replay_from(req, start, lambda seq, t, payload: _compare(
        f"replay from {start}, batch {seq}", topic, t, payload, stream.sent.get(seq)))
    if got is not None and got != expect:
        problems.append(f"replay from {start} (buffer {stream.buffer_steps}) returned sequences {got}, "
                        f"expected {expect}" + (" after a malformed request" if junk_first else ""))
    return problems


def _bound_tcp(ip: str, batches, rng: random.Random) -> list[str]:
    """``tcp://*:0`` for both sockets with ``VLLM_HOST_IP=ip``: bound endpoints, stream, replays."""
    import zmq
    from vllm.config.kv_events import KVEventsConfig
    from vllm.distributed.kv_events import EventPublisherFactory, KVEventBatch

    topic = f"kvref-tcp-{next(_ids)}"
    buffer_steps = rng.randint(1, len(batches) + 4)
    dp_rank = rng.randrange(3)
    cfg = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://*:0",
                         replay_endpoint="tcp://*:0", buffer_steps=buffer_steps, topic=topic)
    with _host_ip(ip):
        pub = EventPublisherFactory.create(cfg, data_parallel_rank=dp_rank)
    problems: list[str] = []
    ctx = zmq.Context.instance()
    sub, req = ctx.socket(zmq.SUB), ctx.socket(zmq.DEALER)
    try:
        got = pub.get_publisher_config()
        for what, ep in (("endpoint", got.endpoint), ("replay endpoint", got.replay_endpoint)):
            prefix = _uri(ip, 0)[:-1]
            if not ep.startswith(prefix) or not ep[len(prefix):].isdigit() or int(ep[len(prefix):]) == 0:
                problems.append(f"tcp://*:0 with VLLM_HOST_IP={ip} reports the {what} {ep!r}, expected "
                                f"{prefix}<the port the OS picked>")
        if problems:
            return problems
        if got.endpoint == got.replay_endpoint:
            problems.append(f"the PUB and replay sockets report the same endpoint {got.endpoint}")
        for s in (sub, req):
            s.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
            s.setsockopt(zmq.LINGER, 0)
            if ":" in ip:
                s.setsockopt(zmq.IPV6, 1)
        sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        sub.connect(got.endpoint)
        req.connect(got.replay_endpoint)
        stream = _Stream(dp_rank, buffer_steps)
        problems += _probe_until_subscribed(pub, sub, stream, KVEventBatch, topic)
        first = stream.next_seq
        with _quiet():
            _publish_trace(pub, stream, batches, rng, KVEventBatch)
            problems += _receive_rest(sub, stream, first, topic)
            for i, start in enumerate((stream.kept()[-1], rng.randrange(stream.next_seq + 2))):
                problems += _replay(req, start, stream, topic, junk_first=i == 0)
            if req.poll(PROBE_MS * 2, zmq.POLLIN):
                problems.append(f"an answer nobody asked for on the replay socket: {req.recv_multipart()[:3]}")
    except zmq.Again:
        problems.append(f"tcp ({ip}): no answer from the publisher within {RECV_TIMEOUT_MS} ms")
    finally:
        sub.close(linger=0)
        req.close(linger=0)
        pub.shutdown()
    problems += _closed_refuses(pub)
    return problems


def _connecting(batches, rng: random.Random) -> list[str]:
    """An address without ``*``: the publisher connects to a subscriber that bound it; no replay."""
    import zmq
    from vllm.config.kv_events import KVEventsConfig
    from vllm.distributed.kv_events import EventPublisherFactory, KVEventBatch

    topic = f"kvref-connect-{next(_ids)}"
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    problems: list[str] = []
    pub = None
    try:
        sub.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        port = sub.bind_to_random_port("tcp://127.0.0.1")
        endpoint = f"tcp://127.0.0.1:{port}"
        cfg = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint,
                             replay_endpoint=None, buffer_steps=len(batches) + 1, topic=topic)
        pub = EventPublisherFactory.create(cfg, data_parallel_rank=0)
        got = pub.get_publisher_config()
        if (got.endpoint, got.replay_endpoint) != (endpoint, None):
            problems.append(f"a connecting publisher reports {got.endpoint!r}, {got.replay_endpoint!r}; "
                            f"expected {endpoint!r}, None")
        stream = _Stream(0, len(batches) + 1)
        problems += _probe_until_subscribed(pub, sub, stream, KVEventBatch, topic)
        first = stream.next_seq
        with _quiet():
            _publish_trace(pub, stream, batches, rng, KVEventBatch)
            problems += _receive_rest(sub, stream, first, topic)
    except zmq.Again:
        problems.append(f"connecting publisher: nothing received within {RECV_TIMEOUT_MS} ms")
    finally:
        sub.close(linger=0)
        if pub is not None:
            pub.shutdown()
    return problems


def _closed_refuses(pub) -> list[str]:
    from vllm.distributed.kv_events import KVEventBatch

    try:
        pub.publish(KVEventBatch(ts=0.0, events=[]))
    except RuntimeError:
        return []
    return ["a shut-down ZmqEventPublisher accepted a batch"]


def _unspecified_ip_refused() -> list[str]:
    """``tcp://*:0`` needs a node IP: with ``VLLM_HOST_IP=0.0.0.0`` the publisher is refused."""
    from vllm.config.kv_events import KVEventsConfig
    from vllm.distributed.kv_events import EventPublisherFactory

    cfg = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://*:0",
                         topic=f"kvref-refused-{next(_ids)}")
    try:
        with _host_ip("0.0.0.0"):
            pub = EventPublisherFactory.create(cfg)
    except ValueError:
        return []
    pub.shutdown()
    return ["tcp://*:0 with VLLM_HOST_IP=0.0.0.0 was bound instead of refused"]


def ipv6_loopback() -> bool:
    """Whether this machine can bind ``::1`` (the IPv6 part is run only where it can)."""
    import socket

    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def check_tcp_streams(batches: list[list[Any]], seed: int) -> list[str]:
    """The trace's ``batches`` (lists of vLLM ``KVCacheEvent``) through publishers bound on
    ``tcp://*:0`` (IPv4, and IPv6 where the machine has ``::1``) and through one that connects;
    returns the problems."""
    rng = random.Random(f"kv-event-tcp-{seed}")
    problems = _bound_tcp("127.0.0.1", batches, rng)
    if ipv6_loopback():
        problems += _bound_tcp("::1", batches, rng)
    problems += _connecting(batches, rng)
    problems += _unspecified_ip_refused()
    return problems


def check_publisher_factory(seed: int) -> list[str]:
    """``EventPublisherFactory``: registering, building and refusing publisher kinds; the no-op
    publisher for a disabled config."""
    from dataclasses import asdict

    from vllm.config.kv_events import KVEventsConfig
    from vllm.distributed.kv_events import EventPublisherFactory, NullEventPublisher

    rng = random.Random(f"kv-event-factory-{seed}")
    problems: list[str] = []
    name = f"kvref-recorder-{os.getpid()}-{next(_ids)}"
    built: list[dict] = []

    def recorder(**kwargs):
        built.append(kwargs)
        return NullEventPublisher(kwargs["data_parallel_rank"])

    cfg = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"inproc://{name}",
                         buffer_steps=rng.randint(1, 100), hwm=rng.randint(1, 1000), topic=name)
    EventPublisherFactory.register_publisher(name, recorder)
    try:
        try:
            EventPublisherFactory.register_publisher(name, recorder)
            problems.append(f"publisher kind {name!r} registered twice")
        except KeyError:
            pass
        object.__setattr__(cfg, "publisher", name)  # a kind registered by a plugin, not in the Literal
        rank = rng.randrange(4)
        pub = EventPublisherFactory.create(cfg, data_parallel_rank=rank)
        want = {k: v for k, v in asdict(cfg).items() if k not in ("publisher", "enable_kv_cache_events")}
        if built != [{"data_parallel_rank": rank, **want}]:
            problems.append(f"a registered kind was built with {built}, expected one call with rank {rank} and {want}")
        if pub.get_publisher_config() is not None:
            problems.append("a publisher without a resolved config reports one")
    finally:
        EventPublisherFactory._registry.pop(name, None)  # leave vLLM's registry as it was
    object.__setattr__(cfg, "publisher", name + "-unknown")
    try:
        EventPublisherFactory.create(cfg)
        problems.append("an unknown publisher kind was built")
    except ValueError:
        pass
    off = KVEventsConfig(enable_kv_cache_events=False, publisher="zmq")
    null = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    for c in (None, off, null):
        p = EventPublisherFactory.create(c)
        if type(p) is not NullEventPublisher:
            problems.append(f"config {c!r:.80} gave a {type(p).__name__}, expected the no-op publisher")
            continue
        if (p.publish(object()), p.shutdown(), p.get_publisher_config()) != (None, None, None):
            problems.append("the no-op publisher answered publish/shutdown/get_publisher_config")
    return problems


def check_aggregator_refusals(events: list[Any], seed: int) -> list[str]:
    """``KVEventAggregator``'s refusals and repr, and two connectors' KV event containers
    (``KVConnectorKVEvents.merge``) merged: all events of both, the common ones after
    ``aggregate``."""
    from vllm.distributed.kv_events import KVEventAggregator
    from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheKVEvents

    rng = random.Random(f"kv-event-agg-{seed}")
    problems: list[str] = []
    for bad, call in ((0, lambda: KVEventAggregator(0)), (-1, lambda: KVEventAggregator(-1)),
                      ("tuple", lambda: KVEventAggregator(1).add_events(tuple(events))),
                      ("increment 0", lambda: KVEventAggregator(1).increment_workers(0))):
        try:
            call()
            problems.append(f"KVEventAggregator accepted {bad}")
        except (ValueError, TypeError):
            pass
    events = [e for e in events if type(e).__name__ != "AllBlocksCleared"]  # not hashable in vLLM 0.33.0
    agg = KVEventAggregator(2)
    agg.add_events(list(events))
    if repr(agg) != f"<KVEventAggregator workers=2, events={len(set(map(repr, events)))}>":
        problems.append(f"repr {agg!r} for 2 workers and {len(set(map(repr, events)))} distinct events")
    a, b = LMCacheKVEvents(1), LMCacheKVEvents(1)
    mine = [e for e in events if rng.random() < 0.7]
    theirs = [e for e in events if rng.random() < 0.7]
    a.add_events(mine)
    b.add_events(theirs)
    merged = a.merge(b)
    if merged is not a or sorted(map(repr, a.get_all_events())) != sorted(map(repr, mine + theirs)):
        problems.append("merge does not hold both connectors' events in the first container")
    merged.increment_workers(1)
    common = sorted(map(repr, merged.aggregate().get_all_events()))
    counts = {}
    for e in mine + theirs:
        counts[repr(e)] = counts.get(repr(e), 0) + 1
    if common != sorted(k for k, n in counts.items() if n == 2):
        problems.append(f"after merge + aggregate over 2 workers: {len(common)} common events, expected those "
                        "both reported")
    return problems
